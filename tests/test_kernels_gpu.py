"""NVFP4 GPU kernels against the exact reference: bf16(e2m1 x e4m3) weights, fp32/fp64 sums,
global scale on the output. Needs an sm_90 GPU; skipped elsewhere (CI has none).

Outputs and the split-K workspace are filled with NaN before each run, so an element the kernel
does not write fails. Tolerance: every element within bf16 rounding of the exact value
(|y - ref| <= 2^-8 |ref| + 1e-4 max|ref|, the last term for fp32 summation order) and the
norm-relative error under 3e-3.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import nvfp4_gemm as gemm
from engine.kernels import nvfp4_layout as layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 (Hopper) GPU",
    ),
]

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
QWEN = {  # (N, K): fused qkv, o, fused gate_up, down
    "7b": [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
    "14b": [(7168, 5120), (5120, 5120), (27648, 5120), (5120, 13824)],
    "32b": [(7168, 5120), (5120, 5120), (55296, 5120), (5120, 27648)],
}
ODD = [(16, 16), (40, 48), (1000, 1008), (72, 4112), (4100, 336), (136, 2000)]
MS = (1, 2, 3, 7, 16, 33, 64, 127, 128, 256, 300, 512, 1000, 4096)


def quantize(w: torch.Tensor):
    """A plain NVFP4 quantizer (nearest e2m1, e4m3 block scales, global scale 448*6/amax)."""
    n, k = w.shape
    gscale = (448.0 * 6.0 / w.abs().max()).reshape(1).float()
    blocks = w.float().view(n, k // 16, 16)
    scale = (gscale * blocks.abs().amax(-1) / 6.0).clamp(max=448.0).to(torch.float8_e4m3fn)
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, blocks * gscale / torch.where(s > 0, s, 1.0), torch.zeros_like(blocks))
    table = E2M1.to(w.device)
    idx = (q.abs().unsqueeze(-1) - table).abs().argmin(-1)
    codes = (idx | ((q < 0).long() << 3)).view(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale, gscale


def make_layer(n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * (1 + torch.rand(n, 1, device="cuda", generator=gen))
    packed, scale, gscale = quantize(w)
    wref = layout.reference_dequantize(packed, scale).float()  # exact bf16 values, no global scale
    return gemm.prepare_tensors(packed, scale, gscale), wref, gscale


def check(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert not torch.isnan(y).any(), f"{what}: unwritten (NaN) outputs"
    y = y.float()
    err = (y - ref).abs()
    bound = ref.abs() * 2.0**-8 + 1e-4 * ref.abs().max()
    worst = (err / bound).max().item()
    rel = ((y - ref).norm() / ref.norm()).item()
    assert worst <= 1.0 and rel < 3e-3, f"{what}: max err/bound {worst:.3f}, norm-relative {rel:.2e}"


def reference(x: torch.Tensor, wref: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return (x.float() @ wref.t()) / gscale
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def poisoned(m: int, p) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-filled output [m, N] and split-K workspace (large enough for any split count or
    stream-K grid)."""
    out = torch.full((m, p.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = torch.full(((p.kg + 1) * m * (p.ntiles + 8) * 16,), float("nan"), device="cuda")
    return out, ws


def checked_launch(p, x: torch.Tensor, ref: torch.Tensor, what: str, launch) -> torch.Tensor:
    """launch(out, workspace) into a NaN-poisoned output and workspace, checked against ref; the
    split-K tickets must be back at zero."""
    out, ws = poisoned(x.shape[0], p)
    launch(out, ws)
    check(out, ref, what)
    assert int(p.counters.abs().sum()) == 0, "split-K tickets must be reset"
    return out


def run_forward(p, x: torch.Tensor, route: str | None = None) -> torch.Tensor:
    """One path's forward (the op's own by default) with NaN-poisoned outputs, workspace, weights."""
    m = x.shape[0]
    route = route or gemm.kernel_path(m, p.n, p.k)
    if route == "small":
        out, ws = poisoned(m, p)
        return gemm.gemm_small_into(x, p, out, workspace=ws)
    if route == "wg":
        out, ws = poisoned(m, p)
        return gemm.gemm_wg_into(x, p, out, workspace=ws)
    w = gemm.dequant_into(p, torch.full((p.n, p.k), float("nan"), dtype=torch.bfloat16, device="cuda"))
    return gemm._scaled_mm(x, w.t(), p.alpha_value)


@pytest.mark.parametrize("n,k", ODD + [(4, 64)])
def test_dequant_is_exact(n, k):
    gen = torch.Generator().manual_seed(n + k)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.exp2(torch.empty(n, k // 16).uniform_(-9.5, 8.8, generator=gen)).to(torch.float8_e4m3fn)
    scale.view(torch.uint8)[0, 0] = 0  # zero block
    scale.view(torch.uint8)[-1, -1] = 0x02  # subnormal
    scale.view(torch.uint8)[n // 2, 0] = 0xB8  # -1.0
    packed, scale = packed.cuda(), scale.cuda()
    p = gemm.prepare_tensors(packed, scale, torch.ones(1, device="cuda"))
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = gemm.dequant_into(p, out).float() * 2.0**layout.WEIGHT_EXP2
    assert torch.equal(got, layout.reference_dequantize(packed, scale).float())


@pytest.mark.parametrize("model", list(QWEN) + ["odd"])
def test_forward_sweep(model):
    shapes = QWEN[model] if model != "odd" else ODD
    for i, (n, k) in enumerate(shapes):
        p, wref, gscale = make_layer(n, k, seed=100 + i)
        for m in MS:
            if model != "odd" and n * k > 10**8 and m == 4096:
                m = 2048  # keeps the fp32 reference of the largest layers quick
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = reference(x, wref, gscale)
            check(run_forward(p, x), ref, f"{model} {n}x{k} M={m} kernel")
            check(gemm.nvfp4_matmul(x, p), ref, f"{model} {n}x{k} M={m} op")
            if gemm.kernel_path(m, n, k) != "wg" and m <= 1000:
                check(run_forward(p, x, "wg"), ref, f"{model} {n}x{k} M={m} wgmma kernel")


def test_row_tiles_store_through_shared_memory():
    """Launches of several row tiles (every block a whole column) store their outputs through shared
    memory where N and the row stride are multiples of 8, straight from the registers otherwise: both
    exact, with rows past M in the last tile, and nothing written outside the output's columns."""
    for n, k in ((1000, 1008), (4100, 336), (37888, 3584)):
        p, wref, gscale = make_layer(n, k, seed=n)
        for m in (300, 513, 1000):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = reference(x, wref, gscale)
            for bn in (128, 256):
                assert gemm.wg_config(m, p, x.device, bn, 3).blocks == gemm._wg_columns(p, 3)
                out, ws = poisoned(m, p)
                check(gemm.gemm_wg_into(x, p, out, bn=bn, wg=3, workspace=ws), ref, f"{n}x{k} M={m} n{bn}")
                wide = torch.full((m, n + 3), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemm.gemm_wg_into(x, p, wide[:, :n], bn=bn, wg=3)  # row stride n + 3: the register stores
                check(wide[:, :n], ref, f"{n}x{k} M={m} n{bn}, row stride {n + 3}")
                assert wide[:, n:].isnan().all()


def test_stream_k_across_row_tiles():
    """Several row tiles of the warp-specialized kernel in one run of stream K (their columns laid end
    to end, a block's run crossing from one row tile into the next, partial sums of min(M, 256) x 128
    floats a slot): within bf16 rounding of the exact product for any block count, rows past M in
    the last tile, the tickets back at zero; and the same bits whatever the launch for whole columns."""
    for n, k in ((1000, 1008), (4100, 336), (5120, 13824)):
        p, wref, gscale = make_layer(n, k, seed=n + 1)
        columns = gemm._wg_columns(p, 3)
        for m in (300, 513, 1000):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = reference(x, wref, gscale)
            for bn in (128, 256):
                tiles = -(-m // bn)
                for blocks in (1, 7, 132, columns * tiles - 1, columns * tiles * 3):
                    blocks = min(blocks, columns * tiles * p.kg)
                    if blocks == columns:
                        continue
                    cfg = gemm.wg_config(m, p, x.device, bn, 3, blocks)
                    assert cfg.shared and cfg.blocks == blocks
                    ws = torch.full((gemm.wg_workspace(m, cfg, p.kg),), float("nan"), device="cuda")
                    checked_launch(p, x, ref, f"{n}x{k} M={m} n{bn} {blocks} blocks",
                                   lambda out, _: gemm.gemm_wg_into(x, p, out, bn=bn, wg=3, blocks=blocks,
                                                                    workspace=ws))


@pytest.mark.parametrize("tnw", [1, 2, 4])
@pytest.mark.parametrize("splits", [1, 3, 1000])
def test_every_kernel_variant(tnw, splits):
    p, wref, gscale = make_layer(1000, 1008, seed=7)
    for m in (1, 9, 17, 40, 70, 128):
        mt = gemm._m_tiles(m)
        if (mt, tnw) not in {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4),
                             (8, 1), (8, 2), (16, 1)}:
            continue
        x = torch.randn(m, p.k, device="cuda").bfloat16()
        checked_launch(p, x, reference(x, wref, gscale), f"M={m} tnw={tnw} splits={splits}",
                       lambda out, ws: gemm.gemm_small_into(x, p, out, tnw=tnw, splits=splits, workspace=ws))


@pytest.mark.parametrize("wpt", [2, 4, 8])
@pytest.mark.parametrize("tnw", [1, 2, 4])
def test_in_block_k_slices(wpt, tnw):
    """Warps sharing a weight tile's K range inside a block (summed in shared memory), alone and
    with split K across blocks: within bf16 rounding of the exact product, and the same bits
    whatever the split (fixed summation order given the slices)."""
    p, wref, gscale = make_layer(1000, 4080, seed=12)  # 16 groups, the last one partial
    for m in (1, 5, 16):
        x = torch.randn(m, p.k, device="cuda").bfloat16()
        ref = reference(x, wref, gscale)
        for splits in (1, 2, 1000):
            def launch(out, ws):
                return gemm.gemm_small_into(x, p, out, tnw=tnw, splits=splits, wpt=wpt, workspace=ws)

            out = checked_launch(p, x, ref, f"M={m} tnw={tnw} wpt={wpt} splits={splits}", launch)
            assert torch.equal(launch(*poisoned(m, p)), out)


@pytest.mark.parametrize("n,k", [(1000, 1008), (136, 2000)])  # the second leaves a warpgroup idle
@pytest.mark.parametrize("bn,wg", sorted(gemm._WG_VARIANTS))
def test_every_wgmma_variant(n, k, bn, wg):
    """Whole columns and columns shared by stream K (one block; fewer blocks than columns; a
    column cut unevenly; one group per block), beside the automatic grid; the warp-specialized
    kernel with its activations staged and, below 128 rows per block, copied by itself."""
    p, wref, gscale = make_layer(n, k, seed=11)
    copies = (False, True) if wg == 3 and bn in gemm.WS_DIRECT_BN else (False,)
    for m in sorted({max(1, bn - 13), bn, bn + 5}):
        x = torch.randn(m, p.k, device="cuda").bfloat16()
        ref = reference(x, wref, gscale)
        cfg = gemm.wg_config(m, p, x.device, bn, wg)
        units = cfg.columns * p.kg
        grids = {None} if m > bn else {None, 1, cfg.columns, max(1, cfg.columns - 1), 2 * cfg.columns + 1,
                                        (7 * cfg.columns) // 3, units}
        for blocks in grids:
            for direct in copies:
                checked_launch(p, x, ref, f"{n}x{k} M={m} bn={bn} wg={wg} blocks={blocks} direct={direct}",
                               lambda out, ws: gemm.gemm_wg_into(x, p, out, bn=bn, wg=wg, blocks=blocks,
                                                                 workspace=ws, direct=direct))


def test_warp_specialized_copies_on_short_runs():
    """The warp-specialized kernel copies the activations itself where a block's K groups times its
    rows are few (7B q/k/v at 64 rows), stages them where they are many (7B gate_up), and the two
    give the same bits."""
    dev = torch.device("cuda")
    qkv, _, _ = make_layer(4608, 3584, seed=14)
    gate_up, _, _ = make_layer(37888, 3584, seed=15)
    assert gemm.wg_config(64, qkv, dev).direct and not gemm.wg_config(64, gate_up, dev).direct
    assert not gemm.wg_config(128, qkv, dev).direct  # 128-row blocks always take the staged images
    for m in (40, 64):
        x = torch.randn(m, qkv.k, device="cuda").bfloat16()
        outs = [gemm.gemm_wg_into(x, qkv, poisoned(m, qkv)[0], wg=3, direct=d) for d in (False, True)]
        assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="copies the activations itself"):
        gemm.wg_config(64, gate_up, dev, wg=4, direct=True)


@pytest.mark.parametrize("m", [16, 64, 128])
def test_stream_k_is_deterministic_and_exact(m):
    """A layer whose columns the automatic grid shares between blocks: the same bits call after
    call, within bf16 rounding of the exact product, tickets back at zero."""
    p, wref, gscale = make_layer(3584, 18944, seed=13)
    x = torch.randn(m, p.k, device="cuda").bfloat16()
    cfg = gemm.wg_config(m, p, x.device)
    assert cfg.shared
    first = checked_launch(p, x, reference(x, wref, gscale), f"M={m} {cfg}",
                           lambda out, ws: gemm.gemm_wg_into(x, p, out, workspace=ws))
    for _ in range(3):
        assert torch.equal(gemm.gemm_wg_into(x, p, torch.empty_like(first)), first)


@pytest.mark.parametrize("bn,wg", [(bn, 3) for bn in gemm.WS_BN] + [(bn, 4) for bn in gemm.WS2_BN])
def test_stream_k_run_orders(bn, wg):
    """The warp-specialized kernel on runs of about a third of a column, 2.2 and 3.4 columns a block
    (the run orders and the producer's helpers of WsRun in nvfp4_gemm.cu: a run's last column's head
    first, shared sums added beside the compute warps): within bf16 rounding of the exact product
    with poisoned outputs and workspace, the same bits call after call, tickets back at zero."""
    p, wref, gscale = make_layer(4608, 1024, seed=16)
    for m in sorted({17, bn // 2 + 1, bn}):
        x = torch.randn(m, p.k, device="cuda").bfloat16()
        ref = reference(x, wref, gscale)
        columns = gemm.wg_config(m, p, x.device, bn, wg).columns
        for blocks in (round(columns / 0.35), round(columns / 2.2), round(columns / 3.4)):
            cfg = gemm.wg_config(m, p, x.device, bn, wg, blocks)
            assert cfg.shared
            ws = torch.full((gemm.wg_workspace(m, cfg, p.kg),), float("nan"), device="cuda")

            def launch(out, _ws):
                return gemm.gemm_wg_into(x, p, out, bn=bn, wg=wg, blocks=blocks, workspace=ws)

            first = checked_launch(p, x, ref, f"M={m} {cfg}", launch)
            for _ in range(2):
                assert torch.equal(launch(poisoned(m, p)[0], None), first)


def test_narrow_layer_past_a_wave_takes_two_tiles_per_warp():
    """Above 8 rows a narrow layer gets one block per weight tile, or two tiles per warp where
    one block each would leave a partial wave of resident blocks; both exact."""
    dev = torch.device("cuda")
    for n, want in ((1024, 1), (16000, 2)):
        p, wref, gscale = make_layer(n, 1024, seed=n)
        for m in (9, 16):
            cfg = gemm.small_config(m, p, dev)
            assert (cfg.tnw, cfg.splits, cfg.wpt) == (want, 1, 8), f"{n} rows, M={m}: {cfg}"
            x = torch.randn(m, p.k, device="cuda").bfloat16()
            check(run_forward(p, x, "small"), reference(x, wref, gscale), f"{n}x1024 M={m} {cfg}")


def test_layer_near_one_wave_takes_whole_columns():
    """With two warpgroups (wg = 2), from 128-row blocks a layer whose columns fill most of one
    wave gets one block per column (no shared columns), and at 193-256 rows two row tiles of 128;
    all exact."""
    dev = torch.device("cuda")
    wave = gemm._wg_occupancy(128, 2) * gemm.sm_count(dev)
    p, wref, gscale = make_layer(round(0.9 * wave) * 128, 512, seed=21)
    for m in (128, 200, 256):
        cfg = gemm.wg_config(m, p, dev, wg=2)
        assert cfg.bn == 128 and not cfg.shared, f"M={m}: {cfg}"
        x = torch.randn(m, p.k, device="cuda").bfloat16()
        checked_launch(p, x, reference(x, wref, gscale), f"M={m} {cfg}",
                       lambda out, ws: gemm.gemm_wg_into(x, p, out, wg=2, workspace=ws))
    small, _, _ = make_layer(36 * 128, 512, seed=22)  # few columns: stream K, one 256-row tile
    assert gemm.wg_config(256, small, dev, wg=2)[:2] == (256, 2) and gemm.wg_config(128, small, dev, wg=2).shared


def test_wgmma_rows_past_int32_offsets():
    """Enough rows that activation offsets pass 2^31 elements (the permuted copy's addressing):
    the first and last rows within bf16 rounding of the exact product, every output written."""
    k = 27648
    m = 2**31 // k + 300
    if torch.cuda.get_device_properties(0).total_memory < 32 * 2**30:
        pytest.skip("needs 32 GB of GPU memory")
    p, wref, gscale = make_layer(128, k, seed=17)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert gemm.wg_config(m, p, x.device).bn >= gemm.wg_permuted_rows()
    out = torch.full((m, p.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm.gemm_wg_into(x, p, out)
    rows = torch.cat([torch.arange(0, 64), torch.arange(m - 2000, m)]).cuda()
    check(out[rows], reference(x[rows], wref, gscale), f"M={m} K={k}")
    assert not torch.isnan(out).any(), "unwritten (NaN) outputs"


@pytest.mark.parametrize("m", [16, 64])
def test_split_k_is_deterministic(m):
    p, _, _ = make_layer(5120, 13824, seed=8)
    x = torch.randn(m, p.k, device="cuda").bfloat16()
    first = gemm.nvfp4_matmul(x, p)
    for _ in range(5):
        assert torch.equal(gemm.nvfp4_matmul(x, p), first)


@pytest.mark.parametrize("n,k", [(7168, 5120), (1000, 1008)])
def test_backward(n, k):
    p, wref, gscale = make_layer(n, k, seed=9)
    for m in (1, 7, 128, 1000, 4096):
        dy = torch.randn(m, n, device="cuda").bfloat16()
        ref = (dy.float() @ wref) / gscale
        check(gemm.nvfp4_matmul_t(dy, p), ref, f"backward {n}x{k} M={m}")


def test_autograd_through_frozen_linear():
    from engine.quant.base import FrozenLinear

    class Layer(FrozenLinear):
        def __init__(self, packed, scale, gscale):
            super().__init__(2 * packed.shape[1], packed.shape[0], None)
            self.register_buffer("weight_packed", packed)
            self.register_buffer("weight_scale", scale)
            self.register_buffer("weight_global_scale", gscale)

        def _matmul(self, x):
            return gemm.nvfp4_matmul(x, gemm.prepare(self))

        def _matmul_t(self, dy):
            return gemm.nvfp4_matmul_t(dy, gemm.prepare(self))

    w = torch.randn(512, 768, device="cuda")
    layer = Layer(*quantize(w))
    wref = layout.reference_dequantize(layer.weight_packed, layer.weight_scale).float()
    x = torch.randn(4, 33, 768, device="cuda").bfloat16().requires_grad_(True)
    y = layer(x)
    check(y, reference(x.detach().reshape(-1, 768), wref, layer.weight_global_scale).view(4, 33, 512), "autograd y")
    dy = torch.randn_like(y)
    y.backward(dy)
    check(x.grad, (dy.float() @ wref) / layer.weight_global_scale, "autograd dx")


def test_cuda_graph_and_compile():
    p, wref, gscale = make_layer(7168, 5120, seed=10)
    for m in (1, 16, 64, 300, 1000):
        x = torch.randn(m, p.k, device="cuda").bfloat16()
        eager = gemm.nvfp4_matmul(x, p)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            gemm.nvfp4_matmul(x, p)  # warm up on the side stream
            with torch.cuda.graph(graph, stream=s):
                y = gemm.nvfp4_matmul(x, p)
        torch.cuda.current_stream().wait_stream(s)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        check(y, reference(x, wref, gscale), f"graph M={m}")
        assert not torch.equal(y, eager)
    f = torch.compile(lambda a: gemm.nvfp4_matmul(a, p) * 2, fullgraph=True)
    x = torch.randn(5, p.k, device="cuda").bfloat16()
    assert torch.equal(f(x), gemm.nvfp4_matmul(x, p) * 2)
