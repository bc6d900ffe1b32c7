"""What every decode loop shares: sub-batches in prompt-length order, left padding, and the
per-row bookkeeping of a step (tokens, log-probs, eos / stop strings / length, cancellation).

The engines (engine.rollout.native, engine.rollout.cuda_graph) differ only in how they compute
the next logits; both drive ``sub_batches`` and a ``Rows`` per sub-batch, so they end rows,
cut stop strings and report finish reasons identically.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.rollout.params import Completion, SamplingParams
from engine.rollout.stops import StopStrings


def empty(prompt: list[int]) -> Completion:
    return Completion(list(prompt), [], torch.zeros(0), "cancelled", "")


def eos_ids(model, tokenizer, params: SamplingParams) -> set[int]:  # noqa: ANN001
    eos = set(params.eos_token_ids or getattr(model, "eos_token_ids", None) or [tokenizer.eos_token_id])
    eos.discard(None)
    return eos


def check_prompts(prompts: list[list[int]], max_batch: int) -> None:
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1; got {max_batch}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


def sub_batches(prompts: list[list[int]], max_batch: int, stop: Callable[[], bool],
                run: Callable[[list[list[int]]], tuple[list[Completion], bool]]) -> list[Completion]:
    """Prompts sorted by length, ``run`` on each sub-batch of ``max_batch``; once ``stop()`` says
    so (polled before each sub-batch) or a sub-batch was cancelled, the rest come back empty."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Completion | None] = [None] * len(prompts)
    cancelled = False
    for s in range(0, len(order), max_batch):
        idx = order[s:s + max_batch]
        cancelled = cancelled or stop()
        if cancelled:
            batch = [empty(prompts[i]) for i in idx]
        else:
            batch, cancelled = run([prompts[i] for i in idx])
        for i, c in zip(idx, batch):
            out[i] = c
    return out  # type: ignore[return-value]


def left_pad(prompts: list[list[int]], pad: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (B, longest) int64 on the CPU, prompts right-aligned."""
    pad = pad if pad is not None else 0
    plen = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), plen), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), plen, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, plen - len(p):] = torch.tensor(p)
        mask[r, plen - len(p):] = 1
    return ids, mask


class Rows:
    """The rows of one sub-batch while they decode. ``live[j]`` is the sub-batch row whose
    next token is at position j of the sampled tensor."""

    def __init__(self, tokenizer, params: SamplingParams, eos: set[int], n: int) -> None:  # noqa: ANN001
        self.tokenizer, self.params, self.eos = tokenizer, params, eos
        self.stops = StopStrings(tokenizer, params.stop)
        self.live = list(range(n))
        self.toks: list[list[int]] = [[] for _ in range(n)]
        self.lps: list[list[float]] = [[] for _ in range(n)]
        self.texts: list[str | None] = [None] * n
        self.finish: list[str | None] = [None] * n

    def record(self, nxt: torch.Tensor | list[int], lp: torch.Tensor | list[float]) -> list[int]:
        """Append one sampled token per live row; returns the positions j of the rows that go on."""
        keep = []
        nxt, lp = (v.tolist() if isinstance(v, torch.Tensor) else v for v in (nxt, lp))
        for j, (t, l) in enumerate(zip(nxt, lp)):
            r = self.live[j]
            self.toks[r].append(t)
            self.lps[r].append(l)
            hit = self.stops.check(self.toks[r]) if self.params.stop and t not in self.eos else None
            if t in self.eos:
                self.finish[r] = "stop"
            elif hit is not None:
                k, self.texts[r] = hit
                del self.toks[r][k:], self.lps[r][k:]
                self.finish[r] = "stop"
            elif len(self.toks[r]) >= self.params.max_new_tokens:
                self.finish[r] = "length"
            else:
                keep.append(j)
        return keep

    def cancel(self, keep: list[int]) -> None:
        for j in keep:
            self.finish[self.live[j]] = "cancelled"

    def completions(self, prompts: list[list[int]]) -> list[Completion]:
        outs = []
        for r, p in enumerate(prompts):
            text = self.texts[r] if self.texts[r] is not None else self.tokenizer.decode(self.toks[r],
                                                                                         skip_special_tokens=True)
            outs.append(Completion(list(p), self.toks[r], torch.tensor(self.lps[r], dtype=torch.float32),
                                   self.finish[r] or "length", text))
        return outs
