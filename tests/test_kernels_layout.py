"""NVFP4 kernel layout and the torch fallback, on CPU (the GPU kernels are in test_kernels_gpu.py).

The repacked layout is dequantized here with the kernel's own bit operations and compared
bit for bit with compressed-tensors' unpacking times the e4m3 scales.
"""
from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

from engine import kernels
from engine.kernels import nvfp4_layout as layout
from engine.quant.base import FrozenLinear


def random_nvfp4(n: int, k: int, gen: torch.Generator, special: bool = True):
    """Every code, scales over the whole e4m3 range (zero, subnormal, negative blocks too)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    log2 = torch.empty(n, k // 16).uniform_(-9.5, 8.8, generator=gen)
    scale = torch.exp2(log2).to(torch.float8_e4m3fn)
    if special:
        bits = scale.view(torch.uint8)
        bits[0, 0] = 0x00  # zero block
        bits[-1, -1] = 0x03  # subnormal 3 * 2^-9
        bits[n // 2, 0] = 0x80 | 0x38  # -1.0
    gscale = torch.empty(1).uniform_(5.0, 500.0, generator=gen)
    return packed, scale, gscale


@pytest.mark.parametrize("n,k", [(16, 16), (40, 48), (64, 64), (100, 336), (130, 1040)])
def test_repack_dequantizes_exactly(n, k):
    gen = torch.Generator().manual_seed(n * 7 + k)
    packed, scale, _ = random_nvfp4(n, k, gen)
    ref = unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32) * scale.float().repeat_interleave(16, 1)
    assert torch.equal(layout.reference_dequantize(packed, scale).float(), ref)
    wq = layout.repack(packed, scale)
    assert wq.shape == (-(-n // 64) * 4, -(-k // 256), 576)
    got = layout.dequantize(wq, n, k).float() * 2.0**layout.WEIGHT_EXP2
    assert torch.equal(got, ref)


def test_nan_scale_is_rejected():
    packed = torch.zeros(16, 8, dtype=torch.uint8)
    scale = torch.ones(16, 1).to(torch.float8_e4m3fn)
    scale.view(torch.uint8)[3, 0] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        layout.repack(packed, scale)


class _KernelNVFP4(FrozenLinear):
    """A minimal NVFP4 layer wired to the kernels the way NVFP4Linear is."""

    fmt = "nvfp4"

    def __init__(self, packed, scale, gscale):
        super().__init__(2 * packed.shape[1], packed.shape[0], None)
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_global_scale", gscale)

    def _matmul(self, x):
        return kernels.nvfp4_matmul(x, kernels.prepare(self))

    def _matmul_t(self, dy):
        return kernels.nvfp4_matmul_t(dy, kernels.prepare(self))


def test_fallback_forward_backward_matches_float64():
    gen = torch.Generator().manual_seed(3)
    n, k = 72, 96
    packed, scale, gscale = random_nvfp4(n, k, gen, special=False)
    layer = _KernelNVFP4(packed, scale, gscale)
    w = layout.reference_dequantize(packed, scale).double() / gscale.double()
    x = torch.randn(2, 5, k, generator=gen).bfloat16().requires_grad_(True)
    y = layer(x)
    ref = x.detach().double() @ w.t()
    assert y.shape == (2, 5, n) and y.dtype == torch.bfloat16
    assert ((y.double() - ref).norm() / ref.norm()).item() < 3e-3
    dy = torch.randn(2, 5, n, generator=gen).bfloat16()
    y.backward(dy)
    dref = dy.double() @ w
    assert ((x.grad.double() - dref).norm() / dref.norm()).item() < 3e-3
    assert kernels.prepare(layer) is kernels.prepare(layer)  # cached on the layer


def test_custom_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(4)
    packed, scale, gscale = random_nvfp4(32, 64, gen, special=False)
    p = kernels.prepare_tensors(packed, scale, gscale)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.qerl.nvfp4_mm.default, (x, p.wq, p.alpha, p.counters, p.n, p.k, p.alpha_value))
    dy = torch.randn(3, 32, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.qerl.nvfp4_mm_t.default, (dy, p.wq, p.n, p.k, p.alpha_value))
    assert not kernels.available(x)


def test_kernel_cache_key_covers_local_headers(tmp_path):
    """A kernel file's cache key includes the local headers it includes (once each, nested too),
    so editing a shared header rebuilds every file that uses it; the shipped files resolve."""
    from pathlib import Path

    from engine.kernels._build import _with_headers

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.cuh").write_text('#include "sub/b.cuh"\nA_BODY\n')
    (tmp_path / "sub" / "b.cuh").write_text("B_BODY\n")
    src = tmp_path / "k.cu"
    src.write_text('#include <cuda_runtime.h>\n#include "a.cuh"\n  # include "a.cuh"\nK_BODY\n')
    text = _with_headers(src)
    assert [text.count(x) for x in ("K_BODY", "A_BODY", "B_BODY")] == [1, 1, 1]
    before = text
    (tmp_path / "sub" / "b.cuh").write_text("B_BODY changed\n")
    assert _with_headers(src) != before
    root = Path(kernels.__file__).parent.parent
    for cu in ("kernels/nvfp4_gemm.cu", "rollout/fused_decode.cu", "rollout/decode_attention.cu"):
        assert "griddepcontrol.wait" in _with_headers(root / cu)  # each uses kernels/pdl.cuh


@pytest.mark.skipif(__import__("engine.kernels._build", fromlist=["_nvcc"])._nvcc() is None, reason="needs nvcc")
def test_kernel_files_build_and_export_their_entry_points(tmp_path, monkeypatch):
    """Every CUDA file builds with nvcc for sm_90a (no GPU needed) and exports the C functions its
    Python side declares: a kernel change that does not compile fails here, on CPU machines too."""
    from engine.kernels import _build
    from engine.rollout import attention, fused_ops

    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path))
    for mod in (_build, fused_ops, attention):
        source, signatures = mod.SOURCE, mod._SIGNATURES
        errors = [n for n in signatures if n.endswith("error_string")]
        # every declared function is looked up here: a missing export raises
        lib = _build.load_library(source, source.stem, mod.FLAGS, source.name, signatures, errors[0], "nothing")
        assert lib is not None, f"{source.name} did not build"
        assert getattr(lib, errors[0])(0) == b"no error"  # the signatures were applied
        assert sorted(tmp_path.glob(f"kernels/{source.stem}_*.so"))


@pytest.mark.skipif(__import__("engine.kernels._build", fromlist=["_nvcc"])._nvcc() is None, reason="needs nvcc")
def test_read_patterns_benchmark_builds(tmp_path):
    """benchmarks/read_patterns.cu, a standalone GPU program (no torch), builds for sm_90a with its
    header's command, and its per-chunk work is the kernels' own (it includes their unpack)."""
    import subprocess
    from pathlib import Path

    from engine.kernels import _build

    src = Path(__file__).resolve().parent.parent / "benchmarks" / "read_patterns.cu"
    out = tmp_path / "read_patterns"
    done = subprocess.run([_build._nvcc(), "-O3", "-std=c++17", "-arch=sm_90a", "-o", str(out), str(src)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.stat().st_size > 0
    kernel, text = (Path(kernels.__file__).parent / "nvfp4_gemm.cu").read_text(), src.read_text()
    assert '#include "nvfp4_unpack.cuh"' in kernel and '#include "../engine/kernels/nvfp4_unpack.cuh"' in text
    assert "qerl::unpack8(q, r0, r1, r2, r3);" in text  # its plain rows time the kernels' unpack

    # its mul rows' unpack: the LOP3 tables it uses and the multiply form of a rotation give the
    # plain unpack's bits (emulated here; the GPU run compares the rows' block sums too)
    def lop3(a: int, b: int, c: int, lut: int) -> int:
        return sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | (c >> i) & 1)) & 1) << i for i in range(32))

    luts = {name: int(text.split(f"uint32_t {name}(")[1].split("lop3.b32 %0, %1, %2, %3, ")[1][:4], 16)
            for name in ("or_and", "and_or")}

    def rot(q: int, k: int) -> int:
        return (q >> k | q << (32 - k)) & 0xFFFFFFFF

    def rot_and_mul(q: int, k: int, mask: int) -> int:
        w = q << (32 - k)  # q * 2^(32 - k): high word q >> k, low word q << (32 - k)
        return lop3(w >> 32, w & 0xFFFFFFFF, mask, luts["or_and"])

    gen = torch.Generator().manual_seed(5)
    for q in [0, 0xFFFFFFFF, 1, 0x80000000] + torch.randint(0, 2**32, (200,), generator=gen).tolist():
        r3 = rot(q, 14) & 0x00400040 | rot(q, 6) & 0x81808180  # the previous layout's ("mma rot")
        assert rot_and_mul(q, 4, 0x81C081C0) == rot(q, 4) & 0x81C081C0
        assert rot_and_mul(q, 10, 0x81C081C0) == rot(q, 10) & 0x81C081C0
        assert lop3(rot(q, 14), rot_and_mul(q, 6, 0x81808180), 0x00400040, luts["and_or"]) == r3
        # "mma imad": the kernels' r3 with the left shift as a multiply, through the and_or LOP3
        r3 = (q << 6) & 0x80C080C0 | (q >> 2) & 0x01000100
        assert lop3((q * 64) & 0xFFFFFFFF, (q >> 2) & 0x01000100, 0x80C080C0, luts["and_or"]) == r3


def test_small_kernel_launch_rule_by_layer_kind(monkeypatch):
    """The launch rule on an H200's 132 SMs, as (8-row tiles, tiles per warp, K splits, groups per
    slice, warps per tile): narrow layers spread each tile's K over the eight warps of one block
    per tile (two tiles per warp where one block per tile would leave a partial wave); long-K ones
    from 3 rows take eight or four warps per tile and the K split whose one wave of blocks fills
    the multiprocessors best (up to 8 rows) or most (9-16 rows, two tiles per warp), and below 3
    rows four warps, two tiles, K split to about four blocks per SM; gate_up four warps per tile
    at 3-8 rows, two tiles per warp below, and at 9-16 rows two warps per tile (four from 32
    groups) with two tiles per warp unless that leaves a last wave less than half full; above 16
    rows the block target alone; explicit arguments are kept."""
    from types import SimpleNamespace

    from engine.kernels import nvfp4_gemm as gemm

    monkeypatch.setattr(gemm, "sm_count", lambda device: 132)
    occupancy = {(1, 1): 4, (1, 2): 3, (2, 1): 3, (2, 2): 2}  # blocks per SM (measured on H200)
    monkeypatch.setattr(gemm, "_small_occupancy", lambda mt, tnw: occupancy[mt, tnw])
    qkv7 = SimpleNamespace(ntiles=4608 // 16, kg=3584 // 256)
    qkv14 = SimpleNamespace(ntiles=7168 // 16, kg=5120 // 256)  # 448 tiles: more than 3 x 132 blocks
    qkv72 = SimpleNamespace(ntiles=10240 // 16, kg=8192 // 256)  # 640 tiles: more than 4 x 132
    down7 = SimpleNamespace(ntiles=3584 // 16, kg=18944 // 256)  # 74 groups: long K
    down32 = SimpleNamespace(ntiles=5120 // 16, kg=27648 // 256)
    up7 = SimpleNamespace(ntiles=37888 // 16, kg=3584 // 256)  # 2368 tiles: wide
    up14 = SimpleNamespace(ntiles=27648 // 16, kg=5120 // 256)
    up72 = SimpleNamespace(ntiles=59136 // 16, kg=8192 // 256)
    cpu = torch.device("cpu")
    for m in (1, 2, 3, 8):
        assert gemm.small_config(m, qkv7, cpu) == (1, 1, 1, 2, 8)  # 14 groups over 7 of 8 warps
    assert gemm.small_config(16, qkv7, cpu) == (2, 1, 1, 2, 8)
    assert gemm.small_config(8, qkv14, cpu) == (1, 1, 1, 3, 8)
    for m in (9, 16):
        assert gemm.small_config(m, qkv14, cpu) == (2, 2, 1, 3, 8)  # two tiles per warp: 224 blocks
    assert gemm.small_config(1, qkv72, cpu) == (1, 1, 1, 4, 8)
    assert gemm.small_config(3, qkv72, cpu) == (1, 2, 1, 4, 8)  # 320 blocks
    assert gemm.small_config(1, down7, cpu) == (1, 2, 7, 3, 4)  # 56 column blocks: 9 splits asked, 25 slices
    for m in (3, 8):
        assert gemm.small_config(m, down7, cpu) == (1, 1, 2, 5, 8)  # 448 blocks: as full as 224, more of them
        assert gemm.small_config(m, down32, cpu) == (1, 1, 3, 9, 4)  # 480 blocks of 528, 91% of 4 rounds
    for m in (9, 16):
        assert gemm.small_config(m, down7, cpu) == (2, 2, 2, 5, 8)  # 224 blocks of 264
        assert gemm.small_config(m, down32, cpu) == (2, 2, 3, 9, 4)  # 240 blocks (eight warps: 160)
    assert gemm.small_config(1, up7, cpu) == (1, 2, 5, 3, 1)  # 148 column blocks, 800-block target
    assert gemm.small_config(8, up7, cpu) == (1, 1, 1, 4, 4)
    assert gemm.small_config(16, up7, cpu) == (2, 1, 1, 7, 2)  # two tiles: 296 blocks, 1.12 waves
    assert gemm.small_config(16, up14, cpu) == (2, 2, 1, 10, 2)  # 216 blocks
    assert gemm.small_config(16, up72, cpu) == (2, 2, 1, 8, 4)  # 32 groups: four warps, 924 blocks
    two_waves = SimpleNamespace(ntiles=4 * 2 * 264, kg=20)
    assert gemm.small_config(16, two_waves, cpu) == (2, 2, 1, 10, 2)  # 528 blocks: two whole waves
    assert gemm.small_config(17, down7, cpu) == (4, 1, 7, 11, 1)  # 200-block target, whole tiles
    assert gemm.small_config(8, down7, cpu, splits=5) == (1, 1, 5, 15, 1)  # explicit: no slices
    assert gemm.small_config(8, down7, cpu, splits=2, wpt=4) == (1, 1, 2, 10, 4)
    with pytest.raises(ValueError, match="warps per weight tile"):
        gemm.small_config(17, down7, cpu, wpt=2)


def test_wgmma_path_and_launch_rule(monkeypatch):
    """The paths and wgmma launch shapes on an H200's 132 SMs (one warp-specialized block per SM,
    two two-warpgroup blocks of up to 128 rows): above 32 rows, and from 30M weights above 16, the
    warp-specialized kernel (wg = 3) in one row tile shared by stream K, or, on layers with few
    column blocks x K groups, from 128 rows in two tiles of half the rows with whole columns;
    on wide layers with long rows, columns of 256 weight rows (wg = 4) up to 32 rows, or up to 64
    where they fill most of a wave (then whole columns); past 256 rows tiles of 256 or of 128,
    whichever takes fewer waves' worth of rows, and the narrower layers where the cost model says
    so; dequantize + cuBLAS beyond the crossovers; explicit arguments keep the two-warpgroup
    kernel."""
    from types import SimpleNamespace

    from engine.kernels import nvfp4_gemm as gemm

    monkeypatch.setattr(gemm, "sm_count", lambda device: 132)
    monkeypatch.setattr(gemm, "_wg_occupancy", lambda bn, wg: 1 if wg >= 3 or bn > 128 else (4 if wg == 1 else 2))
    monkeypatch.setattr(gemm, "WG_WS", False)
    shapes = {"qkv7": (4608, 3584), "o7": (3584, 3584), "up7": (37888, 3584), "down7": (3584, 18944),
              "up14": (27648, 5120), "down14": (5120, 13824), "up32": (55296, 5120), "qkv14": (7168, 5120),
              "qkv72": (10240, 8192), "odd": (1008, 1024)}
    layers = {name: SimpleNamespace(n=n, k=k, ntiles=n // 16, kg=k // 256) for name, (n, k) in shapes.items()}
    path = {name: [gemm.kernel_path(m, n, k) for m in (16, 32, 64, 128, 256, 320, 512, 1024)]
            for name, (n, k) in shapes.items()}
    # 12.8M weights; at 512 rows 112 blocks of 128 rows fill most of a wave (the cost model)
    assert path["o7"] == ["small", "wg", "wg", "cublas", "cublas", "cublas", "wg", "cublas"]
    # 16.5M; 108 blocks of 128 rows at 320 rows: one wave, 144-288 at 512-1024: two
    assert path["qkv7"] == ["small", "wg", "wg", "wg", "wg", "wg", "cublas", "cublas"]
    assert path["down7"] == ["small", "wg", "wg", "wg", "wg", "wg", "wg", "cublas"]  # N < 7168: the cost model
    assert path["up7"] == ["small", "wg", "wg", "wg", "wg", "wg", "wg", "wg"]
    assert path["down14"][5] == "wg"  # 120 blocks of 128 rows: one wave (86 against 130 us with cuBLAS)
    assert gemm.kernel_path(1025, *shapes["up7"]) == "cublas"
    assert gemm.kernel_path(512, 7168, 5120) == "wg" and gemm.kernel_path(513, 7168, 5120) == "cublas"
    assert gemm.kernel_path(2048, *shapes["up32"]) == "wg" and gemm.kernel_path(2049, *shapes["up32"]) == "cublas"
    assert gemm.kernel_path(1025, *shapes["up14"]) == "cublas"
    # the cost model past 256 rows (narrower layers): one well-filled wave of 256-row tiles wins,
    # two waves of which the second is nearly empty lose, and past _WS_MODEL_M_MAX rows cuBLAS
    assert gemm.kernel_path(768, *shapes["qkv72"]) == "wg" and gemm.kernel_path(768, *shapes["down14"]) == "wg"
    assert gemm.kernel_path(1024, *shapes["down14"]) == "cublas"  # 160 blocks: 1.2 waves
    assert gemm.kernel_path(1536, 8192, 8192) == "cublas" and gemm.kernel_path(1024, 8192, 8192) == "wg"
    assert gemm.kernel_path(768, *shapes["qkv72"], sms=78) == "cublas"  # 240 blocks on 78 SMs: 3.1 waves
    cpu = torch.device("cpu")
    want = {  # (layer, M): (rows per block, warpgroups, blocks, column blocks, copies its activations)
        ("o7", 32): (32, 2, 264, 28, False),  # 12.8M weights: two warpgroups, stream K over a wave of 2 x 132
        ("up7", 17): (32, 3, 132, 296, False),  # 136M: warp-specialized from 17 rows
        ("o7", 64): (64, 3, 132, 28, True),  # 3 units of 64 rows a block: the producer copies x
        ("qkv7", 64): (64, 3, 132, 36, True),
        ("qkv7", 128): (64, 3, 36, 36, False),  # 36 x 14 units: two row tiles of 64, whole columns
        ("qkv7", 256): (128, 3, 36, 36, False),
        ("up7", 128): (128, 3, 132, 296, False),
        ("down7", 256): (256, 3, 132, 28, False),  # 28 x 74 units: one tile, stream K
        ("up7", 512): (256, 3, 296, 296, False),
        ("up7", 384): (128, 3, 296, 296, False),  # 888 blocks of 128 rows: 7 waves, 592 of 256: 5
        ("up7", 385): (256, 3, 296, 296, False),  # 1184 of 128: 9 waves
        ("up7", 1024): (256, 3, 296, 296, False),
        ("qkv14", 512): (256, 3, 56, 56, False),  # 2 x 56 blocks: one wave either way, 256-row tiles
        ("qkv14", 300): (256, 3, 56, 56, False),  # 2 x 56 blocks of 256 rows: one wave, 3 x 56 of 128: two
        ("qkv72", 512): (128, 3, 80, 80, False),  # 2 x 80 blocks of 256 rows: two waves, 4 x 80 of 128: three
        ("qkv72", 768): (256, 3, 80, 80, False),  # 3 x 80 of 256: two waves, 6 x 80 of 128: four
        ("down7", 512): (128, 3, 28, 28, False),  # 4 x 28 blocks of 128 rows: one wave
        ("odd", 100): (64, 3, 8, 8, True),  # two row tiles of 64, whole columns of 4 groups: the block copies x
        # 2 x 40 blocks of 256 rows, 0.6 wave: one wave of blocks shares them by stream K across the row tiles
        ("down14", 512): (256, 3, 132, 40, False),
        ("down14", 768): (256, 3, 40, 40, False),  # 3 x 40: 0.91 wave, whole columns
        ("up14", 17): (32, 4, 108, 108, False),  # N >= 16384, K >= 4096: columns of 16 tiles, here 0.82 wave:
        ("up14", 64): (64, 4, 108, 108, False),  # whole columns, up to 64 rows
        ("up14", 65): (128, 3, 132, 216, False),
        ("up32", 32): (32, 4, 132, 216, False),  # 1.6 waves of 16-tile columns: stream K, up to 32 rows only
        ("up32", 64): (64, 3, 132, 432, False),
        ("down14", 64): (64, 3, 132, 40, False),
    }
    for (name, m), cfg in want.items():
        assert tuple(gemm.wg_config(m, layers[name], cpu)) == cfg, (name, m)
    assert gemm.wg_config(256, layers["down7"], cpu, bn=256)[:2] == (256, 2)
    assert gemm.wg_config(64, layers["up7"], cpu, wg=2)[:2] == (64, 2)
