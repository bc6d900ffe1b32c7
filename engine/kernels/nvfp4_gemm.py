"""y = x @ W^T and dx = dy @ W for a frozen NVFP4 weight, as torch custom ops.

Three paths on Hopper, picked per call from the number of activation rows M (``kernel_path``,
crossovers measured on H200 and H100):
- "small" (decode, M up to SMALL_PATH_MAX): mma.sync with the weights dequantized in registers as
  the MMA's A operand (see nvfp4_gemm.cu); a tile's K range split over warps of a block and over
  blocks, and tiles per warp, by a rule measured per layer kind (small_config).
- "wg" (from SMALL_PATH_MAX + 1 rows up to 32-2048, the larger the layer the further; at 257-1024
  rows on the narrower layers where a cost model of both paths says it is faster): the same
  dequantization feeding warpgroup MMAs (wgmma) whose B operand, the activations, streams through
  a shared-memory ring (from wg_permuted_rows() rows per block out of a copy of them in the MMA's
  input order, written first); the layer's columns x K groups cut into one wave of resident blocks
  (stream K, wg_config).
- "cublas" (the rest): one pass dequantizes to bf16 and cuBLAS multiplies, with the global scale
  as the GEMM's alpha so the output is rounded once.
dx = dy @ W always takes the last path (training has large M; the base gets no gradient).
The small-M kernel can also add a bias and a LoRA delta in its epilogue (``matmul_epilogue``).
Every kernel is launched with programmatic dependent launch, so it starts streaming weights while
the previous kernel of the stream finishes; ``QERL_PDL=0`` (read at each launch) turns that off.
Elsewhere (CPU, other GPUs, other dtypes, ``QERL_KERNELS=0``) the ops compute the same function
in plain torch from the same repacked weights.
"""
from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from engine.kernels import _build
from engine.kernels import nvfp4_layout as layout

SMALL_M_MAX = 128
# Launch shape of the small-M kernel (small_config), measured on H200 (132 SMs) per call
# (benchmarks/gemm_nvfp4.py --sweep, --sweep-slices with and without --serial) and in the decode
# step (7B and 32B, benchmarks/RESULTS.md). Up to 16 rows, by layer kind (N in 16-row tiles, K in
# 256-input groups):
# - narrow layers (at most _NARROW_TILES tiles: q/k/v, o, down): each tile's K range over all
#   eight warps of one block, summed in shared memory (SmallConfig.wpt), one block per tile, with
#   two tiles per warp where one block per tile would leave a partial wave of resident blocks
#   (14B/32B q/k/v at 9-16 rows: 17.5 -> 12.8 us a call on H100 with a dependent copy between
#   calls; 72B q/k/v at 3-8 rows); but long-K ones (the down projections, >= _LONG_K_GROUPS
#   groups) take eight or four warps per tile and K split across blocks within one wave
#   (_long_k_wave; 32B down at 8 rows 34.5 -> 29.8 us, at 16 36.9 -> 33.0), and below
#   _SLICE_MIN_M rows four warps per tile, two tiles per warp, and K split across blocks to about
#   _RESIDENT blocks per SM. (The previous rule split K over two blocks at 3-8 rows: 7B q/k/v at 8
#   rows took 9.6 us against 6.5 now, 14B o 11.8 against 8.5.)
# - wide layers (gate_up): four warps per tile from _SLICE_MIN_M to 8 rows, no split; below that
#   two tiles per warp with the block target below; at 9-16 rows two warps per tile (four from
#   _WIDE_SLICE_K_GROUPS groups), no split, and two tiles per warp, or one where two would leave a
#   last wave of resident blocks less than half full (14B gate_up at 16 rows 44.7 -> 30.8 us, 7B
#   35.5 -> 32.3, 72B 99.9 -> 89.7).
# Otherwise every warp takes whole tiles and K is split across blocks until the grid has about the
# target number of blocks by rows (split partial sums cost more as M grows), with two weight tiles
# per warp at 2 rows or when one would already give _WIDE times the target.
_TARGET_BLOCKS = ((2, 800), (8, 320), (16, 300), (32, 200), (64, 120), (128, 120))
_WIDE = 1.4
_NARROW_TILES = 1024
_LONG_K_GROUPS = 48
_SLICE_MIN_M = 3
_WIDE_SLICE_K_GROUPS = 32
_RESIDENT = 4
_VARIANTS = {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (16, 1)}
# L2 prefetch distance of the fused kernel in records of 256 inputs (0: off); measured to help
# from M = 3 on and to cost 5-8% at M <= 2, where the kernel already keeps enough loads in flight.
PREFETCH_GROUPS = int(os.environ.get("QERL_NVFP4_PREFETCH", "2"))
_PREFETCH_MIN_M = 3

# The wgmma kernel: activation rows per block (the wgmma's N) and warpgroups per block (64 weight
# rows each).
# Path crossovers in rows (kernel_path): small kernel up to SMALL_PATH_MAX, wgmma kernel up to
# WG_M_MAX on large enough layers, dequantize + cuBLAS otherwise.
WG_BN = (16, 32, 64, 96, 128, 192, 256)
# wg = 3: the warp-specialized kernel (two compute warpgroups fed by a producer warpgroup through
# a ring of shared-memory stages; columns of 128 weight rows as with wg = 2), for these row counts.
WS_BN = (32, 64, 128, 256)
# wg = 4: the warp-specialized kernel with two weight tiles per compute warp (columns of 256 weight
# rows: half the activation copies per weight), for these row counts; the default on layers of at
# least _WS2_MIN_N outputs and _WS2_MIN_K inputs up to 32 rows, and up to 64 where its columns fill
# most of one wave (then whole columns, no partial sums). --sweep-wg on H200: 32B gate_up at 32 rows
# 66.1 against 68.6 us with wg = 3; 14B gate_up (108 columns) 37.3 / 39.4 at 32 rows, 45.7 / 47.2
# at 64; 32B gate_up at 64 rows 85.7 / 82.6 (slower); 7B gate_up (K = 3584) level; the down and
# q/k/v layers, whose few columns stream K then cuts more often, 10-35% slower.
WS2_BN = (32, 64)
_WS2_MIN_N, _WS2_MIN_K = 16384, 4096
_WG_VARIANTS = ({(bn, 1) for bn in WG_BN if bn <= 128} | {(bn, 2) for bn in WG_BN} | {(bn, 3) for bn in WS_BN}
                | {(bn, 4) for bn in WS2_BN})
_WG_TILES = {1: 4, 2: 8, 3: 8, 4: 16}  # weight tiles of a column block
# Up to this many rows per block the wgmma kernels store stream-K partial sums as each thread's
# accumulators lie (a slot of bn rows; kRegisterSumsRows in nvfp4_gemm.cu), above it M rows.
_WG_REGISTER_SUMS_BN = 64
WG_WS = os.environ.get("QERL_NVFP4_WG_WS", "0") == "1"  # the warp-specialized kernel at every M > 16
# Where it is the default (benchmarks/gemm_nvfp4.py --sweep-wg on H200, benchmarks/RESULTS.md):
# above 32 rows on every layer the wgmma path takes, and at 17-32 rows from _WS_MIN_WEIGHTS
# (7B gate_up at 64 rows 50.5 against 58.4 us with wg = 2; below 30M weights at 32 rows wg = 1 or
# 2 stays ahead, 7B o 10.4 against 12.9). Layers of at most _WS_SHORT_UNITS column blocks x K
# groups (q/k/v and o) take from 128 rows two row tiles of half the rows, whole columns: with
# so little K per column, stream K's partial sums cost more than the second pass over the weights
# (7B qkv at 256 rows 25.8 against 38.1 us).
_WS_MIN_WEIGHTS = 30e6
_WS_SHORT_UNITS = 1200
# With WS_DIRECT_BN rows per block (wg = 3: below kPermutedRows, one weight tile per warp; the
# kernel's template flag D in nvfp4_gemm.cu) the producer's idle warps can copy the activations
# from x themselves instead of a kernel of its own writing the ring's images first (`direct`): it
# saves that launch, but their copies keep up only with short runs. Taken where a
# block's K groups times its rows are at most _WS_DIRECT_MAX (benchmarks/RESULTS.md, H200, us,
# direct / staged: 7B q/k/v 14.9 / 16.7 at 64 rows, 7B o 13.4 / 15.8, 14B q/k/v 16.0 / 18.0 at 32
# rows; with every block copying, 14B q/k/v 22.9 / 21.4 at 64 rows, 7B gate_up 66.8 / 46.5).
_WS_DIRECT_MAX = 400
WS_DIRECT_BN = (32, 64)
SMALL_PATH_MAX = int(os.environ.get("QERL_NVFP4_SMALL_MAX", "16"))
WG_M_MAX = int(os.environ.get("QERL_NVFP4_WG_MAX", "512"))
# Layers of at least _WG_WIDEST_N outputs (the gate/up projections: hundreds of columns, so several
# row tiles of whole columns make many even waves) take the warp-specialized kernel up to
# _WG_WIDEST_M_MAX rows, the largest of them (_WG_LARGEST weights: 32B's and 72B's) up to
# _WG_LARGEST_M_MAX; past 256 rows the kernel takes row tiles of 256 (one block per SM) or 128,
# whichever needs fewer waves' worth of rows (_ws_tiles; the gate/up layers' many columns make that
# 128 up to 384 rows, 256 mostly beyond). benchmarks/RESULTS.md, twenty-sixth round, H200, us
# (benchmarks/gemm_large.py, with the row tiles' stores through shared memory): at 512 rows
# 256-row tiles against 128-row ones 7B gate_up 200.6 / 213.2, 32B gate_up 438 / 500, 72B gate_up
# 702 / 743, 14B q/k/v 61.6 / 71.3; at 1024 rows against dequantize + cuBLAS 7B gate_up 391 / 444,
# 32B 856 / 1025, 72B 1347 / 1590; at 2048 32B 1716 / 1823, 72B 2760 / 2978, but 7B 940 / 844 and
# 14B 949 / 929 (shorter rows: the per-tile start and end weigh more). Narrower layers lose to wave
# quantization where their row tiles leave a wave part-filled (14B q/k/v at 600 rows: 168 blocks on
# 132 SMs, 115 against 88 us; _WS_MODEL_M_MAX).
_WG_WIDEST_N, _WG_WIDEST_M_MAX = 16384, 1024
_WG_LARGEST, _WG_LARGEST_M_MAX = 250e6, 2048
# 256-row tiles' throughput over 128-row ones, at 1024 rows 1.10-1.28 (gemm_large.py, same section)
_WS_TILE_128_COST = 1.15
# Past 256 rows, up to _WS_MODEL_M_MAX, the narrower layers (q/k/v, o, down) take the
# warp-specialized kernel where a cost model of both paths (_ws_beats_cublas) gives it the shorter
# time, fitted to benchmarks/gemm_large.py on the H200 (twenty-seventh round, benchmarks/RESULTS.md:
# 12 layers of 7B-72B at 288-2048 rows): the kernel takes its waves' worth of rows (_ws_tiles) times
# 128 columns times K multiply-adds at _WS_SM_FLOPS per multiprocessor, plus staging the activations
# (read and written at _STAGE_BYTES_S); dequantize + cuBLAS takes 2 M N K at _BF16_FLOPS plus the
# dequantizing pass (2.5625 bytes a weight at _DEQUANT_BYTES_S) plus _CUBLAS_FIXED_US. Where a tile's
# wave is well filled it wins at up to ~1024 rows: 14B down at 320 rows 86 against 130 us, 32B o 34
# against 52, 72B q/k/v at 768 rows 197 against 235, 7B down at 512 rows 125.5 against 137.3 (the
# 14B / 32B q/k/v and 72B layers took the kernel already; at 257-384 rows now in 256-row tiles where
# those fill one wave: 14B q/k/v 56 against 62 in 128-row tiles, 72B o 88 against 98); past that the
# dequantizing pass is a small share of cuBLAS's time, and the model's misses cost more (72B down at
# 1536 rows 1170 against 1118).
_WS_MODEL_M_MAX = 1024
# Where the kernel's whole columns leave a wave part-filled, one wave of blocks may share them by
# stream K across the row tiles (their columns laid end to end); the model counts that the blocks'
# share of the rows plus the partial sums' slots, and it is taken only where it is faster than both
# other paths by this factor: measured (H200, 256-row tiles, one wave) 14B down at 512 rows 139.9
# us against 148.0 for dequantize + cuBLAS and 154.6 in whole columns, 32B down 259.4 against 299.6
# and 316.8 (on another H200: 141.7 / 149.0 / 142.6 and 262.9 / 301.0 / 269.1), 7B down at 320-384
# rows in 128-row tiles 101-109 against 118-124 with cuBLAS (whole columns 101-105), but 7B down at
# 768 rows 207.9 against 176.7 and 14B o at 1024 114.0 against 88.9 (the slots' traffic and the
# model's error, 5-16%, weigh more there).
_WS_STREAM_MARGIN = 1.1
_EXTRA_COUNTERS = 8
_WS_SM_FLOPS, _STAGE_BYTES_S = 5.6e12, 3.0e12
_BF16_FLOPS, _DEQUANT_BYTES_S, _CUBLAS_FIXED_US = 7.6e14, 3.4e12, 2.0
WG_PREFETCH_GROUPS = int(os.environ.get("QERL_NVFP4_WG_PREFETCH", "2"))
# Blocks of the wgmma kernel with one row tile, in waves of resident blocks (stream K), unless the
# layer has at least _WG_WHOLE_WAVES waves of column blocks.
WG_FILL = float(os.environ.get("QERL_NVFP4_WG_FILL", "1"))
_WG_WHOLE_WAVES = 4
# rows per block past 256 rows (wg = 3: unless _ws_tiles takes 256), and from 193 on wide layers (_WG_WHOLE_FILL)
_WG_TILE_ROWS = 128
# From 128-row blocks a layer whose columns fill between this share of one wave of resident blocks
# and the whole wave takes one block per column (no stream-K partial sums); at 193-256 rows such
# a layer, or a wider one, takes two row tiles of 128 (two blocks per SM) instead of one of 256.
_WG_WHOLE_FILL = 0.8


@dataclass(eq=False)
class PreparedNVFP4:
    """A layer's weight in the kernel layout (nvfp4_layout) plus what each call needs."""

    wq: torch.Tensor  # int32 [N/16, K/256, 576]
    alpha: torch.Tensor  # fp32 [1]: 2^7 / global_scale
    counters: torch.Tensor  # int32: split-K tickets, always zero between calls
    n: int
    k: int
    alpha_value: float

    @property
    def ntiles(self) -> int:
        return self.wq.shape[0]

    @property
    def kg(self) -> int:
        return self.wq.shape[1]


def prepare_tensors(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor
) -> PreparedNVFP4:
    """Repack NVFP4 buffers (on their device) for the kernels."""
    wq = layout.repack(weight_packed, weight_scale)
    g = weight_global_scale.detach().float().reshape(-1)[:1]
    alpha = (2.0**layout.WEIGHT_EXP2 / g).to(weight_packed.device)
    counters = split_counters(wq.shape[0], weight_packed.device)
    n, k = weight_packed.shape[0], 2 * weight_packed.shape[1]
    return PreparedNVFP4(wq, alpha, counters, n, k, float(alpha.item()))


def split_counters(ntiles: int, device: torch.device) -> torch.Tensor:
    """Zeroed split-K tickets for an operand of ``ntiles`` 16-row tiles: one per tile (the smallest
    column block of any kernel: the small kernel with eight warps per tile) and _EXTRA_COUNTERS
    more, so that stream K across up to 8 row tiles of the warp-specialized kernel's 8-tile columns
    has one per column and row tile."""
    return torch.zeros(ntiles + _EXTRA_COUNTERS, dtype=torch.int32, device=device)


def small_workspace(m: int, p: PreparedNVFP4, splits: int) -> int:
    """fp32 elements of the small-M kernel's split-K workspace (0 without split K)."""
    return splits * m * p.ntiles * 16 if splits > 1 else 0


def _workspace(need: int, like: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor | None:
    """A kernel's fp32 workspace of ``need`` elements (None for 0): ``given`` where it is large
    enough, else a new one; the caller keeps it alive over the launch."""
    if need == 0:
        return None
    if given is None or given.numel() < need:
        given = torch.empty(need, dtype=torch.float32, device=like.device)
    return given


def prepare_model(model: torch.nn.Module) -> int:
    """Repack every NVFP4 layer of a model now (after moving it to the GPU); returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "weight_packed") and hasattr(module, "weight_global_scale"):
            prepare(module)
            count += 1
    return count


def prepare(layer: torch.nn.Module) -> PreparedNVFP4:
    """The layer's repacked weight, made once and cached on the layer (remade if it moves)."""
    bufs = (layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    key = tuple((b.device, b.data_ptr(), b._version) for b in bufs)
    cached = getattr(layer, "_nvfp4_prepared", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        prepared = prepare_tensors(*bufs)
    layer._nvfp4_prepared = (key, prepared)
    return prepared


# -- availability ------------------------------------------------------------------------------
# Chosen at import; set False (or QERL_KERNELS=0) to force the torch path.
ENABLED = os.environ.get("QERL_KERNELS", "1") != "0"


@lru_cache(maxsize=None)
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def available(x: torch.Tensor) -> bool:
    """True when the CUDA kernels run for x: bf16 on an sm_90 GPU, kernels built, not disabled."""
    if not ENABLED or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    return _is_hopper(x.device.index if x.device.index is not None else torch.cuda.current_device()) and (
        _build.library() is not None
    )


@lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one for a device without index)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


# -- launches ----------------------------------------------------------------------------------
def _m_tiles(m: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, -(-m // 8)))))


def kernel_path(m: int, n: int, k: int, sms: int | None = None) -> str:
    """"small", "wg" or "cublas" for a plain product of M rows of an [n, k] layer (crossovers
    measured with benchmarks/gemm_nvfp4.py --sweep-wg on H200): the small kernel up to
    SMALL_PATH_MAX rows, the wgmma kernels from there on, up to the more rows the larger the
    layer (to WG_M_MAX only where the layer is also wide, to _WG_WIDEST_M_MAX or _WG_LARGEST_M_MAX
    on the widest); past 256 rows on narrower layers where the cost model says it is
    faster (_ws_beats_cublas, on a GPU of ``sms`` multiprocessors: the current one's by default);
    dequantize + cuBLAS beyond."""
    if m <= SMALL_PATH_MAX:
        return "small"
    weights = n * k
    if m <= 32 or (m <= 64 and weights >= 10e6) or (m <= 256 and weights >= 15e6) or \
            (m <= WG_M_MAX and weights >= 30e6 and n >= 7168) or \
            (m <= (_WG_LARGEST_M_MAX if weights >= _WG_LARGEST else _WG_WIDEST_M_MAX) and weights >= 30e6 and
             n >= _WG_WIDEST_N):
        return "wg"
    if WS_BN[-1] < m <= _WS_MODEL_M_MAX and n < _WG_WIDEST_N and _ws_beats_cublas(m, n, k, sms):
        return "wg"
    return "cublas"


def _ws_tiles(m: int, columns: int, sms: int) -> tuple[int, float]:
    """(rows per row tile, waves' worth of rows) of the warp-specialized kernel past 256 rows: of
    256- and 128-row tiles the one that takes fewer waves of blocks (one block per multiprocessor)
    times its rows, the 128-row tiles' counted _WS_TILE_128_COST times for their lower throughput."""
    def rows(bn: int) -> int:
        return -(-(-(-m // bn) * columns) // sms) * bn

    big, small = rows(WS_BN[-1]), _WS_TILE_128_COST * rows(_WG_TILE_ROWS)
    return (WS_BN[-1], big) if big <= small else (_WG_TILE_ROWS, small)


def _ws_costs(m: int, n: int, k: int, sms: int | None) -> tuple[float, float, float]:
    """The cost model of _WS_MODEL_M_MAX for M rows of an [n, k] layer, in seconds: the
    warp-specialized kernel in row tiles of _ws_tiles with whole columns, the same in one wave of
    stream K across the row tiles (their share of the rows, plus the partial sums' slots written and
    read), and dequantize + cuBLAS."""
    if sms is None:
        sms = sm_count(torch.device("cuda")) if torch.cuda.is_available() else 132
    columns = -(-n // (16 * _WG_TILES[3]))
    bn, rows = _ws_tiles(m, columns, sms)
    gcols = -(-m // bn) * columns
    staging = 4 * m * k / _STAGE_BYTES_S
    whole = rows * 128 * k * 2 / _WS_SM_FLOPS + staging
    shared_rows = gcols * bn / sms * (1 if bn == WS_BN[-1] else _WS_TILE_128_COST)
    slots = (sms + gcols) * min(m, bn) * 128 * 4 * 2 / _STAGE_BYTES_S
    stream = shared_rows * 128 * k * 2 / _WS_SM_FLOPS + staging + slots
    cublas = 2 * m * n * k / _BF16_FLOPS + 2.5625 * n * k / _DEQUANT_BYTES_S + _CUBLAS_FIXED_US * 1e-6
    return whole, stream, cublas


def _ws_beats_cublas(m: int, n: int, k: int, sms: int | None = None) -> bool:
    """Whether the warp-specialized kernel (whole columns, or stream K across the row tiles where
    _ws_stream_across) takes less time than dequantize + cuBLAS, by the cost model (_ws_costs)."""
    whole, stream, cublas = _ws_costs(m, n, k, sms)
    return min(whole, _WS_STREAM_MARGIN * stream) < cublas


def _ws_stream_across(m: int, n: int, k: int, sms: int | None = None) -> bool:
    """Whether stream K across the row tiles beats both whole columns and dequantize + cuBLAS by
    _WS_STREAM_MARGIN in the cost model (_ws_costs)."""
    whole, stream, cublas = _ws_costs(m, n, k, sms)
    return _WS_STREAM_MARGIN * stream < min(whole, cublas)


def use_fused(m: int, n: int, k: int) -> bool:
    """A fused kernel (small or wgmma) rather than dequantize + cuBLAS."""
    return kernel_path(m, n, k) != "cublas"


class SmallConfig(NamedTuple):
    """Launch shape of the small-M kernel: 8-row activation tiles, weight tiles per warp, K splits
    across blocks, groups of 256 inputs per K slice, warps per weight tile slot (each slot's K
    range split over that many warps of the block, summed in shared memory)."""

    mt: int
    tnw: int
    splits: int
    gps: int
    wpt: int = 1


def small_config(m: int, p: PreparedNVFP4, device: torch.device, tnw: int | None = None,
                 splits: int | None = None, wpt: int | None = None) -> SmallConfig:
    """The small-M kernel's launch shape for M rows (``SmallConfig``); tnw, splits and wpt given
    are kept (splits as launched: rounded to whole groups per slice)."""
    mt = _m_tiles(m)
    target = next(b for rows, b in _TARGET_BLOCKS if m <= rows) * sm_count(device) / 132
    if tnw is None and splits is None and wpt is None:
        tnw, splits, wpt = _rule(m, p, sm_count(device)) or (None, None, 1)
    wpt = 1 if wpt is None else wpt
    if wpt not in (1, 2, 4, 8) or (wpt > 1 and mt > 2):
        raise ValueError(f"warps per weight tile must be 1, 2, 4 or 8 (above 1 only up to 16 rows), got {wpt}")
    if tnw is None:
        wide = wpt == 1 and (m == 2 or -(-p.ntiles // 8) > _WIDE * target)
        tnw = 2 if wide and (mt, 2) in _VARIANTS else 1
    if (mt, tnw) not in _VARIANTS:
        raise ValueError(f"no fused kernel for {mt * 8} rows with {tnw} weight tiles per warp")
    if splits is None:
        splits = max(1, min(p.kg // wpt, round(target / small_column_blocks(p, tnw, wpt))))
    gps = -(-p.kg // max(1, splits * wpt))
    slices = -(-p.kg // gps)
    return SmallConfig(mt, tnw, -(-slices // wpt), gps, wpt)


def small_column_blocks(p: PreparedNVFP4, tnw: int, wpt: int) -> int:
    """Blocks along N of the small-M kernel: each holds 8 / wpt slots of tnw weight tiles."""
    return -(-p.ntiles // (8 // wpt * tnw))


def _rule(m: int, p: PreparedNVFP4, sms: int) -> tuple[int, int | None, int] | None:
    """(weight tiles per warp, K splits or None for the block target, warps per tile) by layer
    kind up to 16 rows (see the top of the module); None: the block-target rule alone."""
    if m > 16:
        return None
    narrow, long_k, mt = p.ntiles <= _NARROW_TILES, p.kg >= _LONG_K_GROUPS, _m_tiles(m)
    if narrow and long_k and m >= _SLICE_MIN_M:
        return _long_k_wave(p, mt, sms)
    if narrow and m >= _SLICE_MIN_M:  # one block per tile, unless that leaves a partial wave
        return 1 if p.ntiles <= _small_occupancy(mt, 1) * sms else 2, 1, 8
    if narrow and not long_k:
        return 1, 1, 8
    if narrow:
        return 2, max(1, round(_RESIDENT * sms / small_column_blocks(p, 2, 4))), 4
    if m < _SLICE_MIN_M:
        return 2, None, 1
    if m <= 8:
        return 1, 1, 4
    wpt = 4 if p.kg >= _WIDE_SLICE_K_GROUPS else 2
    blocks, wave = small_column_blocks(p, 2, wpt), _small_occupancy(mt, 2) * sms
    return 1 if wave < blocks and 0 < blocks / wave % 1 < 0.5 else 2, 1, wpt


def _long_k_wave(p: PreparedNVFP4, mt: int, sms: int) -> tuple[int, int, int]:
    """(tiles per warp, K splits, warps per tile) of a long-K narrow layer from _SLICE_MIN_M rows: of
    eight or four warps per tile and K splits within one wave of resident blocks, up to 8 rows (one
    tile per warp) the grid whose last round of blocks over the multiprocessors is fullest, then the
    one of more blocks (in the decode step, where each launch starts under the previous kernel, more
    blocks ask for more of the weights before the wait: 7B down at 8 rows 224 blocks took 7.9 us
    a layer more than 448 although alone it is 1.7 us faster), then eight warps; from 9 rows (two
    tiles per warp) the most blocks, eight warps first."""
    tnw = 1 if mt == 1 else 2
    wave = _small_occupancy(mt, tnw) * sms

    def rank(launch: tuple[int, int, int]) -> tuple:
        _, splits, wpt = launch
        blocks = small_column_blocks(p, tnw, wpt) * splits
        return (round(blocks / (-(-blocks // sms) * sms), 2), blocks, wpt) if mt == 1 else (blocks, wpt)

    return max(((tnw, splits, wpt) for wpt in (8, 4)
                for splits in range(1, max(1, min(p.kg // wpt, wave // small_column_blocks(p, tnw, wpt))) + 1)),
               key=rank)


@lru_cache(maxsize=None)
def _small_occupancy(mt: int, tnw: int) -> int:
    return max(1, _build.library().qerl_nvfp4_occupancy(mt, tnw))


@lru_cache(maxsize=None)
def _wg_occupancy(bn: int, wg: int) -> int:
    return max(1, _build.library().qerl_nvfp4_occupancy_wg(bn, wg))


class WgConfig(NamedTuple):
    """Launch shape of the wgmma kernel: activation rows per block, warpgroups per block (64 weight
    rows each), blocks along the layer's columns (``columns`` of them: whole columns; more or fewer:
    columns shared by stream K), and how many column blocks the layer has."""

    bn: int
    wg: int
    blocks: int
    columns: int
    direct: bool = False  # the warp-specialized kernel copies the activations itself (_WS_DIRECT_MAX)

    @property
    def shared(self) -> bool:
        return self.blocks != self.columns

    def row_tiles(self, m: int) -> int:
        return -(-m // self.bn)

    def launch_columns(self, m: int) -> int:
        """Columns of a launch of M rows as its tickets and partial sums count them: the
        warp-specialized kernel (wg >= 3) lays its row tiles' columns end to end."""
        return self.columns * (self.row_tiles(m) if self.wg >= 3 else 1)


def _wg_columns(p: PreparedNVFP4, wg: int) -> int:
    """Column blocks of the wgmma kernel: 4 weight tiles (64 rows) per compute warpgroup (8 with
    wg = 4)."""
    return -(-p.ntiles // _WG_TILES[wg])


def wg_config(m: int, p: PreparedNVFP4, device: torch.device, bn: int | None = None, wg: int | None = None,
              blocks: int | None = None, direct: bool | None = None) -> WgConfig:
    """The wgmma kernel's launch shape for M rows (``WgConfig``).

    Unless wg is given: the warp-specialized kernel (wg = 3) above 32 rows, and at 17-32 rows on
    layers of at least _WS_MIN_WEIGHTS weights (every M above 16 with QERL_NVFP4_WG_WS=1), with
    columns of 256 weight rows (wg = 4) up to 64 rows on wide layers (_WS2_MIN_N, _WS2_MIN_K); in one
    row tile of the fewest rows that hold M up to 256 rows, else in row tiles of 128 or 256
    (_ws_row_tile); layers of few column blocks x K groups (_WS_SHORT_UNITS) take from 128
    rows tiles of half the rows.
    Otherwise gemm_wg_kernel: rows past 256 go to row tiles of 128 (two blocks per SM where
    256-row blocks fit one), and so do 193-256 rows on layers of at least _WG_WHOLE_FILL of a wave
    of columns. A kernel with more than one row tile gives every block a whole column (the
    warp-specialized one, where the cost model says so, shares them in one wave of blocks by stream
    K across the row tiles instead: _ws_stream_across); with one,
    the layer's columns x K groups are cut into WG_FILL waves of resident blocks (stream K): no
    partial last wave, whatever the number of columns; a layer with many waves of columns keeps
    whole columns, and from 128-row blocks so does one whose columns fill most of one wave
    (_WG_WHOLE_FILL). Unless ``direct`` is given, blocks of wg = 3 with WS_DIRECT_BN rows copy the
    activations themselves where their K groups times their rows are at most _WS_DIRECT_MAX.
    """
    if wg is None and bn is None and m > WG_BN[0] and (WG_WS or m > 32 or p.n * p.k >= _WS_MIN_WEIGHTS):
        wg = 4 if p.n >= _WS2_MIN_N and p.k >= _WS2_MIN_K and (m <= 32 or (m <= 64 and _ws2_fills(p, device))) else 3
    if bn is None and wg == 4:
        bn = next((b for b in WS2_BN if b >= m), None)
        if bn is None:
            raise ValueError(f"the wgmma kernel with 256-row columns (wg = 4) takes up to {WS2_BN[-1]} rows, got {m}")
    if bn is None and wg == 3:
        bn = next((b for b in WS_BN if b >= m), _ws_row_tile(m, p, device))
        if bn >= _WG_TILE_ROWS and m <= WS_BN[-1] and _wg_columns(p, 3) * p.kg <= _WS_SHORT_UNITS:
            bn //= 2
    if bn is None:
        bn = next((b for b in WG_BN if b >= m), _WG_TILE_ROWS)
        if bn == WG_BN[-1] and wg == 2 and \
                _wg_columns(p, 2) >= _WG_WHOLE_FILL * _wg_occupancy(_WG_TILE_ROWS, 2) * sm_count(device):
            bn = _WG_TILE_ROWS
    if wg is None:
        wg = 1 if bn == 16 else 2
    if (bn, wg) not in _WG_VARIANTS:
        raise ValueError(f"no wgmma kernel for {bn} rows per block with {wg} warpgroups")
    columns = _wg_columns(p, wg)
    tiles = -(-m // bn)
    units = columns * p.kg * (tiles if wg >= 3 else 1)
    if tiles > 1 and wg < 3:
        if blocks not in (None, columns):
            raise ValueError(f"{m} rows take {tiles} row tiles of {bn}: every block a whole column")
        blocks = columns
    elif tiles > 1 and blocks is None:  # whole columns, or one wave of stream K across the row tiles
        sms = sm_count(device)
        across = bn >= _WG_TILE_ROWS and m <= _WS_MODEL_M_MAX and p.n < _WG_WIDEST_N and \
            tiles * columns <= p.ntiles + _EXTRA_COUNTERS and _ws_stream_across(m, p.n, p.k, sms)
        blocks = _wg_occupancy(bn, wg) * sms if across else columns
    elif blocks is None:
        wave = _wg_occupancy(bn, wg) * sm_count(device)
        whole = columns >= _WG_WHOLE_WAVES * wave or ((bn >= _WG_TILE_ROWS or wg == 4) and
                                                       _WG_WHOLE_FILL * wave <= columns <= wave)
        blocks = columns if whole else round(WG_FILL * wave)
    blocks = max(1, min(units, blocks))
    can_copy = wg == 3 and bn in WS_DIRECT_BN and (tiles == 1 or blocks == columns)
    grid = columns * tiles if wg >= 3 and blocks == columns else blocks  # whole columns: one block each
    if direct is None:
        direct = can_copy and -(-units // grid) * bn <= _WS_DIRECT_MAX
    elif direct and not can_copy:
        raise ValueError(f"only the warp-specialized kernel (wg = 3) with {' or '.join(map(str, WS_DIRECT_BN))} rows "
                         f"per block and one row tile or whole columns copies the activations itself, got {bn} "
                         f"rows with wg = {wg}, {tiles} row tiles, {blocks} blocks")
    return WgConfig(bn, wg, blocks, columns, direct)


def _ws_row_tile(m: int, p: PreparedNVFP4, device: torch.device) -> int:
    """Rows per row tile of the warp-specialized kernel past 256 rows: 256 unless 128-row tiles take
    fewer waves' worth of rows (_ws_tiles): 72B q/k/v at 512 rows (80 columns) took 147.5 us in
    128-row tiles against 174.5 in 256-row ones (160 blocks on 132 SMs)."""
    return _ws_tiles(m, _wg_columns(p, 3), sm_count(device))[0]


def _ws2_fills(p: PreparedNVFP4, device: torch.device) -> bool:
    """The layer's columns of 256 weight rows fill most of one wave of resident blocks (whole columns)."""
    wave = _wg_occupancy(WS2_BN[-1], 4) * sm_count(device)
    return _WG_WHOLE_FILL * wave <= _wg_columns(p, 4) <= wave


@lru_cache(maxsize=None)
def wg_permuted_rows() -> int:
    """Rows per block from which the wgmma kernel reads a permuted copy of the activations that a
    kernel of its own writes first (16-byte copies; kPermutedRows in nvfp4_gemm.cu): measured
    7-21% faster than the direct copies at 128 rows, mixed at 64, slower at 32
    (benchmarks/RESULTS.md)."""
    return _build.library().qerl_nvfp4_wg_permuted_rows()


@lru_cache(maxsize=None)
def _ws_stage_bytes(bn: int) -> int:
    return _build.library().qerl_nvfp4_ws_stage_bytes(bn)


def wg_permuted(m: int, cfg: WgConfig, kg: int) -> int:
    """fp32 elements that the activations in the MMA's input order take in the wgmma kernel's
    workspace (bf16, rows to the last row tile's end, K to whole groups), 0 below
    ``wg_permuted_rows`` rows per block; the warp-specialized kernel (wg >= 3) takes them as images
    of its ring's stages (row tiles x chunks of 64 inputs) unless it copies them itself (direct)."""
    if cfg.direct:
        return 0
    if cfg.wg >= 3:
        return cfg.row_tiles(m) * kg * 4 * _ws_stage_bytes(cfg.bn) // 4
    return cfg.row_tiles(m) * cfg.bn * kg * 128 if cfg.bn >= wg_permuted_rows() else 0


def wg_workspace(m: int, cfg: WgConfig, kg: int) -> int:
    """fp32 elements of the wgmma kernel's workspace: the permuted activations (``wg_permuted``),
    then, when columns are shared, the partial sums (a slot per block and column: M x the column's
    weight rows, or bn x them up to _WG_REGISTER_SUMS_BN rows per block, where each thread stores its
    accumulators)."""
    rows = max(m, cfg.bn) if cfg.bn <= _WG_REGISTER_SUMS_BN else min(m, cfg.bn)
    sums = (cfg.blocks + cfg.launch_columns(m)) * rows * 16 * _WG_TILES[cfg.wg] if cfg.shared else 0
    return wg_permuted(m, cfg, kg) + sums


def _prefetch(m: int) -> int:
    return PREFETCH_GROUPS if m >= _PREFETCH_MIN_M else 0


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _epilogue_args(m: int, p: PreparedNVFP4, bias: torch.Tensor | None, lora) -> tuple:  # noqa: ANN001
    """The kernel's epilogue arguments (bias, s, b, r, ld_s, ld_b, n1, n2), checked."""
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.numel() != p.n or not bias.is_contiguous()):
        raise ValueError(f"the epilogue bias must be a contiguous bf16 vector of {p.n} elements")
    if lora is None:
        return (_ptr(bias), None, None, 0, 0, 0, 0, 0)
    s, b = lora.s, lora.b
    if (s.dtype != torch.float32 or b.dtype != torch.float32 or s.stride(1) != 1 or b.stride(1) != 1
            or s.shape[0] < m or b.shape[0] < lora.r or b.shape[1] < p.n):
        raise ValueError("the epilogue LoRA term needs fp32 s (M, G*r) and b (r, N) with unit column stride")
    return (_ptr(bias), s.data_ptr(), b.data_ptr(), lora.r, s.stride(0), b.stride(0), min(lora.n1, 2**31 - 1),
            min(lora.n2, 2**31 - 1))


class RowNorm(NamedTuple):
    """An RMSNorm applied by the small kernel to its own output (norm mode, up to 16 rows).

    The kernel's activations are ``hw = bf16(x * w)`` (a residual-mode launch of the previous
    projection writes them); its output rows are multiplied by ``r = rsqrt(mean(x^2) + eps)``
    before rounding, i.e. the product of RMSNorm(x) * w up to bf16 rounding. The launch also
    computes ``r`` and the LoRA shrink ``s = r * (hw @ a^T)`` (the shrink of the normed rows) with
    blocks of its own, so that no kernel runs between the two projections. With ``x`` None there is
    no norm (r = 1): the launch computes only the LoRA shrink of its own activations
    (``shrink_tasks``)."""

    x: torch.Tensor | None  # (M, K) bf16: the residual rows, or None (shrink only)
    a: torch.Tensor | None  # (T, K) fp32: the LoRA A rows, or None
    s: torch.Tensor | None  # (M, T) fp32 out (with a)
    r: torch.Tensor  # (M,) fp32 out
    sync: torch.Tensor  # int32, zero before the launch (counts the tasks done)
    eps: float


def shrink_tasks(m: int, a: torch.Tensor, sync: torch.Tensor) -> RowNorm:
    """A RowNorm without a norm: the launch's tasks compute s = x2 @ a^T (its activations' LoRA
    shrink, into the returned tuple's s) for its epilogue's LoRA term, in place of a launch of its
    own. ``sync``: a zero int32 counter."""
    s = torch.empty(m, a.shape[0], dtype=torch.float32, device=a.device)
    r = torch.empty(m, dtype=torch.float32, device=a.device)
    return RowNorm(None, a, s, r, sync, 0.0)


def _mode_args(m: int, k: int, ldy: int, n: int, residual, norm: RowNorm | None) -> tuple:  # noqa: ANN001
    """The kernel's residual- and norm-mode arguments (hw, w, xn, a, s_out, r_out, sync, ntasks, eps),
    checked; ``residual`` is (hw out (M, N) bf16, w (N,) fp32) or None."""
    hw = w = None
    if residual is not None:
        hw, w = residual
        if (hw.dtype != torch.bfloat16 or not hw.is_contiguous() or hw.shape != (m, n) or ldy != n
                or w.dtype != torch.float32 or not w.is_contiguous() or w.numel() != n):
            raise ValueError("residual mode needs hw (M, N) bf16 and w (N,) fp32, contiguous, and an output of row "
                             "stride N")
    if norm is None:
        return (_ptr(hw), _ptr(w), None, None, None, None, None, 0, ctypes.c_float(0.0))
    x, a, s, r, sync, eps = norm
    if m > 16 or k % 16:
        raise ValueError(f"norm mode takes up to 16 rows and a multiple of 16 inputs, got {m} x {k}")
    ok = ((x is None and a is not None) or (x is not None and x.dtype == torch.bfloat16 and x.is_contiguous()
                                             and x.shape == (m, k)))
    ok = (ok and r.dtype == torch.float32 and r.is_contiguous() and r.numel() >= m and sync.dtype == torch.int32
          and sync.numel() >= 1)
    if a is not None:
        ok = ok and (a.dtype == torch.float32 and a.is_contiguous() and a.shape[1] == k and s is not None
                     and s.dtype == torch.float32 and s.is_contiguous() and s.shape == (m, a.shape[0]))
    if not ok:
        raise ValueError("norm mode needs x (M, K) bf16 or a, r (M,) fp32, a zero int32 sync, and with a (T, K) "
                         "fp32 s (M, T) fp32, all contiguous")
    return (_ptr(hw), _ptr(w), _ptr(x), _ptr(a), _ptr(s), r.data_ptr(), sync.data_ptr(),
            1 if a is None else a.shape[0], ctypes.c_float(eps))


def _check_counters(p: PreparedNVFP4, shared: bool, columns: int) -> None:
    """Columns shared between blocks (split or stream K) take one ticket per column block."""
    if shared and p.counters.numel() < columns:
        raise ValueError(f"split K over {columns} column blocks needs as many counters, the layer has "
                         f"{p.counters.numel()}: make it with prepare_tensors")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def gemm_small_into(x2: torch.Tensor, p: PreparedNVFP4, out: torch.Tensor, *, tnw: int | None = None,
                    splits: int | None = None, wpt: int | None = None, workspace: torch.Tensor | None = None,
                    prefetch: int | None = None, bias: torch.Tensor | None = None,
                    lora=None, residual=None, norm: RowNorm | None = None) -> torch.Tensor:  # noqa: ANN001
    """Fused kernel into ``out`` [M, N] (bf16, row stride N) for x2 [M, K] bf16, M <= SMALL_M_MAX.

    ``bias`` (bf16 [N]) and ``lora`` (fused_ops.LoraTerm: s [M, G*r] and b [r, N] fp32, member
    edges n1, n2) are added in the kernel's epilogue in the eager order (bf16 product, + bias in
    bf16, + delta in fp32, rounded once), which saves a launch per projection.

    ``residual`` = (hw, w): ``out`` is the residual stream, updated in place to out + the
    projection (bf16), and hw (M, N) gets bf16(out * w) (the next RMSNorm's input times its weight,
    see RowNorm). ``norm``: the RMSNorm of ``norm.x`` applied to this projection (x2 is then hw);
    its factors and LoRA shrink are written to norm.r and norm.s (the ``lora`` term may read the
    latter)."""
    m = x2.shape[0]
    if m > SMALL_M_MAX or m < 1:
        raise ValueError(f"the fused kernel takes 1..{SMALL_M_MAX} rows, got {m}")
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    mt, tnw, splits, gps, wpt = small_config(m, p, x2.device, tnw, splits, wpt)
    _check_counters(p, splits > 1, small_column_blocks(p, tnw, wpt))
    ws = _workspace(small_workspace(m, p, splits), x2, workspace)
    ws_ptr = 0 if ws is None else ws.data_ptr()
    lib = _build.library()
    err = lib.qerl_nvfp4_gemm_small(
        mt, tnw, wpt, p.wq.data_ptr(), x2.data_ptr(), out.data_ptr(), ws_ptr, p.counters.data_ptr(),
        p.alpha.data_ptr(), m, p.n, p.k, x2.stride(0), out.stride(0), p.ntiles, p.kg, splits, gps,
        _prefetch(m) if prefetch is None else prefetch, *_epilogue_args(m, p, bias, lora),
        *_mode_args(m, p.k, out.stride(0), p.n, residual, norm), _stream(x2.device),
    )
    _build.check(lib, err, "NVFP4 fused GEMM launch")
    return out


def gemm_wg_into(x2: torch.Tensor, p: PreparedNVFP4, out: torch.Tensor, *, bn: int | None = None,
                 wg: int | None = None, blocks: int | None = None, workspace: torch.Tensor | None = None,
                 prefetch: int | None = None, direct: bool | None = None) -> torch.Tensor:
    """wgmma kernel into ``out`` [M, N] (bf16, row stride N) for x2 [M, K] bf16, any M >= 1."""
    m = x2.shape[0]
    if m < 1:
        raise ValueError("the wgmma kernel needs at least one row")
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    cfg = wg_config(m, p, x2.device, bn, wg, blocks, direct)
    _check_counters(p, cfg.shared, cfg.launch_columns(m))
    ws = _workspace(wg_workspace(m, cfg, p.kg), x2, workspace)
    xp = wg_permuted(m, cfg, p.kg)
    lib = _build.library()
    err = lib.qerl_nvfp4_gemm_wg(
        cfg.bn, cfg.wg, p.wq.data_ptr(), x2.data_ptr(), out.data_ptr(), _ptr(ws[xp:]) if cfg.shared else None,
        _ptr(ws) if xp else None, p.counters.data_ptr(),
        p.alpha.data_ptr(), m, p.n, p.k, x2.stride(0), out.stride(0), p.ntiles, p.kg, cfg.blocks,
        WG_PREFETCH_GROUPS if prefetch is None else prefetch, _stream(x2.device), int(cfg.direct),
    )
    _build.check(lib, err, "NVFP4 wgmma GEMM launch")
    return out


def dequant_into(p: PreparedNVFP4, out: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] weights times 2^-7 (exact) into ``out``."""
    lib = _build.library()
    err = lib.qerl_nvfp4_dequant(p.wq.data_ptr(), out.data_ptr(), p.n, p.k, p.ntiles, p.kg, _stream(out.device))
    _build.check(lib, err, "NVFP4 dequantize launch")
    return out


def matmul_epilogue(x2: torch.Tensor, p: PreparedNVFP4, bias: torch.Tensor | None,
                    lora, *, norm: RowNorm | None = None) -> torch.Tensor | None:  # noqa: ANN001 - LoraTerm
    """x2 [M, K] @ W^T + bias + LoRA delta in one launch (the small-M kernel's epilogue; see
    gemm_small_into), or None where that kernel does not run (other M, no kernels here): the
    caller then adds bias and delta itself. With ``norm``, x2 is hw and the RMSNorm is applied
    (RowNorm)."""
    if not small_epilogue(x2, p):
        return None
    out = torch.empty(x2.shape[0], p.n, dtype=torch.bfloat16, device=x2.device)
    return gemm_small_into(x2, p, out, bias=bias, lora=lora, norm=norm)


def small_epilogue(x2: torch.Tensor, p: PreparedNVFP4) -> bool:
    """Whether the small-M kernel, and so its epilogue modes, runs for x2 @ W^T here."""
    return available(x2) and kernel_path(x2.shape[0], p.n, p.k) == "small"


def matmul_residual(x2: torch.Tensor, p: PreparedNVFP4, bias: torch.Tensor | None, lora,  # noqa: ANN001
                    x: torch.Tensor, w: torch.Tensor, norm: RowNorm | None = None) -> torch.Tensor:
    """The residual-mode launch (see gemm_small_into): x += x2 @ W^T + bias + LoRA delta in place
    (bf16) and returns hw = bf16(x * w), for a following norm-mode launch (RowNorm). Only where
    ``small_epilogue`` holds."""
    hw = torch.empty_like(x)
    gemm_small_into(x2, p, x, bias=bias, lora=lora, residual=(hw, w), norm=norm)
    return hw


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * (a @ b) with one rounding (cuBLAS applies alpha to the fp32 sums)."""
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=alpha)


def _weights(p: PreparedNVFP4, x: torch.Tensor) -> torch.Tensor:
    if available(x):
        return dequant_into(p, torch.empty(p.n, p.k, dtype=torch.bfloat16, device=x.device))
    return layout.dequantize(p.wq, p.n, p.k)


def _mm(x2: torch.Tensor, p: PreparedNVFP4) -> torch.Tensor:
    if x2.shape[0] == 0:
        return x2.new_zeros(0, p.n)
    if available(x2):
        route = kernel_path(x2.shape[0], p.n, p.k)
        if route == "cublas":
            return _scaled_mm(x2, _weights(p, x2).t(), p.alpha_value)
        out = torch.empty(x2.shape[0], p.n, dtype=torch.bfloat16, device=x2.device)
        if route == "small":
            return gemm_small_into(x2, p, out)
        return gemm_wg_into(x2, p, out)
    w = _weights(p, x2).float()
    return (x2.float() @ w.t() * p.alpha_value).to(x2.dtype)


def matmul_2d(x2: torch.Tensor, p: PreparedNVFP4) -> torch.Tensor:
    """x2 (M, K) @ W^T -> (M, N) by the path nvfp4_matmul takes, called directly: for callers
    outside autograd and torch.compile (the rollout engine), where the custom op's dispatch (tens
    of microseconds a call on the host) adds up in an eager prefill of ~100 projections."""
    if x2.dim() != 2 or x2.shape[1] != p.k:
        raise ValueError(f"matmul_2d takes (M, {p.k}) inputs, got {tuple(x2.shape)}")
    return _mm(x2, p)


def _mm_t(dy2: torch.Tensor, p: PreparedNVFP4) -> torch.Tensor:
    if available(dy2):
        return _scaled_mm(dy2, _weights(p, dy2), p.alpha_value)
    w = _weights(p, dy2).float()
    return (dy2.float() @ w * p.alpha_value).to(dy2.dtype)


def _mm_nd(x: torch.Tensor, p: PreparedNVFP4) -> torch.Tensor:  # (..., K) -> (..., N)
    return _mm(x.reshape(-1, p.k), p).view(*x.shape[:-1], p.n)


def _mm_t_nd(dy: torch.Tensor, p: PreparedNVFP4) -> torch.Tensor:  # (..., N) -> (..., K)
    return _mm_t(dy.reshape(-1, p.n), p).view(*dy.shape[:-1], p.k)


# -- custom ops (opaque to torch.compile, capturable in CUDA graphs) ---------------------------
# torch.compile traces the custom ops; eager callers (the learner's ~600 projections of a 7B
# micro-batch, forward, recompute and backward) run the same path directly, without the op's
# dispatch on the host (tens of microseconds a call).
@torch.library.custom_op("qerl::nvfp4_mm", mutates_args=())
def _nvfp4_mm(x: torch.Tensor, wq: torch.Tensor, alpha: torch.Tensor, counters: torch.Tensor, n: int, k: int,
              alpha_value: float) -> torch.Tensor:
    return _mm_nd(x, PreparedNVFP4(wq, alpha, counters, n, k, alpha_value))


@_nvfp4_mm.register_fake
def _(x, wq, alpha, counters, n, k, alpha_value):
    return x.new_empty(*x.shape[:-1], n)


@torch.library.custom_op("qerl::nvfp4_mm_t", mutates_args=())
def _nvfp4_mm_t(dy: torch.Tensor, wq: torch.Tensor, n: int, k: int, alpha_value: float) -> torch.Tensor:
    return _mm_t_nd(dy, PreparedNVFP4(wq, dy.new_empty(0, dtype=torch.float32), dy.new_empty(0, dtype=torch.int32),
                                      n, k, alpha_value))


@_nvfp4_mm_t.register_fake
def _(dy, wq, n, k, alpha_value):
    return dy.new_empty(*dy.shape[:-1], k)


def _prepared(obj: PreparedNVFP4 | torch.nn.Module) -> PreparedNVFP4:
    return obj if isinstance(obj, PreparedNVFP4) else prepare(obj)


def nvfp4_matmul(x: torch.Tensor, layer: PreparedNVFP4 | torch.nn.Module) -> torch.Tensor:
    """x (..., K) @ W^T -> (..., N), W = e2m1 * scale / global_scale; ``layer`` is an NVFP4 layer
    (repacked on first use, cached on it) or its PreparedNVFP4."""
    p = _prepared(layer)
    if x.shape[-1] != p.k:
        raise ValueError(f"input has {x.shape[-1]} features, the layer takes {p.k}")
    if not torch.compiler.is_compiling():  # eager: the op's own path without its dispatch (above)
        return _mm_nd(x, p)
    return torch.ops.qerl.nvfp4_mm(x, p.wq, p.alpha, p.counters, p.n, p.k, p.alpha_value)


def nvfp4_matmul_t(dy: torch.Tensor, layer: PreparedNVFP4 | torch.nn.Module) -> torch.Tensor:
    """dy (..., N) @ W -> (..., K): the input gradient of nvfp4_matmul."""
    p = _prepared(layer)
    if dy.shape[-1] != p.n:
        raise ValueError(f"gradient has {dy.shape[-1]} features, the layer outputs {p.n}")
    if not torch.compiler.is_compiling():
        return _mm_t_nd(dy, p)
    return torch.ops.qerl.nvfp4_mm_t(dy, p.wq, p.n, p.k, p.alpha_value)
