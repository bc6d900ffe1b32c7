"""AdamW over the adapter parameters, warmup + decay schedule, gradient clipping.

QeRL: AdamW betas (0.9, 0.99), weight decay 0.1, 10% linear warmup, cosine decay to 0,
grad-norm clip 0.2. 8-bit AdamW (bitsandbytes) is used when ``spec.eight_bit`` is True, or
when it is None and bitsandbytes imports and the parameters live on CUDA; otherwise torch's
AdamW (fused on CUDA). Both optimizers and the LambdaLR scheduler round-trip via state_dict.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from engine.spec import OptimSpec


def bitsandbytes_adamw():
    """bitsandbytes' AdamW8bit class, or None when the library is missing or cannot load."""
    try:
        import bitsandbytes as bnb  # noqa: PLC0415 - optional dependency

        return bnb.optim.AdamW8bit
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None


def uses_eight_bit(spec: OptimSpec, device: torch.device | str) -> bool:
    """Whether ``build_optimizer`` picks 8-bit AdamW for this spec and device."""
    on_cuda = torch.device(device).type == "cuda"
    if spec.eight_bit is False:
        return False
    available = on_cuda and bitsandbytes_adamw() is not None
    if spec.eight_bit and not available:
        raise ValueError("optim.eight_bit is true but bitsandbytes AdamW8bit needs the bitsandbytes package "
                         "and a CUDA device; install bitsandbytes or set optim.eight_bit to null/false")
    return available


def build_optimizer(params: Iterable[Tensor], spec: OptimSpec, device: torch.device | str) -> Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: the adapter has none (check lora.target_modules)")
    kwargs = dict(lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
    if uses_eight_bit(spec, device):
        return bitsandbytes_adamw()(params, **kwargs)
    fused = torch.device(device).type == "cuda" and all(p.is_cuda and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def lr_factor(step: int, total_steps: int, spec: OptimSpec) -> float:
    """Multiplier of spec.lr at 0-based ``step``: linear warmup to 1, then the decay shape.

    Warmup over ceil(warmup_ratio * total) steps reaches the full rate on its last step (step 0
    already trains at lr/warmup); decay runs from there to 0 at ``total_steps``."""
    warmup = math.ceil(spec.warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if spec.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if spec.schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: Optimizer, spec: OptimSpec, total_steps: int) -> LambdaLR:
    """LambdaLR stepped once per optimizer step."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1; got {total_steps}")
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, spec))


def clip_grad_norm(params: Iterable[Tensor], max_norm: float) -> float:
    """Clip the global L2 grad norm to ``max_norm`` (0: no clipping); return the norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in grads]))
    return float(norm)
