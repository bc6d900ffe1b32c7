"""Native batched sampler on CausalLM's KV cache (token ids in, token ids out).

Prompts are sorted by length and decoded in sub-batches of ``max_batch``; each sub-batch is
left-padded, prefilled once, then decoded one token per step for all live rows. A row ends
on an eos id (kept as its last token), on a stop string (text cut after it, later tokens
dropped) or at ``max_new_tokens``; finished rows leave the cache, so the rest decode
cheaper. ``should_stop()`` is polled before each sub-batch and between decode steps: then
every unfinished row ends "cancelled" with what it has, and prompts not started come back
empty and "cancelled". The model runs in eval mode (no LoRA dropout) with whatever AQN
noise is set on its norms.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.rollout.dense import dequantized_base
from engine.rollout.params import Completion, SamplingParams
from engine.rollout.sampler import sample_next
from engine.rollout.stops import StopStrings


def generate(model, tokenizer, prompts: list[list[int]], params: SamplingParams, *,
             generator: torch.Generator | None = None, should_stop: Callable[[], bool] | None = None,
             max_batch: int = 64, dense_base: bool | None = None) -> list[Completion]:
    """One Completion per prompt, in prompt order. ``dense_base`` (default: on for CPU models)
    dequantizes the base once for the whole rollout (engine.rollout.dense)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1; got {max_batch}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos = set(params.eos_token_ids or getattr(model, "eos_token_ids", None) or [tokenizer.eos_token_id])
    eos.discard(None)
    stop = should_stop or (lambda: False)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Completion | None] = [None] * len(prompts)
    was_training = model.training
    model.eval()
    dense = model.device.type == "cpu" if dense_base is None else dense_base
    try:
        with dequantized_base(model, dense):
            cancelled = False
            for s in range(0, len(order), max_batch):
                idx = order[s:s + max_batch]
                cancelled = cancelled or stop()
                if cancelled:
                    batch = [_empty(prompts[i]) for i in idx]
                else:
                    batch, cancelled = _generate_batch(model, tokenizer, [prompts[i] for i in idx], params, eos,
                                                       generator, stop)
                for i, c in zip(idx, batch):
                    out[i] = c
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]


def _empty(prompt: list[int]) -> Completion:
    return Completion(list(prompt), [], torch.zeros(0), "cancelled", "")


@torch.inference_mode()
def _generate_batch(model, tokenizer, prompts: list[list[int]], params: SamplingParams, eos: set[int],
                    generator: torch.Generator | None, stop: Callable[[], bool]) -> tuple[list[Completion], bool]:
    b, plen = len(prompts), max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((b, plen), pad, dtype=torch.long)
    mask = torch.zeros(b, plen, dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding
        ids[r, plen - len(p):] = torch.tensor(p)
        mask[r, plen - len(p):] = 1
    cache = model.new_cache(b, plen + params.max_new_tokens)
    hidden = model(ids.to(model.device), mask.to(model.device), cache)[:, -1]  # (B, H)
    stops = StopStrings(tokenizer, params.stop)
    live = list(range(b))  # cache row j holds sub-batch row live[j]
    toks: list[list[int]] = [[] for _ in range(b)]
    lps: list[list[float]] = [[] for _ in range(b)]
    texts: list[str | None] = [None] * b
    finish: list[str | None] = [None] * b
    cancelled = False
    for _ in range(params.max_new_tokens):
        logits = model.logits(hidden).float()  # (b_live, V)
        nxt, lp = sample_next(logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                              generator=generator)
        keep = []
        for j, (t, l) in enumerate(zip(nxt.tolist(), lp.tolist())):
            r = live[j]
            toks[r].append(t)
            lps[r].append(l)
            hit = stops.check(toks[r]) if params.stop and t not in eos else None
            if t in eos:
                finish[r] = "stop"
            elif hit is not None:
                n, texts[r] = hit
                del toks[r][n:], lps[r][n:]
                finish[r] = "stop"
            elif len(toks[r]) >= params.max_new_tokens:
                finish[r] = "length"
            else:
                keep.append(j)
        if not keep:
            break
        if stop():
            cancelled = True
            for j in keep:
                finish[live[j]] = "cancelled"
            break
        if len(keep) < len(live):
            rows = torch.tensor(keep, device=nxt.device)
            cache.keep(rows)
            nxt = nxt.index_select(0, rows)
            live = [live[j] for j in keep]
        hidden = model(nxt[:, None], None, cache)[:, -1]
    outs = []
    for r in range(b):
        text = texts[r] if texts[r] is not None else tokenizer.decode(toks[r], skip_special_tokens=True)
        outs.append(Completion(list(prompts[r]), toks[r], torch.tensor(lps[r], dtype=torch.float32),
                               finish[r] or "length", text))
    return outs, cancelled
