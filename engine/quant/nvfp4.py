"""NVFP4 weight storage, bit-exact with compressed-tensors ``nvfp4-pack-quantized`` (NVFP4A16).

Layout (what vLLM, transformers and llm-compressor read):
  weight_packed        uint8 [out, in/2]          E2M1 codes, element 2j in the low nibble
  weight_scale         float8_e4m3fn [out, in/16] one scale per 16 input elements
  weight_global_scale  float32 [1]                448 * 6 / amax(|W|)
  dequant: W = e2m1(code) * (scale / global_scale)

An E2M1 code is sign << 3 | index into {0, .5, 1, 1.5, 2, 3, 4, 6}; rounding is to nearest
with ties to the even index, after clamping to +-6.

The arithmetic repeats compressed-tensors' operations one for one (llm-compressor computes
the global scale and the block amax in the weight's own dtype, then the block scale in fp32)
so the codes and scales are identical, not merely close. Rows are processed in chunks so a
7B layer quantizes without a full-size fp32 copy.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

import torch

from engine.quant.base import FrozenLinear

BLOCK = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
FP8_ZERO_SCALE = 0.125  # compressed-tensors replaces a block scale of 0 by fp8's eps
CHUNK_ELEMENTS = 1 << 24  # elements per quantization chunk (~64 MB of fp32 temporaries)

# value of each 4-bit code: sign << 3 | magnitude index
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Set to False to force the dequantize + torch.matmul reference path (tests, debugging).
use_kernels = True


def _check_weight(weight: torch.Tensor) -> None:
    if weight.ndim != 2:
        raise ValueError(f"NVFP4 quantizes 2-D [out, in] weights; got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"NVFP4 quantizes floating-point weights; got {weight.dtype}")
    if weight.shape[1] % BLOCK != 0:
        raise ValueError(
            f"NVFP4 needs in_features divisible by {BLOCK} (one fp8 scale per {BLOCK} inputs); "
            f"got in_features={weight.shape[1]}. Keep this layer in bf16 (quantization='bf16') "
            f"or pad its input dimension to a multiple of {BLOCK}."
        )


def _global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """448*6/amax in amax's dtype, as compressed-tensors' generate_gparam computes it."""
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    scale = (FP8_MAX * FP4_MAX) / amax  # same Python expression: reciprocal, then multiply
    scale = torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


def global_scale_for(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The one global scale shared by a fused group (q/k/v or gate/up): 448*6 / max amax.

    vLLM fuses these projections into one GEMM with one global scale, so llm-compressor
    gives the group the minimum of the members' scales; rounding is monotonic, so that is
    the scale of the group's largest amax.
    """
    if not weights:
        raise ValueError("global_scale_for needs at least one weight")
    dtype = weights[0].dtype
    for w in weights[1:]:
        dtype = torch.promote_types(dtype, w.dtype)
    amax = torch.stack([w.detach().abs().amax().to(dtype) for w in weights]).amax()
    return _global_scale_from_amax(amax)


def _block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of the e4m3 block scales, as compressed-tensors' calculate_qparams."""
    six = torch.tensor(FP4_MAX, dtype=block_amax.dtype, device=block_amax.device)
    scales = global_scale * (block_amax / six)  # amax/6 in the weight dtype, then fp32
    scales = torch.clamp(scales, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(scales == 0, torch.full_like(scales, FP8_ZERO_SCALE), scales)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale) to 4-bit E2M1 codes (uint8)."""
    x = torch.clamp(scaled, -FP4_MAX, FP4_MAX)
    a = x.abs()
    # thresholds between neighbours; '>' vs '>=' sends each tie to the even index
    idx = (a > 0.25).to(torch.uint8)
    idx += a >= 0.75
    idx += a > 1.25
    idx += a >= 1.75
    idx += a > 2.5
    idx += a >= 3.5
    idx += a > 5.0
    idx |= (x < 0).to(torch.uint8) << 3
    return idx


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] -> packed uint8 [..., n/2]; element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., n/2] -> codes uint8 [..., n]."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


@torch.no_grad()
def quantize_nvfp4(
    weight: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (weight_packed uint8 [out, in/2], weight_scale e4m3 [out, in/16],
    weight_global_scale fp32 [1]). Pass ``global_scale`` to share one across a fused group."""
    _check_weight(weight)
    out_f, in_f = weight.shape
    weight = weight.detach()
    if global_scale is None:
        global_scale = global_scale_for([weight])
    global_scale = global_scale.detach().to(device=weight.device, dtype=torch.float32).reshape(1)
    packed = torch.empty(out_f, in_f // 2, dtype=torch.uint8, device=weight.device)
    scale_fp8 = torch.empty(out_f, in_f // BLOCK, dtype=torch.float8_e4m3fn, device=weight.device)
    rows = max(1, chunk_elements // in_f)
    for r0 in range(0, out_f, rows):
        w = weight[r0 : r0 + rows].unflatten(-1, (-1, BLOCK))  # (r, in/16, 16)
        scales = _block_scales(w.abs().amax(dim=-1), global_scale)  # (r, in/16) fp32
        effective = scales / global_scale
        codes = _e2m1_codes(w / effective.unsqueeze(-1))  # fp32 division, as compressed-tensors
        packed[r0 : r0 + rows] = pack_codes(codes.flatten(-2))
        scale_fp8[r0 : r0 + rows] = scales.to(torch.float8_e4m3fn)
    return packed, scale_fp8, global_scale.clone()


@torch.no_grad()
def dequantize_nvfp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """(packed, scale, global_scale) -> W [out, in] in ``dtype``: e2m1 * (scale / global_scale)
    in fp32, rounded once to ``dtype`` (compressed-tensors' order of operations)."""
    out_f, in_f = weight_packed.shape[0], weight_packed.shape[1] * 2
    device = weight_packed.device
    table = E2M1_VALUES.to(device)
    gs = weight_global_scale.to(device=device, dtype=torch.float32).reshape(1)
    out = torch.empty(out_f, in_f, dtype=dtype, device=device)
    rows = max(1, chunk_elements // in_f)
    for r0 in range(0, out_f, rows):
        codes = unpack_codes(weight_packed[r0 : r0 + rows]).to(torch.int32)
        values = table[codes].unflatten(-1, (-1, BLOCK))  # (r, in/16, 16) fp32
        effective = weight_scale[r0 : r0 + rows].to(torch.float32) / gs
        out[r0 : r0 + rows] = (values * effective.unsqueeze(-1)).flatten(-2).to(dtype)
    return out


def _kernels(x: torch.Tensor) -> ModuleType | None:
    """engine.kernels when it is importable and handles this input, else None."""
    if not use_kernels:
        return None
    try:
        kernels = importlib.import_module("engine.kernels")
    except ImportError:
        return None
    available = getattr(kernels, "nvfp4_available", None)
    return kernels if available is not None and available(x) else None


def keep_buffer_dtypes(module: torch.nn.Module, names: Sequence[str], fn, recurse: bool) -> torch.nn.Module:
    """Module._apply that moves the named buffers across devices but never casts them:
    ``model.to(torch.bfloat16)`` must not round an fp32 global scale or change packed codes."""
    before = {n: getattr(module, n) for n in names}
    torch.nn.Module._apply(module, fn, recurse)
    for n, old in before.items():
        new = getattr(module, n)
        if new.dtype != old.dtype:
            setattr(module, n, old.to(new.device))
    return module


class NVFP4Linear(FrozenLinear):
    """A frozen linear layer stored in NVFP4 (4.5 bits per weight)."""

    fmt = "nvfp4"
    _locked = ("weight_packed", "weight_scale", "weight_global_scale")

    def __init__(
        self,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_global_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        out_f, half_in = weight_packed.shape
        in_f = half_in * 2
        if weight_packed.dtype != torch.uint8:
            raise ValueError(f"weight_packed must be uint8, got {weight_packed.dtype}")
        if in_f % BLOCK != 0 or tuple(weight_scale.shape) != (out_f, in_f // BLOCK):
            raise ValueError(
                f"weight_scale shape {tuple(weight_scale.shape)} does not match weight_packed "
                f"{tuple(weight_packed.shape)}: expected ({out_f}, {in_f // BLOCK})"
            )
        if weight_global_scale.numel() != 1:
            raise ValueError(f"weight_global_scale must have one element, got {weight_global_scale.numel()}")
        super().__init__(in_f, out_f, bias)
        self.register_buffer("weight_packed", weight_packed.detach().contiguous())
        self.register_buffer("weight_scale", weight_scale.detach().to(torch.float8_e4m3fn).contiguous())
        self.register_buffer("weight_global_scale", weight_global_scale.detach().to(torch.float32).reshape(1))

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        global_scale: torch.Tensor | None = None,
    ) -> NVFP4Linear:
        """Quantize a dense [out, in] weight (in its own dtype, as llm-compressor does)."""
        return cls(*quantize_nvfp4(weight, global_scale), bias=bias)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        packed, scale = self.source_buffers()
        return dequantize_nvfp4(packed, scale, self.weight_global_scale, dtype)

    # -- one copy of the base: the kernel operand ------------------------------------------
    # ``resident`` is the layer's engine.kernels.PreparedNVFP4 once the compressed-tensors
    # buffers were dropped (make_resident): rollouts and training then read that one copy, and
    # state_dict / dequantize rebuild the buffers from it (engine.quant.nvfp4_resident).
    resident = None

    def make_resident(self, prepared=None) -> None:  # noqa: ANN001 - engine.kernels.PreparedNVFP4
        """Keep only the kernel operand (``prepared``, or this layer's own repack)."""
        if prepared is None:
            from engine.kernels import prepare

            prepared = self.resident if self.resident is not None else prepare(self)
        if (prepared.n, prepared.k) != (self.out_features, self.in_features):
            raise ValueError(f"operand is {prepared.n} x {prepared.k}, the layer {self.out_features} x {self.in_features}")
        self.resident = prepared
        self._buffers["weight_packed"] = None
        self._buffers["weight_scale"] = None
        self.__dict__.pop("_nvfp4_prepared", None)

    def source_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight_packed, weight_scale) as compressed-tensors stores them."""
        if self.resident is None:
            return self.weight_packed, self.weight_scale
        from engine.quant.nvfp4_resident import unrepack

        return unrepack(self.resident.wq, self.out_features, self.in_features)

    def restore_source(self) -> None:
        """Undo make_resident: the compressed-tensors buffers again (the operand is released)."""
        if self.resident is None:
            return
        packed, scale = self.source_buffers()
        self._buffers["weight_packed"], self._buffers["weight_scale"] = packed, scale
        self.resident = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.resident is not None:
            packed, scale = self.source_buffers()
            destination[prefix + "weight_packed"] = packed
            destination[prefix + "weight_scale"] = scale

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.restore_source()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        kernels = _kernels(x)
        if kernels is not None:
            return kernels.nvfp4_matmul(x, self._operand(kernels))
        return super()._matmul(x)

    def _matmul_t(self, dy: torch.Tensor) -> torch.Tensor:  # (..., out) -> (..., in)
        kernels = _kernels(dy)
        if kernels is not None and hasattr(kernels, "nvfp4_matmul_t"):
            return kernels.nvfp4_matmul_t(dy, self._operand(kernels))
        return super()._matmul_t(dy)

    def _operand(self, kernels: ModuleType):  # noqa: ANN202 - PreparedNVFP4 or the layer
        """What the kernels read: on first use the layer is repacked and made resident."""
        if self.resident is None and hasattr(kernels, "prepare"):
            self.make_resident(kernels.prepare(self))
        return self.resident if self.resident is not None else self

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        self.restore_source()  # moving or casting the layer: from its compressed-tensors buffers
        return keep_buffer_dtypes(self, self._locked, fn, recurse)
