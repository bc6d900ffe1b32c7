"""The element-wise parts of a decode step, in two implementations with one interface.

``TorchOps`` repeats the eager decoder's operations one for one (CPU, fallback, reference);
``CudaOps`` does each group in one kernel (fused_decode.cu), which matters at decode sizes,
where a step is hundreds of tiny launches otherwise. Both take a projection's raw GEMM output
plus its bias and LoRA term and apply the eager epilogue (bias in bf16, then LoRA in fp32). The
LoRA term is a ``LoraTerm``: the shrink x @ A^T (one launch, ``lora_shrink``) and B, whose
expand CudaOps does inside the epilogue kernel instead of as a matmul of its own.

Rows are decode rows (one token each): x (B, H), q (B, heads, D), caches (B_max, kv, S, D); a
prefill passes ``seq`` tokens per sequence as consecutive rows (qkv_rope_cache writes them to
columns slot .. slot + seq - 1 of their sequence's cache row).

CudaOps also runs the step's own small work (``step_inputs``: the token embeddings, RoPE rows and
the valid mask's new column; ``step_outputs``: the logits to fp32 and the counters moved on) and
the sampler's kernel (``sample``, which sampler.sample_next calls through ``cuda_ops``).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.layers import apply_rope

SOURCE = Path(__file__).with_name("fused_decode.cu")
FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC"]
SHRINK_BLOCK_INPUTS = 4096  # inputs per block of lora_shrink_kernel (kShrinkInputs)
MAX_HIDDEN = 8 * 1024  # the norm kernels hold a row in registers (kRowSlots per thread of 1024)
SAMPLE_SPAN = 1024  # logits per block of sample_kernel (kSampleSpan)


@dataclass
class LoraTerm:
    """The LoRA delta of a fused projection of up to three members (output columns [0, n1),
    [n1, n2), [n2, N)): delta[:, cols of member m] = s[:, m*r:(m+1)*r] @ b[:, cols]."""

    s: torch.Tensor  # (B, G*r) fp32: x @ A_cat^T
    b: torch.Tensor  # (r, N) fp32: the members' B^T side by side, scaling folded in
    r: int
    n1: int
    n2: int

    def delta(self) -> torch.Tensor:
        n = self.b.shape[1]
        edges = [0, min(self.n1, n), min(self.n2, n), n]
        parts = [self.s[:, m * self.r:(m + 1) * self.r] @ self.b[:, lo:hi]
                 for m, (lo, hi) in enumerate(zip(edges, edges[1:])) if hi > lo]
        return torch.cat(parts, dim=-1)


def apply_epilogue(y: torch.Tensor, bias: torch.Tensor | None, lora: LoraTerm | None) -> torch.Tensor:
    """A projection's raw output y plus bias (bf16 add) plus LoRA delta (fp32, rounded once)."""
    if bias is not None:
        y = y + bias.to(y.dtype)
    if lora is not None:
        y = (y.float() + lora.delta()).to(y.dtype)
    return y


class TorchOps:
    """Plain torch, same operations as engine.model.layers."""

    name = "torch"

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.float(), a.t())

    def qkv_rope_cache(self, y, bias, lora, cos, sin, kc, vc, slot, *, heads: int, kv_heads: int, d: int,
                       q_norm=None, k_norm=None, seq: int = 1) -> torch.Tensor:
        rows = y.shape[0]
        y = apply_epilogue(y, bias, lora)
        q = y[:, :heads * d].view(rows, heads, d)
        k = y[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d)
        v = y[:, (heads + kv_heads) * d:].view(rows, kv_heads, d)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        c, s = cos[:, None], sin[:, None]  # (rows, 1, D)
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        b = rows // seq
        cols = slot + torch.arange(seq, device=slot.device)
        kc[:b].index_copy_(2, cols, k.view(b, seq, kv_heads, d).transpose(1, 2))
        vc[:b].index_copy_(2, cols, v.view(b, seq, kv_heads, d).transpose(1, 2))
        return q

    def add_rmsnorm(self, x, y, bias, lora, w, eps: float):
        if y is not None:
            x = x + apply_epilogue(y, bias, lora)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return x, (h * w).to(x.dtype)

    def silu_mul(self, gu, bias, lora):
        gu = apply_epilogue(gu, bias, lora)
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    def add_rmsnorm_shrink(self, x, y, bias, lora, w, eps: float, a: torch.Tensor | None):
        """add_rmsnorm, then the next projection's shrink of the normed rows (None without a)."""
        x, h = self.add_rmsnorm(x, y, bias, lora, w, eps)
        return x, h, None if a is None else self.lora_shrink(h, a)

    def silu_mul_shrink(self, gu, bias, lora, a: torch.Tensor | None):
        """silu_mul, then the down projection's shrink of its output (None without a)."""
        out = self.silu_mul(gu, bias, lora)
        return out, None if a is None else self.lora_shrink(out, a)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CudaOps:
    """fused_decode.cu: one launch per group, on the current stream (CUDA-graph capturable)."""

    name = "cuda"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._tickets: dict[torch.device, torch.Tensor] = {}

    def _shrink_tickets(self, device: torch.device, n: int) -> torch.Tensor:
        """The zeroed tickets of the shrinks and the sampler (each call leaves them zero; calls on
        one stream never overlap), made once per device (on the first call, which runs before a
        graph capture: the engine warms up eagerly) and grown on demand."""
        t = self._tickets.get(device)
        if t is None or t.numel() < n:
            if torch.cuda.is_current_stream_capturing():  # a captured zero fill runs only at replay
                raise RuntimeError("CudaOps.lora_shrink: call it once eagerly with this shape before a graph capture")
            t = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
            self._tickets[device] = t
        return t

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed: CUDA error {err} ({self.lib.qerl_fused_error_string(err).decode()})")

    @staticmethod
    def _stream(t: torch.Tensor) -> int:
        return torch.cuda.current_stream(t.device).cuda_stream

    @staticmethod
    def _lora(lora: LoraTerm | None) -> tuple:
        if lora is None:
            return (None, None, 0, 0, 0, 0, 0)
        return (lora.s.data_ptr(), lora.b.data_ptr(), lora.r, lora.s.stride(0), lora.b.stride(0), lora.n1, lora.n2)

    def _shrink_args(self, rows: int, k: int, a: torch.Tensor, rows_per_block: int = 8) -> tuple[torch.Tensor, tuple]:
        """The shrink's output s (rows, rtot) and its kernel arguments (a, s, ws, tickets, rtot);
        the plain shrink takes 8 rows per block, the fused ones 1."""
        if a.dtype != torch.float32 or not a.is_contiguous() or k % 4:
            raise ValueError("the LoRA shrink needs a contiguous fp32 A and a multiple of 4 inputs")
        rtot = a.shape[0]
        s = torch.empty(rows, rtot, dtype=torch.float32, device=a.device)
        ws = tickets = None
        kb = -(-k // SHRINK_BLOCK_INPUTS)
        if kb > 1:  # K split over kb blocks: their partial sums and the tickets of the last block
            ws = torch.empty(kb * rows * rtot, dtype=torch.float32, device=a.device)
            tickets = self._shrink_tickets(a.device, -(-rows // rows_per_block) * rtot)
        return s, (_ptr(a), _ptr(s), _ptr(ws), _ptr(tickets), rtot)

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        b, k = x.shape
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8:
            x = x.to(torch.bfloat16).contiguous()
        s, args = self._shrink_args(b, k, a)
        err = self.lib.qerl_lora_shrink(_ptr(x), x.stride(0), *args, b, k, self._stream(x))
        self._check(err, "LoRA shrink")
        return s

    def _fused_ranks(self, rows: int, k: int, a: torch.Tensor) -> int | None:
        """Rank rows of A per block for a fused shrink kernel (blocks of 1024 threads, one per row,
        4096 inputs and rank-row group), or None for the two kernels instead: the fewest of 1, 2, 4,
        8 that keep the grid within one block per SM. Measured on H200 (decode step, r=16): at 1 row
        one rank row per block saves the shrink's launch; at 8 rows one rank row per block (384
        blocks at 7B) made the step slower than the two kernels (the next NVFP4 GEMM's early-launched
        blocks found no room to start streaming); grouped rank rows at 8 rows gained at 14B and 32B
        (hidden 5120: 8.23 -> 7.91 and 12.24 -> 11.80 ms per step) and, measured again after the
        epilogue kernels got faster, also where the inputs fit one K block (hidden 3584): 7B nvfp4
        batch 4 2.96 -> 2.92 ms, batch 8 3.13 -> 3.04, batch 16 3.96 -> 3.86; bf16 batch 8 5.29 ->
        5.17; level at 32B."""
        from engine.kernels.nvfp4_gemm import sm_count

        kb = -(-k // SHRINK_BLOCK_INPUTS)
        return next((rb for rb in (1, 2, 4, 8) if rows * kb * -(-a.shape[0] // rb) <= sm_count(a.device)), None)

    def add_rmsnorm_shrink(self, x, y, bias, lora, w, eps: float, a: torch.Tensor | None):
        """(x + projection, its RMSNorm h, h @ a^T) in one launch (after the expand's, with a LoRA
        term), x not written in place. Without a: add_rmsnorm and None; where even eight rank rows
        per block make more than one wave of blocks: add_rmsnorm (x updated in place) and
        lora_shrink."""
        if a is None:
            return (*self.add_rmsnorm(x, y, bias, lora, w, eps), None)
        b, h = x.shape
        rb = self._fused_ranks(b, h, a)
        if rb is None:
            x, out = self.add_rmsnorm(x, y, bias, lora, w, eps)
            return x, out, self.lora_shrink(out, a)
        if lora is not None:
            y, bias = self._expand(y, bias, lora), None
        x_out, out = torch.empty_like(x), torch.empty_like(x)
        s, args = self._shrink_args(b, h, a, rows_per_block=1)
        err = self.lib.qerl_add_rmsnorm_shrink(_ptr(x.contiguous()), _ptr(None if y is None else y.contiguous()),
                                               _ptr(bias), _ptr(w), ctypes.c_float(eps), _ptr(x_out), _ptr(out),
                                               *args, b, h, rb, self._stream(x))
        self._check(err, "fused residual + RMSNorm + LoRA shrink")
        return x_out, out, s

    def silu_mul_shrink(self, gu, bias, lora, a: torch.Tensor | None):
        """(silu(gate) * up, that @ a^T) in one launch. Without a: silu_mul and None. With gate/up's
        own LoRA term still to add (in the shrink's blocks its expand would be repeated once per
        rank group) or where even eight rank rows per block make more than one wave of blocks:
        silu_mul and lora_shrink."""
        if a is None:
            return self.silu_mul(gu, bias, lora), None
        b, n2 = gu.shape
        inter = n2 // 2
        rb = None if lora is not None else self._fused_ranks(b, inter, a)
        if rb is None:
            out = self.silu_mul(gu, bias, lora)
            return out, self.lora_shrink(out, a)
        gu = gu.contiguous()
        out = torch.empty(b, inter, dtype=gu.dtype, device=gu.device)
        s, args = self._shrink_args(b, inter, a, rows_per_block=1)
        err = self.lib.qerl_silu_mul_shrink(_ptr(gu), _ptr(bias), _ptr(out), *args, b, inter, rb, self._stream(gu))
        self._check(err, "fused SiLU * up + LoRA shrink")
        return out, s

    def _expand(self, y: torch.Tensor, bias: torch.Tensor | None, lora: LoraTerm) -> torch.Tensor:
        """y + bias + the LoRA delta, rounded to y's dtype (the epilogue in a kernel of its own)."""
        b, n = y.shape
        out, src = torch.empty_like(y), y.contiguous()
        err = self.lib.qerl_lora_expand(_ptr(src), _ptr(bias), *self._lora(lora), _ptr(out), b, n, n, self._stream(y))
        self._check(err, "LoRA expand")
        return out

    def qkv_rope_cache(self, y, bias, lora, cos, sin, kc, vc, slot, *, heads: int, kv_heads: int, d: int,
                       q_norm=None, k_norm=None, seq: int = 1) -> torch.Tensor:
        if q_norm is not None:
            raise ValueError("the fused decode path has no per-head q/k norm; use TorchOps")
        b = y.shape[0]
        y = y.contiguous()
        q = torch.empty(b, heads, d, dtype=y.dtype, device=y.device)
        err = self.lib.qerl_qkv_rope_cache(
            _ptr(y), _ptr(bias), *self._lora(lora), _ptr(cos), _ptr(sin), _ptr(q), _ptr(kc), _ptr(vc), _ptr(slot), b,
            heads, kv_heads, d, kc.stride(0), kc.stride(1), y.shape[1], seq, self._stream(y))
        self._check(err, "fused q/k/v epilogue")
        return q

    def add_rmsnorm(self, x, y, bias, lora, w, eps: float):
        b, h = x.shape
        if lora is not None:  # the epilogue in a kernel of many blocks first: add_rmsnorm has one per row
            y, bias, lora = self._expand(y, bias, lora), None, None
        out = torch.empty_like(x)
        err = self.lib.qerl_add_rmsnorm(_ptr(x), _ptr(None if y is None else y.contiguous()), _ptr(bias),
                                        *self._lora(lora), _ptr(w), ctypes.c_float(eps), _ptr(out), b, h,
                                        self._stream(x))
        self._check(err, "fused residual + RMSNorm")
        return x, out

    def silu_mul(self, gu, bias, lora):
        b, n2 = gu.shape
        inter = n2 // 2
        gu = gu.contiguous()
        out = torch.empty(b, inter, dtype=gu.dtype, device=gu.device)
        err = self.lib.qerl_silu_mul(_ptr(gu), _ptr(bias), *self._lora(lora), _ptr(out), b, inter, self._stream(gu))
        self._check(err, "fused SiLU * up")
        return out

    # -- the step's own work: its inputs before the first layer, the head's output, sampling ----
    def step_inputs(self, tok, pos, slot, embed, cos_t, sin_t, valid) -> tuple[torch.Tensor, ...]:
        """(embed[tok], cos_t[pos], sin_t[pos]) for a step's rows, and valid[:, slot] = True (valid
        holds the step's rows), in one launch: the same values as the index ops they replace."""
        b, (h, d) = tok.shape[0], (embed.shape[1], cos_t.shape[1])
        if not (embed.is_contiguous() and cos_t.is_contiguous() and sin_t.is_contiguous() and valid.stride(1) == 1
                and tok.is_contiguous() and pos.is_contiguous() and valid.shape[0] == b):
            raise ValueError("step_inputs needs contiguous tables, tokens and positions, and one valid row per token")
        x = torch.empty(b, h, dtype=embed.dtype, device=embed.device)
        cos, sin = (torch.empty(b, d, dtype=cos_t.dtype, device=cos_t.device) for _ in range(2))
        err = self.lib.qerl_step_inputs(_ptr(tok), _ptr(pos), _ptr(slot), _ptr(embed), _ptr(cos_t), _ptr(sin_t),
                                        _ptr(x), _ptr(cos), _ptr(sin), _ptr(valid), valid.stride(0), b, h, d,
                                        self._stream(x))
        self._check(err, "decode step inputs")
        return x, cos, sin

    def step_outputs(self, y: torch.Tensor, out: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor) -> None:
        """out[:rows] = y (bf16 logits) as fp32, pos[:rows] += 1, slot += 1, in one launch."""
        b, n = y.shape
        if not (y.is_contiguous() and out.stride(1) == 1 and out.dtype == torch.float32 and out.shape[1] == n):
            raise ValueError("step_outputs needs contiguous logits and an fp32 buffer of the same width")
        err = self.lib.qerl_step_outputs(_ptr(y), _ptr(out), out.stride(0), _ptr(pos), _ptr(slot), b, n,
                                         self._stream(y))
        self._check(err, "decode step outputs")

    def sample(self, logits: torch.Tensor, q: torch.Tensor | None, temperature: float,
               tokens_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, log-probs) as sampler.sample_next defines them, in one launch: with q (Exp(1)
        draws, one per logit) token = argmax(logits / T - log q), else argmax(logits) at T = 1;
        tokens_into[:rows] gets the tokens too."""
        b, n = logits.shape
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or (q is not None and q.stride(1) != 1):
            raise ValueError("the fused sampler needs fp32 logits with unit stride along the vocabulary")
        tokens = torch.empty(b, dtype=torch.long, device=logits.device)
        lp = torch.empty(b, dtype=torch.float32, device=logits.device)
        ws = torch.empty(b * -(-n // SAMPLE_SPAN) * 4, dtype=torch.float32, device=logits.device)
        tickets = self._shrink_tickets(logits.device, b)
        err = self.lib.qerl_sample(_ptr(logits), logits.stride(0), _ptr(q), 0 if q is None else q.stride(0),
                                   ctypes.c_float(temperature), _ptr(tokens), _ptr(lp), _ptr(tokens_into), _ptr(ws),
                                   _ptr(tickets), b, n, self._stream(logits))
        self._check(err, "fused sampler")
        return tokens, lp


_P, _I = ctypes.c_void_p, ctypes.c_int
_LORA = [_P, _P, _I, _I, _I, _I, _I]
_SIGNATURES = {
    "qerl_lora_shrink": [_P, _I, _P, _P, _P, _P, _I, _I, _I, _P],
    "qerl_add_rmsnorm_shrink": [_P, _P, _P, _P, ctypes.c_float, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P],
    "qerl_silu_mul_shrink": [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P],
    "qerl_qkv_rope_cache": [_P, _P, *_LORA, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_longlong,
                            ctypes.c_longlong, _I, _I, _P],
    "qerl_add_rmsnorm": [_P, _P, _P, *_LORA, _P, ctypes.c_float, _P, _I, _I, _P],
    "qerl_silu_mul": [_P, _P, *_LORA, _P, _I, _I, _P],
    "qerl_lora_expand": [_P, _P, *_LORA, _P, _I, _I, _I, _P],
    "qerl_step_inputs": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_longlong, _I, _I, _I, _P],
    "qerl_step_outputs": [_P, _P, ctypes.c_longlong, _P, _P, _I, _I, _P],
    "qerl_sample": [_P, ctypes.c_longlong, _P, ctypes.c_longlong, ctypes.c_float, _P, _P, _P, _P, _P, _I, _I, _P],
    "qerl_fused_error_string": [_I],
}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    from engine.kernels._build import load_library

    return load_library(SOURCE, "qerl_fused_decode", FLAGS, "fused decode kernels", _SIGNATURES,
                        "qerl_fused_error_string", "torch ops")


_DEVICE_OPS: dict[torch.device, CudaOps | None] = {}


def cuda_ops(device: torch.device) -> CudaOps | None:
    """One CudaOps per sm_90 GPU where fused_decode.cu builds (unless QERL_FUSED_DECODE=0), else None."""
    if os.environ.get("QERL_FUSED_DECODE", "1") == "0" or device.type != "cuda":
        return None
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _DEVICE_OPS:
        ok = torch.cuda.get_device_capability(device) == (9, 0)
        lib = _library() if ok else None
        _DEVICE_OPS[device] = CudaOps(lib) if lib is not None else None
    return _DEVICE_OPS[device]


def pick_ops(device: torch.device, dtype: torch.dtype, *, qk_norm: bool, head_dim: int,
             fused: bool | None = None, hidden: int = 0) -> TorchOps | CudaOps:
    """CudaOps on an sm_90 GPU with bf16 activations and a hidden size up to 8192 (unless
    ``fused`` is False or QERL_FUSED_DECODE=0), else TorchOps."""
    if fused is None:
        fused = os.environ.get("QERL_FUSED_DECODE", "1") != "0"
    ok = (fused and device.type == "cuda" and dtype == torch.bfloat16 and not qk_norm and head_dim % 2 == 0
          and head_dim <= 1024 and hidden <= MAX_HIDDEN and torch.cuda.get_device_capability(device) == (9, 0))
    lib = _library() if ok else None
    return CudaOps(lib) if lib is not None else TorchOps()
