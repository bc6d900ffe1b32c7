"""The frozen base linear: one interface for every storage format.

A ``FrozenLinear`` holds a frozen weight in some storage format (bf16, NVFP4, NF4) and
computes ``y = x @ W^T (+ bias)``. Forward and backward both go through ``frozen_matmul``,
the single function the GPU kernels replace: on CPU it dequantizes to the activation dtype
and calls torch.matmul; backward gives dX = dY @ W (the base is frozen: no dW).

Subclasses implement ``dequantize()`` (-> [out, in] tensor in ``dtype``) and may override
``_matmul(x)`` / ``_matmul_t(dy)`` with fused kernels.
"""
from __future__ import annotations

import torch
from torch import nn


class FrozenLinear(nn.Module):
    fmt: str = "base"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        if bias is not None:
            self.register_buffer("bias", bias.detach().clone())
        else:
            self.bias = None

    # -- to implement --------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as a dense [out, in] tensor in ``dtype``."""
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in) -> (..., out)
        return torch.matmul(x, self.dequantize(x.dtype).t())

    def _matmul_t(self, dy: torch.Tensor) -> torch.Tensor:  # dy: (..., out) -> (..., in)
        return torch.matmul(dy, self.dequantize(dy.dtype))

    # -- shared --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = frozen_matmul(x, self)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class _FrozenMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: FrozenLinear) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        return layer._matmul(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        return ctx.layer._matmul_t(dy), None


def frozen_matmul(x: torch.Tensor, layer: FrozenLinear) -> torch.Tensor:
    """x @ W^T for a frozen layer; gradients flow to x only."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _FrozenMatmul.apply(x, layer)
    return layer._matmul(x)


class BF16Linear(FrozenLinear):
    """The plain-LoRA baseline: the weight kept as is (bf16 by default)."""

    fmt = "bf16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16):
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight", weight.detach().to(dtype).contiguous())

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.weight.to(dtype)
