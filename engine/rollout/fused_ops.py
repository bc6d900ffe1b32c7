"""The element-wise parts of a decode step, in two implementations with one interface.

``TorchOps`` repeats the eager decoder's operations one for one (CPU, fallback, reference);
``CudaOps`` does each group in one kernel (fused_decode.cu), which matters at decode sizes,
where a step is hundreds of tiny launches otherwise. Both take a projection's raw GEMM output
plus its bias and LoRA delta and apply the eager epilogue (bias in bf16, then LoRA in fp32).

Rows are decode rows (one token each): x (B, H), q (B, heads, D), caches (B_max, kv, S, D).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.layers import apply_rope

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_decode.cu")
FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC"]


def _proj(y: torch.Tensor, bias: torch.Tensor | None, delta: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        y = y + bias.to(y.dtype)
    if delta is not None:
        y = (y.float() + delta).to(y.dtype)
    return y


class TorchOps:
    """Plain torch, same operations as engine.model.layers."""

    name = "torch"

    def qkv_rope_cache(self, y, bias, delta, cos, sin, kc, vc, slot, *, heads: int, kv_heads: int, d: int,
                       q_norm=None, k_norm=None) -> torch.Tensor:
        b = y.shape[0]
        y = _proj(y, bias, delta)
        q = y[:, :heads * d].view(b, heads, d)
        k = y[:, heads * d:(heads + kv_heads) * d].view(b, kv_heads, d)
        v = y[:, (heads + kv_heads) * d:].view(b, kv_heads, d)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        c, s = cos[:, None], sin[:, None]  # (B, 1, D)
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        kc[:b].index_copy_(2, slot, k[:, :, None])
        vc[:b].index_copy_(2, slot, v[:, :, None])
        return q

    def add_rmsnorm(self, x, y, bias, delta, w, eps: float, want32: bool):
        if y is not None:
            x = x + _proj(y, bias, delta)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = (h * w).to(x.dtype)
        return x, out, (out.float() if want32 else None)

    def silu_mul(self, gu, bias, delta, want32: bool):
        gu = _proj(gu, bias, delta)
        g, u = gu.chunk(2, dim=-1)
        out = F.silu(g) * u
        return out, (out.float() if want32 else None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CudaOps:
    """fused_decode.cu: one launch per group, on the current stream (CUDA-graph capturable)."""

    name = "cuda"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed: CUDA error {err} ({self.lib.qerl_fused_error_string(err).decode()})")

    @staticmethod
    def _stream(t: torch.Tensor) -> int:
        return torch.cuda.current_stream(t.device).cuda_stream

    def qkv_rope_cache(self, y, bias, delta, cos, sin, kc, vc, slot, *, heads: int, kv_heads: int, d: int,
                       q_norm=None, k_norm=None) -> torch.Tensor:
        if q_norm is not None:
            raise ValueError("the fused decode path has no per-head q/k norm; use TorchOps")
        b = y.shape[0]
        y = y.contiguous()
        q = torch.empty(b, heads, d, dtype=y.dtype, device=y.device)
        err = self.lib.qerl_qkv_rope_cache(
            _ptr(y), _ptr(bias), _ptr(delta), _ptr(cos), _ptr(sin), _ptr(q), _ptr(kc), _ptr(vc), _ptr(slot), b, heads,
            kv_heads, d, kc.stride(0), kc.stride(1), y.shape[1], self._stream(y))
        self._check(err, "fused q/k/v epilogue")
        return q

    def add_rmsnorm(self, x, y, bias, delta, w, eps: float, want32: bool):
        b, h = x.shape
        out = torch.empty_like(x)
        out32 = torch.empty(b, h, dtype=torch.float32, device=x.device) if want32 else None
        err = self.lib.qerl_add_rmsnorm(_ptr(x), _ptr(None if y is None else y.contiguous()), _ptr(bias), _ptr(delta),
                                        _ptr(w), ctypes.c_float(eps), _ptr(out), _ptr(out32), b, h, self._stream(x))
        self._check(err, "fused residual + RMSNorm")
        return x, out, out32

    def silu_mul(self, gu, bias, delta, want32: bool):
        b, n2 = gu.shape
        inter = n2 // 2
        gu = gu.contiguous()
        out = torch.empty(b, inter, dtype=gu.dtype, device=gu.device)
        out32 = torch.empty(b, inter, dtype=torch.float32, device=gu.device) if want32 else None
        err = self.lib.qerl_silu_mul(_ptr(gu), _ptr(bias), _ptr(delta), _ptr(out), _ptr(out32), b, inter,
                                     self._stream(gu))
        self._check(err, "fused SiLU * up")
        return out, out32


_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "qerl_qkv_rope_cache": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_longlong, ctypes.c_longlong,
                            _I, _P],
    "qerl_add_rmsnorm": [_P, _P, _P, _P, _P, ctypes.c_float, _P, _P, _I, _I, _P],
    "qerl_silu_mul": [_P, _P, _P, _P, _P, _I, _I, _P],
    "qerl_fused_error_string": [_I],
}


def _build() -> Path:
    from engine.kernels._build import _cache_dir, _nvcc

    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256((SOURCE.read_text() + " ".join(FLAGS) + version).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"qerl_fused_decode_{digest}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run([nvcc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("fused decode kernels unavailable, using torch ops: %s", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_char_p if name == "qerl_fused_error_string" else ctypes.c_int
    return lib


def pick_ops(device: torch.device, dtype: torch.dtype, *, qk_norm: bool, head_dim: int,
             fused: bool | None = None) -> TorchOps | CudaOps:
    """CudaOps on an sm_90 GPU with bf16 activations (unless ``fused`` is False or
    QERL_FUSED_DECODE=0), else TorchOps."""
    if fused is None:
        fused = os.environ.get("QERL_FUSED_DECODE", "1") != "0"
    ok = (fused and device.type == "cuda" and dtype == torch.bfloat16 and not qk_norm and head_dim % 2 == 0
          and head_dim <= 1024 and torch.cuda.get_device_capability(device) == (9, 0))
    lib = _library() if ok else None
    return CudaOps(lib) if lib is not None else TorchOps()
