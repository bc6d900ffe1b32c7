"""Decode attention of the graph engine: one query token per row over the static KV cache.

``KernelAttention`` runs decode_attention.cu (keys split over the blocks of a thread block
cluster so that a batch-1 step spreads over the GPU, tensor-core products, fp32 online softmax,
deterministic combine through distributed shared memory); ``SdpaAttention`` is torch's
scaled_dot_product_attention with an additive mask built once per step. Both take the step's
queries (B, heads, D), one layer's caches (B_max, kv heads, S_max, D), the valid-column mask
(B_max, S_max) and the attention length s, and return (B, heads * D). ``pick_attention`` gives
the kernel on sm_90 with bf16, head size 64 or 128 and at most 8 query heads per kv head, while
rows x kv heads <= KERNEL_GROUPS (QERL_DECODE_ATTENTION=sdpa: never; =kernel: every batch), SDPA
otherwise. The kernel splits the keys over several blocks where a step has few (row, kv head)
pairs (SDPA then runs a handful of blocks that walk the keys one tile after another) and its
products run on the tensor cores, so it is ahead of SDPA at every batch measured.
"""
from __future__ import annotations

import ctypes
import math
import os
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.rollout.fused_ops import FLAGS

SOURCE = Path(__file__).with_name("decode_attention.cu")
KEYS = 16  # keys per warp step (kChunk in the kernel); a split covers a multiple of it
MAX_REP = 8
# The kernel while rows x kv heads <= this (measured faster than SDPA at every batch up to 64 rows
# of 4 and 8 kv heads, benchmarks/decode_attention.py), SDPA above.
KERNEL_GROUPS = 512
SPLIT_BLOCKS = 256  # blocks a launch aims at: splits = SPLIT_BLOCKS // (rows x kv heads), 1..MAX_SPLITS
MAX_SPLITS = 8  # blocks of a cluster (kMaxSplits in the kernel: the portable cluster size)


def splits_for(rows: int, kv_heads: int, s: int) -> tuple[int, int]:
    """(splits, keys per split), none empty, at most MAX_SPLITS: about SPLIT_BLOCKS blocks in all
    (three of the kernel's blocks fit an SM; more splits than that measured slower)."""
    chunks, groups = -(-s // KEYS), rows * kv_heads
    want = min(max(1, SPLIT_BLOCKS // groups), chunks, MAX_SPLITS)
    per = -(-chunks // want)
    return -(-chunks // per), per * KEYS


def attention_mask(valid: torch.Tensor, b: int, n_rep: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive key mask of a decode step, (B, 1, n_rep, S): 0 where a cache column is
    valid, -inf elsewhere. The same for every layer, so a step builds it once."""
    mask = torch.zeros(b, 1, n_rep, s, dtype=dtype, device=valid.device)
    return mask.masked_fill_(~valid[:b, None, None, :s], float("-inf"))


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (B, heads, D) over the cache columns of ``mask`` (``attention_mask``) -> (B, heads * D),
    grouped heads as one SDPA call (the n_rep query heads of a kv head are its query rows)."""
    b, heads, d = q.shape
    kvh, s = kc.shape[1], mask.shape[-1]
    o = F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, d), kc[:b, :, :s], vc[:b, :, :s], attn_mask=mask)
    return o.reshape(b, heads * d)


class SdpaAttention:
    name = "sdpa"

    def __init__(self) -> None:
        self._mask: torch.Tensor | None = None

    def begin_step(self, valid: torch.Tensor, b: int, n_rep: int, s: int, dtype: torch.dtype) -> None:
        """Build the step's mask (shared by every layer)."""
        self._mask = attention_mask(valid, b, n_rep, s, dtype)

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, valid: torch.Tensor, s: int,
                 slot: torch.Tensor | None = None) -> torch.Tensor:
        return decode_attention(q, kc, vc, self._mask)


class KernelAttention:
    name = "kernel"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def begin_step(self, valid: torch.Tensor, b: int, n_rep: int, s: int, dtype: torch.dtype) -> None:
        pass

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, valid: torch.Tensor, s: int,
                 slot: torch.Tensor | None = None) -> torch.Tensor:
        """``slot``: the int64 cache column (one element, on the device) that the kernel queued just
        before this call writes, if that is the only cache column it writes; the kernel then reads
        the rest of the cache before that kernel ends (PDL). None: everything after it."""
        b, heads, d = q.shape
        kvh = kc.shape[1]
        n_rep = heads // kvh
        if kc.stride(3) != 1 or kc.stride(2) != d or kc.stride() != vc.stride() or valid.stride(1) != 1:
            raise ValueError("decode attention needs caches laid out (rows, kv heads, columns, dim), dim innermost")
        if slot is not None and (slot.dtype != torch.int64 or slot.device != q.device):
            raise ValueError("decode attention's slot must be an int64 tensor on the queries' device")
        q = q.contiguous()
        splits, per = splits_for(b, kvh, s)
        out = torch.empty(b, heads * d, dtype=q.dtype, device=q.device)
        err = self.lib.qerl_decode_attention(
            q.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1), valid.data_ptr(), valid.stride(0),
            out.data_ptr(), None if slot is None else slot.data_ptr(), b, kvh, n_rep, d, s, splits, per,
            ctypes.c_float(math.log2(math.e) / math.sqrt(d)), torch.cuda.current_stream(q.device).cuda_stream)
        if err != 0:
            raise RuntimeError(f"decode attention failed: CUDA error {err} "
                               f"({self.lib.qerl_decode_attention_error_string(err).decode()})")
        return out


_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_SIGNATURES = {
    "qerl_decode_attention": [_P, _P, _P, _L, _L, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P],
    "qerl_decode_attention_error_string": [_I],
}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    from engine.kernels._build import load_library

    return load_library(SOURCE, "qerl_decode_attention", FLAGS, "decode attention kernel", _SIGNATURES,
                        "qerl_decode_attention_error_string", "SDPA")


def kernel_supported(device: torch.device, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int) -> bool:
    return (device.type == "cuda" and dtype == torch.bfloat16 and head_dim in (64, 128) and heads % kv_heads == 0
            and heads // kv_heads <= MAX_REP and torch.cuda.get_device_capability(device) == (9, 0))


class DecodeAttention:
    """Per step, the kernel while rows x kv heads <= ``kernel_groups`` (where it measured faster
    than SDPA: benchmarks/decode_attention.py), SDPA above."""

    def __init__(self, kernel: KernelAttention | None, kv_heads: int, kernel_groups: int = KERNEL_GROUPS) -> None:
        self.kernel, self.sdpa = kernel, SdpaAttention()
        self.kernel_rows = kernel_groups // kv_heads
        self.name = "sdpa" if kernel is None or self.kernel_rows < 1 else f"kernel (<= {self.kernel_rows} rows) + sdpa"
        self._use: KernelAttention | SdpaAttention = self.sdpa

    def begin_step(self, valid: torch.Tensor, b: int, n_rep: int, s: int, dtype: torch.dtype) -> None:
        self._use = self.kernel if self.kernel is not None and b <= self.kernel_rows else self.sdpa
        self._use.begin_step(valid, b, n_rep, s, dtype)

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, valid: torch.Tensor, s: int,
                 slot: torch.Tensor | None = None) -> torch.Tensor:
        return self._use(q, kc, vc, valid, s, slot)


def pick_attention(device: torch.device, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int,
                   max_batch: int) -> DecodeAttention:
    """The kernel where it applies (unless QERL_DECODE_ATTENTION=sdpa), SDPA otherwise."""
    choice = os.environ.get("QERL_DECODE_ATTENTION", "auto")
    kernel = None
    if choice != "sdpa" and kernel_supported(device, dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim):
        lib = _library()
        if lib is not None:
            kernel = KernelAttention(lib)
    return DecodeAttention(kernel, kv_heads, max_batch * kv_heads if choice == "kernel" else KERNEL_GROUPS)
