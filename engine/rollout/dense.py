"""Rollouts on CPU: dequantize the quantized base once per rollout instead of once per step.

A FrozenLinear dequantizes its weight on every call (the QeRL training path). During a
rollout the base does not change, and on CPU the per-step dequantization costs several times
the matmul itself, so ``dequantized_base`` serves each quantized projection from one dense
copy for the duration of the block. The numbers are identical (same dequantize, same
matmul); the cost is one dense copy of the base while the block runs, which is why it is off
on GPUs (there the fused kernels read the 4-bit weights directly).
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch
from torch import nn

from engine.quant.base import FrozenLinear


def _dense_matmul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, weight.to(x.dtype).t())


@contextmanager
def dequantized_base(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    layers = [m for m in model.modules() if isinstance(m, FrozenLinear) and m.fmt != "bf16"] if enabled else []
    try:
        for layer in layers:
            # an instance attribute shadows the class's _matmul until it is removed
            layer._matmul = partial(_dense_matmul, layer.dequantize(model.dtype))
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("_matmul", None)
