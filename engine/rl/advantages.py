"""Group-relative advantages (GRPO family) and the dynamic-sampling group filter.

Rollouts come as N prompts x G samples laid out prompt-major: rows g*G .. g*G+G-1 belong to
prompt g. The advantage of a sample is its reward minus its group's mean, divided by the
group's std (unbiased, as TRL computes it) plus ``eps`` when ``std_normalize`` (GRPO, DAPO),
or left unscaled (Dr.GRPO, which argues the std division biases towards easy/hard prompts).
A group whose rewards are all equal carries no signal: its advantages are exactly zero, and
DAPO's dynamic sampling drops it so it does not dilute the token-mean denominator.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.spec import RLSpec


def group_advantages(rewards: Tensor, group_size: int, *, std_normalize: bool, eps: float) -> tuple[Tensor, Tensor]:
    """Return (advantages (N*G,) fp32, zero_var (N,) bool) for prompt-major rewards (N*G,)."""
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries; "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.detach().float().view(-1, group_size)  # (N, G)
    mean = r.mean(dim=1, keepdim=True)  # (N, 1)
    adv = r - mean
    if std_normalize:
        std = r.std(dim=1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(mean)
        adv = adv / (std + eps)
    zero_var = (r.max(dim=1).values - r.min(dim=1).values) <= 1e-9  # (N,)
    adv = torch.where(zero_var[:, None], torch.zeros_like(adv), adv)  # exact zeros, no rounding noise
    return adv.reshape(-1), zero_var


def keep_groups(zero_var: Tensor, group_size: int, spec: RLSpec) -> Tensor:
    """Rows (N*G,) bool to train on: all rows, or (dynamic sampling) those of groups with reward variance."""
    keep = ~zero_var if spec.dynamic_sampling else torch.ones_like(zero_var)
    return keep.repeat_interleave(group_size)
