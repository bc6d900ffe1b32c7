"""Frozen base-weight formats: NVFP4 (QeRL), NF4 (QLoRA baseline), bf16 (LoRA baseline).

Every decoder linear of the base model becomes a ``FrozenLinear`` through ``quantize_linear``;
q/k/v and gate/up share one NVFP4 global scale (``global_scale_for``) so the checkpoint
matches what vLLM fuses.
"""
from __future__ import annotations

import torch

from engine.quant.base import BF16Linear, FrozenLinear, frozen_matmul
from engine.quant.nf4 import NF4Linear
from engine.quant.nvfp4 import NVFP4Linear, global_scale_for

FORMATS = ("nvfp4", "nf4", "bf16")


def quantize_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    *,
    global_scale: torch.Tensor | None = None,
) -> FrozenLinear:
    """Store a dense [out, in] weight (and optional bias) in format ``fmt``.

    NVFP4 quantizes in the weight's own dtype (pass bf16 weights, as llm-compressor sees
    them, to get its exact codes); ``global_scale`` shares one scale across a fused group.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(FORMATS)}")
    if global_scale is not None and fmt != "nvfp4":
        raise ValueError(f"global_scale only applies to nvfp4, not {fmt!r}; pass global_scale=None")
    if fmt == "nvfp4":
        return NVFP4Linear.from_float(weight, bias, global_scale=global_scale)
    if fmt == "nf4":
        return NF4Linear.from_float(weight, bias)
    return BF16Linear(weight, bias)


__all__ = [
    "FORMATS",
    "BF16Linear",
    "FrozenLinear",
    "NF4Linear",
    "NVFP4Linear",
    "frozen_matmul",
    "global_scale_for",
    "quantize_linear",
]
