"""From prompts and rollouts to the tensors the learner trains on.

Prompts are chat-templated once, then walked in a seeded order per epoch (``DataCursor``, whose
(epoch, position) a checkpoint stores).

Sequence i is prompt + completion, right-padded to the batch's longest. ``logp[:, t]`` scores
token t+1 (as ``CausalLM.token_logprobs`` returns it), so completion token j of a prompt of
length P sits at column P - 1 + j of ``loss_mask`` and ``sampler_logp``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import Tensor

from engine.types import TrainError


def encode_prompts(tokenizer: Any, examples: Sequence[Any], max_tokens: int, split: str) -> list[list[int]]:
    """Chat-template each example's messages (generation prompt added) to token ids.

    A prompt longer than ``max_tokens`` is rejected rather than cut: a truncated question is a
    different question. The error names the row (its line in the JSONL file when known)."""
    out = []
    for i, ex in enumerate(examples):
        ids = apply_chat_template(tokenizer, ex.messages)
        if len(ids) > max_tokens:
            where = _row_name(ex, i)
            raise TrainError("invalid_dataset", f"{where} ({split} split): the prompt is {len(ids)} tokens, more than "
                                                f"data.max_prompt_tokens={max_tokens}; shorten it or raise "
                                                f"data.max_prompt_tokens")
        out.append(ids)
    return out


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _row_name(example: Any, index: int) -> str:
    line = getattr(example, "line", None)
    if line is None and isinstance(getattr(example, "item", None), dict):
        line = example.item.get("_line")
    return f"line {line}" if line is not None else f"row {index + 1}"


class DataCursor:
    """Walks the training prompts in a fresh seeded permutation per epoch; (epoch, pos) is its state."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise TrainError("invalid_dataset", "the training split is empty; add rows or lower data.eval_size")
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n}

    def load(self, state: dict[str, int]) -> None:
        if state["n"] != self.n:
            raise TrainError("invalid_checkpoint", f"the checkpoint was taken on {state['n']} training prompts, "
                                                   f"this dataset has {self.n}; resume with the same data")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._permutation()


@dataclasses.dataclass
class RolloutBatch:
    input_ids: Tensor  # (B, T) long, prompt + completion, right-padded
    attention_mask: Tensor  # (B, T) long, 1 = token
    loss_mask: Tensor  # (B, T-1) fp32, 1 where logp[:, t] scores a completion token
    sampler_logp: Tensor  # (B, T-1) fp32, the sampler's log-prob of that token (0 elsewhere)
    advantages: Tensor  # (B,) fp32
    truncated: Tensor  # (B,) bool, finish_reason "length"
    first_col: int = 0  # columns before it are prompt only (token_logprobs may skip them)
    old_logp: Tensor | None = None  # (B, T-1) learner before the update (rl.mu > 1)
    ref_logp: Tensor | None = None  # (B, T-1) LoRA disabled (rl.kl_coef > 0)

    def split(self, size: int) -> list["RolloutBatch"]:
        """Micro-batches of ``size`` rows, each cut to its own longest sequence."""
        out = []
        for s in range(0, self.input_ids.shape[0], size):
            rows = slice(s, s + size)
            t = int(self.attention_mask[rows].sum(dim=1).max())
            first = int(self.loss_mask[rows].argmax(dim=1).min()) if bool(self.loss_mask[rows].any()) else 0
            out.append(RolloutBatch(
                input_ids=self.input_ids[rows, :t], attention_mask=self.attention_mask[rows, :t],
                loss_mask=self.loss_mask[rows, : t - 1], sampler_logp=self.sampler_logp[rows, : t - 1],
                advantages=self.advantages[rows], truncated=self.truncated[rows], first_col=first))
        return out


def build_batch(completions: Sequence[Any], advantages: Tensor, *, pad_id: int,
                device: torch.device | str = "cpu") -> RolloutBatch:
    """Pad ``completions`` (engine.rollout.Completion) into one batch with their advantages (B,)."""
    lengths = [len(c.prompt_ids) + len(c.token_ids) for c in completions]
    B, T = len(completions), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T - 1), dtype=torch.float32)
    sampler_logp = torch.zeros((B, T - 1), dtype=torch.float32)
    for i, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.token_ids)
        input_ids[i, : p + n] = torch.tensor(list(c.prompt_ids) + list(c.token_ids), dtype=torch.long)
        attention_mask[i, : p + n] = 1
        if n:
            loss_mask[i, p - 1 : p - 1 + n] = 1.0
            sampler_logp[i, p - 1 : p - 1 + n] = torch.as_tensor(c.logprobs, dtype=torch.float32).reshape(-1)[:n]
    truncated = torch.tensor([c.finish_reason == "length" for c in completions], dtype=torch.bool)
    return RolloutBatch(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                        loss_mask=loss_mask.to(device), sampler_logp=sampler_logp.to(device),
                        advantages=advantages.detach().float().to(device), truncated=truncated.to(device))
