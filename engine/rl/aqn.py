"""Adaptive Quantization Noise (QeRL): channel-wise Gaussian noise on the RMSNorm weights
that feed q/k/v and gate/up, which equals multiplicative row noise on those quantized layers.

Schedule: the run is cut into K equal stages; stage 0 is noise-free, and stage k >= 1 uses
    sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))
so sigma decays geometrically from sigma_start (stage 1) to sigma_end (stage K-1). With K = 2
the single noisy stage uses sigma_start. Noise is resampled once per rollout step by the caller.

The noise is kept in fp32 beside the norm (``norm.noise``, shape (H,)), never folded into a
bf16 weight: bf16 has ~3 significant digits and would round noise below ~4e-3 away.
"""
from __future__ import annotations

from typing import Iterable, Protocol

import torch
from torch import Tensor

from engine.spec import AQNSpec


class NoisyNorm(Protocol):
    weight: Tensor
    noise: Tensor | None


def stage_for_step(step: int, total_steps: int, stages: int) -> int:
    """The stage (0..K-1) that 0-based ``step`` falls in when ``total_steps`` are cut into K stages."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1; got {total_steps}")
    step = min(max(step, 0), total_steps - 1)
    return min(stages - 1, step * stages // total_steps)


def sigma_for_stage(stage: int, spec: AQNSpec) -> float:
    if not spec.enabled or stage <= 0:
        return 0.0
    k_last = spec.stages - 2
    if k_last <= 0:
        return float(spec.sigma_start)
    return float(spec.sigma_start * (spec.sigma_end / spec.sigma_start) ** ((stage - 1) / k_last))


def sigma_for_step(step: int, total_steps: int, spec: AQNSpec) -> float:
    """Noise std for 0-based optimizer ``step`` of a ``total_steps`` run (0.0 when disabled)."""
    return sigma_for_stage(stage_for_step(step, total_steps, spec.stages), spec)


def apply_noise(norms: Iterable[NoisyNorm], sigma: float, generator: torch.Generator | None = None) -> None:
    """Draw a fresh fp32 N(0, sigma^2) vector of shape (H,) for each norm; sigma 0 clears it.

    Draws on the generator's device and moves the result, so a CPU generator gives the same
    noise whatever device the model sits on."""
    if sigma <= 0:
        clear_noise(norms)
        return
    gen_device = generator.device if generator is not None else torch.device("cpu")
    for norm in norms:
        (h,) = norm.weight.shape
        z = torch.randn(h, generator=generator, device=gen_device, dtype=torch.float32) * sigma  # (H,)
        norm.noise = z.to(norm.weight.device)


def clear_noise(norms: Iterable[NoisyNorm]) -> None:
    for norm in norms:
        norm.noise = None
