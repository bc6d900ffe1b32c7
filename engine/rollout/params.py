"""What a rollout asks for and what it gives back."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[str] = field(default_factory=list)  # kept in the text; tokens after it are dropped
    eos_token_ids: list[int] = field(default_factory=list)  # empty: the model's eos ids

    def __post_init__(self) -> None:
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer; got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100] (0 = greedy); got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off); got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, eos included when the sequence ended on one
    logprobs: torch.Tensor  # (len(token_ids),) fp32: the sampler's log-prob of each token
    finish_reason: str  # stop | length | cancelled
    text: str  # decoded token_ids (special tokens skipped), cut right after a stop string

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
