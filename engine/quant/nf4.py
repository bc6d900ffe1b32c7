"""NF4 weight storage: the QLoRA baseline, in bitsandbytes' format.

bitsandbytes ``quantize_4bit(quant_type="nf4", blocksize=64)`` without double quantization:
the weight is flattened row-major and cut into blocks of 64 (the last one may be shorter);
each block keeps its fp32 absmax, and each element x/absmax is replaced by the index of the
nearest of the 16 NF4 values (bitsandbytes' decision thresholds, ties to the lower index).
Two codes share a byte, the first element in the HIGH nibble (bitsandbytes' order, the
opposite of NVFP4's).

bitsandbytes quantizes when it is installed and works on the weight's device; otherwise the
torch path below does, with bitsandbytes' thresholds and order (bit-identical to
bitsandbytes 0.50 wherever both ran).
"""
from __future__ import annotations

import torch

from engine.quant.base import FrozenLinear
from engine.quant.nvfp4 import keep_buffer_dtypes

BLOCKSIZE = 64
CHUNK_BLOCKS = 1 << 18  # blocks per quantization chunk (16M elements)

# Set to False to force the torch path (tests, machines with a broken bitsandbytes build).
use_bitsandbytes = True

# bitsandbytes.functional.get_4bit_type("nf4"): quantiles of N(0, 1) scaled to [-1, 1]
NF4_VALUES = torch.tensor(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=torch.float32,
)

# bitsandbytes' dQuantizeNF4 decision tree: code = number of thresholds strictly below x
NF4_THRESHOLDS = torch.tensor(
    [
        -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
        -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
        0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
        0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
    ],
    dtype=torch.float32,
)


def _quantize_bnb(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not use_bitsandbytes:
        return None
    try:
        import bitsandbytes.functional as F  # noqa: N812

        packed, state = F.quantize_4bit(
            weight.contiguous(), blocksize=BLOCKSIZE, compress_statistics=False, quant_type="nf4"
        )
    except Exception:  # not installed, or no working native library for this device
        return None
    return packed.view(torch.uint8).reshape(-1), state.absmax.to(torch.float32)


def bitsandbytes_missing(device: torch.device | str) -> str | None:
    """Why bitsandbytes' NF4 kernels (QLoRA's) cannot run on ``device``, or None when they can.
    Without them NF4 layers run the torch path: right, but no QLoRA baseline to time."""
    if not use_bitsandbytes:
        return "bitsandbytes is switched off (engine.quant.nf4.use_bitsandbytes = False)"
    try:
        import bitsandbytes.functional as F  # noqa: N812, PLC0415 - optional dependency

        w = torch.zeros(64, 64, dtype=torch.bfloat16, device=device)
        F.quantize_4bit(w, blocksize=BLOCKSIZE, compress_statistics=False, quant_type="nf4")
    except Exception as exc:  # not installed, or no native library for this device
        return f"bitsandbytes cannot run NF4 on {device}: {type(exc).__name__}: {exc}"[:300]
    return None


def _quantize_torch(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [n] (any float dtype) -> (packed uint8 [ceil(n/2)], absmax fp32 [ceil(n/64)]).
    Works in fp32 one chunk of blocks at a time."""
    n = flat.numel()
    n_blocks = -(-n // BLOCKSIZE)
    bounds = NF4_THRESHOLDS.to(flat.device)
    codes = torch.empty(n_blocks * BLOCKSIZE, dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(n_blocks, dtype=torch.float32, device=flat.device)
    for b0 in range(0, n_blocks, CHUNK_BLOCKS):
        seg = flat[b0 * BLOCKSIZE : (b0 + CHUNK_BLOCKS) * BLOCKSIZE].to(torch.float32)
        seg = torch.nn.functional.pad(seg, (0, -seg.numel() % BLOCKSIZE))  # zeros never raise an absmax
        blocks = seg.view(-1, BLOCKSIZE)
        am = blocks.abs().amax(dim=-1)
        scaled = torch.clamp(blocks * (1.0 / am.clamp(min=1e-38)).unsqueeze(-1), -1, 1)
        codes[b0 * BLOCKSIZE : b0 * BLOCKSIZE + seg.numel()] = torch.bucketize(scaled, bounds, out_int32=True).flatten()
        absmax[b0 : b0 + am.numel()] = am
    codes = codes[: n + (n % 2)]  # an odd tail nibble holds NF4 zero (code 7), as bitsandbytes pads
    return (codes[0::2] << 4) | codes[1::2], absmax


@torch.no_grad()
def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (weight_packed uint8 [ceil(out*in/2)], weight_absmax fp32 [ceil(out*in/64)])."""
    if weight.ndim != 2 or not weight.is_floating_point():
        raise ValueError(f"NF4 quantizes 2-D floating-point weights; got {weight.dtype} {tuple(weight.shape)}")
    weight = weight.detach()
    return _quantize_bnb(weight) or _quantize_torch(weight.reshape(-1))


@torch.no_grad()
def dequantize_nf4(
    weight_packed: torch.Tensor,
    weight_absmax: torch.Tensor,
    shape: tuple[int, int],
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """NF4 value * block absmax in fp32, rounded once to ``dtype`` (as bitsandbytes)."""
    n = shape[0] * shape[1]
    codes = torch.stack((weight_packed >> 4, weight_packed & 0x0F), dim=-1).reshape(-1)[:n]
    values = NF4_VALUES.to(weight_packed.device)[codes.to(torch.int32)]
    n_blocks = weight_absmax.numel()
    values = torch.nn.functional.pad(values, (0, n_blocks * BLOCKSIZE - n)).view(n_blocks, BLOCKSIZE)
    out = (values * weight_absmax.to(torch.float32).unsqueeze(-1)).reshape(-1)[:n]
    return out.reshape(shape).to(dtype)


class NF4Linear(FrozenLinear):
    """A frozen linear layer stored in NF4 (QLoRA's base format, 4.5 bits per weight)."""

    fmt = "nf4"
    _locked = ("weight_packed", "weight_absmax")

    def __init__(
        self,
        weight_packed: torch.Tensor,
        weight_absmax: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        n = in_features * out_features
        if weight_packed.dtype != torch.uint8 or weight_packed.numel() != (n + 1) // 2:
            raise ValueError(
                f"weight_packed must be uint8 with {(n + 1) // 2} elements for a "
                f"[{out_features}, {in_features}] weight; got {weight_packed.dtype} {weight_packed.numel()}"
            )
        if weight_absmax.numel() != -(-n // BLOCKSIZE):
            raise ValueError(f"weight_absmax must have {-(-n // BLOCKSIZE)} elements; got {weight_absmax.numel()}")
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight_packed", weight_packed.detach().reshape(-1).contiguous())
        self.register_buffer("weight_absmax", weight_absmax.detach().to(torch.float32).reshape(-1))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> NF4Linear:
        packed, absmax = quantize_nf4(weight)
        return cls(packed, absmax, weight.shape[1], weight.shape[0], bias)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_nf4(self.weight_packed, self.weight_absmax, (self.out_features, self.in_features), dtype)

    # -- bitsandbytes' CUDA kernels, as QLoRA runs (gemv_4bit at one row, dequantize + matmul above)
    def _bnb_state(self, x: torch.Tensor):  # noqa: ANN202 - (bitsandbytes module, QuantState) or None
        if not (use_bitsandbytes and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
            return None
        key = (x.dtype, self.weight_packed.data_ptr(), self.weight_absmax.data_ptr())
        cached = getattr(self, "_bnb_cached", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            import bitsandbytes as bnb
            import bitsandbytes.functional as F  # noqa: N812

            state = F.QuantState(absmax=self.weight_absmax, shape=torch.Size((self.out_features, self.in_features)),
                                 code=F.get_4bit_type("nf4", device=x.device), blocksize=BLOCKSIZE, quant_type="nf4",
                                 dtype=x.dtype)
        except Exception:  # not installed, or no native library for this GPU
            state = None
        found = None if state is None else (bnb, state)
        self._bnb_cached = (key, found)
        return found

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        found = self._bnb_state(x)
        if found is None:
            return super()._matmul(x)
        bnb, state = found
        return bnb.matmul_4bit(x, self.weight_packed.view(-1, 1).t(), quant_state=state)

    def _matmul_t(self, dy: torch.Tensor) -> torch.Tensor:
        found = self._bnb_state(dy)
        if found is None:
            return super()._matmul_t(dy)
        bnb, state = found
        w = bnb.functional.dequantize_4bit(self.weight_packed.view(-1, 1), state, quant_type="nf4")
        return torch.matmul(dy, w.to(dy.dtype))

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        return keep_buffer_dtypes(self, self._locked, fn, recurse)
