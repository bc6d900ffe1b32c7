"""The fused decode kernels (engine/rollout/fused_decode.cu) and programmatic dependent launch.

- The LoRA shrink (one launch, no memset) against a float64 torch product on fresh
  random data, every output written (NaN-poisoned before), the same bits on every run.
- A chain of dependent decode kernels (NVFP4 GEMMs of all three kinds, shrink, RoPE + cache,
  SDPA, expand, residual + RMSNorm, SiLU * up; buffers reused across layers, memcpy and
  cuBLAS in between) captured in a CUDA graph with PDL on: the same bits as with PDL off and as
  eager launches, and within bf16 tolerance of TorchOps over float GEMMs; the same with the
  shrinks inside the norm and SiLU kernels and the LoRA in the GEMM epilogues, as the engine runs.
- Those fused shrink kernels give the same bits as the kernels they replace; every shrink, with
  its K blocks merged in a cluster (QERL_SHRINK_CLUSTER=1), the same bits as with tickets, also
  in the captured chain above.
- The step's own kernels. The sampler: greedy tokens equal torch.argmax (ties to the first
  index), sampled tokens are the argmax of x / T - log q in float64 up to fp32 rounding, every
  log-prob equals float64 log_softmax(x / T) at the token, outputs poisoned before, the same bits
  on every call, tickets left zero, masked (-inf) logits never drawn, the drawn frequencies those
  of softmax, the same tokens as the torch sampler from the same generator state. The step's
  input gathers and output copy: the same values as the index ops, copy and increments they replace.
Needs an sm_90 GPU and nvcc; skipped elsewhere (CI has none).
"""
from __future__ import annotations

import pytest
import torch

from engine.rollout import sampler
from engine.rollout.attention import attention_mask, decode_attention
from engine.rollout.fused_ops import LoraTerm, TorchOps, cuda_ops, pick_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 (Hopper) GPU",
    ),
]


@pytest.fixture(scope="module")
def ops():
    o = pick_ops(torch.device("cuda"), torch.bfloat16, qk_norm=False, head_dim=128)
    if o.name != "cuda":
        pytest.skip("fused kernels need nvcc")
    return o


def _shrink_into(ops, x: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The kernel on NaN-poisoned partial sums; its tickets must be left zero."""
    from engine.rollout.fused_ops import SHRINK_BLOCK_INPUTS

    rows, k = x.shape
    kb = -(-k // SHRINK_BLOCK_INPUTS)
    ws = torch.full((kb * rows * a.shape[0],), float("nan"), device="cuda")
    tickets = ops._shrink_tickets(x.device, -(-rows // 8) * a.shape[0])
    err = ops.lib.qerl_lora_shrink(x.data_ptr(), x.stride(0), a.data_ptr(), out.data_ptr(), ws.data_ptr(),
                                   tickets.data_ptr(), a.shape[0], rows, k, torch.cuda.current_stream().cuda_stream)
    ops._check(err, "LoRA shrink")
    assert int(tickets.abs().sum()) == 0, "the shrink's tickets must be left zero"
    return out


@pytest.mark.parametrize("pdl", ["1", "0"])
def test_lora_shrink_against_float64(ops, pdl, monkeypatch):
    monkeypatch.setenv("QERL_PDL", pdl)
    g = torch.Generator("cuda").manual_seed(int(pdl))
    for k in (36, 1028, 3584, 4100, 5120, 18944, 27648, 139268):
        for rows in (1, 5, 8, 16, 64):
            for rtot in (16, 7, 48, 192):
                pad = 12 if rows % 2 else 0  # a strided x (row stride k + 12) for odd row counts
                xs = torch.randn(rows, k + pad, device="cuda", generator=g).bfloat16()[:, :k]
                a = torch.randn(rtot, k, device="cuda", generator=g) * 0.02
                out = torch.full((rows, rtot), float("nan"), device="cuda")
                got = _shrink_into(ops, xs, a, out)
                want = xs.double() @ a.double().t()
                what = f"rows={rows} k={k} rtot={rtot}"
                assert not torch.isnan(got).any(), f"{what}: unwritten outputs"
                err = (got.double() - want).abs().max().item()
                assert err <= 2e-6 * k**0.5 + 1e-6 * want.abs().max().item(), f"{what}: max abs err {err:.2e}"
                again = _shrink_into(ops, xs, a, torch.full_like(out, float("nan")))
                assert torch.equal(got, again), f"{what}: not deterministic"
    xs, a = torch.randn(3, 3584, device="cuda").bfloat16(), torch.randn(32, 3584, device="cuda")
    torch.testing.assert_close(ops.lora_shrink(xs, a).double(), xs.double() @ a.double().t(), atol=1e-4, rtol=1e-5)


# -- a decode chain with PDL ---------------------------------------------------------------------
HEADS, KVH, D, H, INTER, S, R = 8, 2, 128, 1024, 5120, 64, 16  # INTER > 4096: the shrink splits K


class _Chain:
    """Two decoder layers' worth of fused decode kernels on static buffers."""

    def __init__(self, b: int, seed: int) -> None:
        from tests.test_kernels_gpu import make_layer

        self.b = b
        g = torch.Generator("cuda").manual_seed(seed)

        def rnd(*s, scale=1.0):
            return torch.randn(*s, device="cuda", generator=g) * scale

        self.layers = []
        for i in range(2):
            layer = {}
            for j, (name, n, k, members) in enumerate((("qkv", (HEADS + 2 * KVH) * D, H, 3), ("o", H, HEADS * D, 1),
                                                       ("gu", 2 * INTER, H, 2), ("down", H, INTER, 1))):
                p, wref, gscale = make_layer(n, k, seed=1000 * seed + 10 * i + j)
                layer[name] = (p, (wref / gscale).t().contiguous())  # fp32 (k, n) for the reference
                layer[name + "_a"] = rnd(members * R, k, scale=0.02)
                layer[name + "_b"] = rnd(R, n, scale=0.05)
                layer[name + "_edges"] = {3: (HEADS * D, (HEADS + KVH) * D), 2: (INTER, 2**31 - 1),
                                          1: (2**31 - 1, 2**31 - 1)}[members]
            layer["qkv_bias"] = rnd((HEADS + 2 * KVH) * D).bfloat16()
            layer["w_in"], layer["w_post"] = rnd(H).abs() + 0.5, rnd(H).abs() + 0.5
            self.layers.append(layer)
        self.w_final = rnd(H).abs() + 0.5
        self.x_in = torch.empty(b, H, dtype=torch.bfloat16, device="cuda")
        self.x = torch.empty_like(self.x_in)
        ang = torch.rand(b, D // 2, device="cuda", generator=g) * 100
        self.cos = torch.cat((ang, ang), -1).cos().bfloat16()
        self.sin = torch.cat((ang, ang), -1).sin().bfloat16()
        self.col = S - 7
        self.slot = torch.tensor([self.col], device="cuda")
        self.kc = torch.empty(2, b, KVH, S, D, dtype=torch.bfloat16, device="cuda")
        self.vc = torch.empty_like(self.kc)
        self.valid = torch.zeros(b, S, dtype=torch.bool, device="cuda")
        self.valid[:, : S - 6] = True
        self.valid[0, 3] = False
        self.mask = attention_mask(self.valid, b, HEADS // KVH, S, torch.bfloat16)
        self.ws = torch.empty(64 * b * 6144, device="cuda")  # split-K workspace shared by every GEMM

    def fresh(self, seed: int) -> None:
        g = torch.Generator("cuda").manual_seed(seed)
        self.x_in.copy_(torch.randn(self.b, H, device="cuda", generator=g))
        self.kc.copy_(torch.randn(self.kc.shape, device="cuda", generator=g))
        self.vc.copy_(torch.randn(self.vc.shape, device="cuda", generator=g))

    def _lora(self, ops, layer, name, x):
        n1, n2 = layer[name + "_edges"]
        return LoraTerm(ops.lora_shrink(x, layer[name + "_a"]), layer[name + "_b"], R, n1, n2)

    def run(self, ops, kernels: bool, fused: bool = False) -> torch.Tensor:
        """The chain; ``kernels``: NVFP4 GEMMs (small, wgmma, dequantize + cuBLAS), else float GEMMs;
        ``fused``: the shrinks of qkv, gu and down inside the norm and SiLU kernels, as the engine."""
        if fused:
            return self._run_fused(ops, kernels)
        from engine.kernels import nvfp4_gemm as gemm

        def mm(h, layer, name, route):
            p, wt = layer[name]
            if not kernels:
                return (h.float() @ wt).bfloat16()
            out = torch.empty(h.shape[0], p.n, dtype=torch.bfloat16, device="cuda")
            if route == "small":
                return gemm.gemm_small_into(h, p, out, workspace=self.ws)
            if route == "wg":
                return gemm.gemm_wg_into(h, p, out, workspace=self.ws)
            w = gemm.dequant_into(p, torch.empty(p.n, p.k, dtype=torch.bfloat16, device="cuda"))
            return gemm._scaled_mm(h, w.t(), p.alpha_value)

        self.x.copy_(self.x_in)  # a memcpy before the first fused kernel
        x, h = ops.add_rmsnorm(self.x, None, None, None, self.layers[0]["w_in"], 1e-6)
        for i, L in enumerate(self.layers):
            q = ops.qkv_rope_cache(mm(h, L, "qkv", "small"), L["qkv_bias"], self._lora(ops, L, "qkv", h), self.cos,
                                   self.sin, self.kc[i], self.vc[i], self.slot, heads=HEADS, kv_heads=KVH, d=D)
            o = decode_attention(q, self.kc[i], self.vc[i], self.mask)
            x, h = ops.add_rmsnorm(x, mm(o, L, "o", "cublas"), None, self._lora(ops, L, "o", o), L["w_post"], 1e-6)
            a = ops.silu_mul(mm(h, L, "gu", "wg"), None, self._lora(ops, L, "gu", h))
            w_next = self.layers[i + 1]["w_in"] if i + 1 < len(self.layers) else self.w_final
            x, h = ops.add_rmsnorm(x, mm(a, L, "down", "small"), None, self._lora(ops, L, "down", a), w_next, 1e-6)
        return self._out(x, h)

    def _out(self, x, h):
        new_kv = [c[:, :, :, self.col].transpose(0, 1).reshape(self.b, -1) for c in (self.kc, self.vc)]
        return torch.cat([x, h, *new_kv], dim=-1)

    def _run_fused(self, ops, kernels: bool) -> torch.Tensor:
        from engine.kernels import nvfp4_gemm as gemm

        def mm(h, layer, name, lora=None):  # the small kernel, LoRA in its epilogue when given
            p, wt = layer[name]
            if not kernels:
                return (h.float() @ wt).bfloat16(), lora
            out = torch.empty(h.shape[0], p.n, dtype=torch.bfloat16, device="cuda")
            return gemm.gemm_small_into(h, p, out, workspace=self.ws, lora=lora), None

        def term(layer, name, s):
            return LoraTerm(s, layer[name + "_b"], R, *layer[name + "_edges"])

        self.x.copy_(self.x_in)
        L0 = self.layers[0]
        x, h, s_qkv = ops.add_rmsnorm_shrink(self.x, None, None, None, L0["w_in"], 1e-6, L0["qkv_a"])
        for i, L in enumerate(self.layers):
            y, _ = mm(h, L, "qkv")
            q = ops.qkv_rope_cache(y, L["qkv_bias"], term(L, "qkv", s_qkv), self.cos, self.sin, self.kc[i],
                                   self.vc[i], self.slot, heads=HEADS, kv_heads=KVH, d=D)
            o = decode_attention(q, self.kc[i], self.vc[i], self.mask)
            x, h, s_gu = ops.add_rmsnorm_shrink(x, *_split(mm(o, L, "o", self._lora(ops, L, "o", o))), L["w_post"],
                                                1e-6, L["gu_a"])
            a, s_down = ops.silu_mul_shrink(*_split(mm(h, L, "gu", term(L, "gu", s_gu))), L["down_a"])
            last = i + 1 == len(self.layers)
            w_next, a_next = (self.w_final, None) if last else (self.layers[i + 1]["w_in"], self.layers[i + 1]["qkv_a"])
            x, h, s_qkv = ops.add_rmsnorm_shrink(x, *_split(mm(a, L, "down", term(L, "down", s_down))), w_next, 1e-6,
                                                 a_next)
        return self._out(x, h)


def _split(y_lora):
    """(y, bias, lora) for an epilogue op from mm's (y, lora left to add)."""
    return y_lora[0], None, y_lora[1]


def _graph(chain: _Chain, ops, fused: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain.run(ops, True, fused)  # warm-up (cuBLAS handle, workspaces) outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            out = chain.run(ops, True, fused)
    torch.cuda.current_stream().wait_stream(side)
    return g, out


@pytest.mark.parametrize("fused", [False, True], ids=["shrinks", "fused-shrinks"])
@pytest.mark.parametrize("b", [1, 5, 11])
def test_pdl_chain_in_graph_equals_pdl_off_and_reference(ops, b, fused, monkeypatch):
    chain = _Chain(b, seed=b)
    monkeypatch.setenv("QERL_PDL", "1")
    g_on, out_on = _graph(chain, ops, fused)
    monkeypatch.setenv("QERL_SHRINK_CLUSTER", "1")  # the shrinks' K blocks (INTER > 4096) merged in a cluster
    g_cl, out_cl = _graph(chain, ops, fused)
    monkeypatch.setenv("QERL_SHRINK_CLUSTER", "0")
    monkeypatch.setenv("QERL_PDL", "0")
    g_off, out_off = _graph(chain, ops, fused)
    for trial in range(3):
        chain.fresh(100 * b + trial)
        ref = chain.run(TorchOps(), False, fused).float()
        chain.fresh(100 * b + trial)
        monkeypatch.setenv("QERL_PDL", "0")
        eager_off = chain.run(ops, True, fused).clone()
        chain.fresh(100 * b + trial)
        monkeypatch.setenv("QERL_PDL", "1")
        eager_on = chain.run(ops, True, fused).clone()
        chain.fresh(100 * b + trial)
        g_on.replay()
        got_on = out_on.clone()
        chain.fresh(100 * b + trial)
        g_cl.replay()
        got_cl = out_cl.clone()
        chain.fresh(100 * b + trial)
        g_off.replay()
        torch.cuda.synchronize()
        assert torch.equal(eager_on, eager_off), f"trial {trial}: eager PDL on != off"
        assert torch.equal(got_on, out_off), f"trial {trial}: graph PDL on != off"
        assert torch.equal(got_cl, got_on), f"trial {trial}: graph with the shrinks merged in clusters != tickets"
        # cuBLAS may pick another algorithm under capture: graph against eager within rounding
        diff = ((got_on.float() - eager_on.float()).norm() / eager_on.float().norm()).item()
        assert diff < 1e-2, f"trial {trial}: graph vs eager norm-relative difference {diff:.2e}"
        rel = ((got_on.float() - ref).norm() / ref.norm()).item()
        assert rel < 3e-2, f"trial {trial}: norm-relative error vs TorchOps + float GEMMs {rel:.2e}"


# -- the shrink inside the norm and SiLU kernels ---------------------------------------------------
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_fused_shrinks_equal_the_kernels_they_replace(ops, rows):
    """add_rmsnorm_shrink = add_rmsnorm then lora_shrink, silu_mul_shrink = silu_mul then
    lora_shrink: the same bits (outputs and s), x left as it was by the fused kernel, with and
    without a projection output, bias and LoRA term, one and several K blocks, fused with 1, 2, 4
    and 8 rank rows per block (silu * up at 27648 x 7 for rows 1, 3, 8, 13 on 132 SMs: see
    tests/test_rollout_cuda_graph.py's rule test) and not fused."""
    g = torch.Generator("cuda").manual_seed(rows)

    def rnd(*s, scale=1.0):
        return torch.randn(*s, device="cuda", generator=g) * scale

    for hdim, inter, rtot in ((1024, 2048, 16), (3584, 18944, 48), (5120, 27648, 7)):
        w = rnd(hdim).abs() + 0.5
        a_h, a_i = rnd(rtot, hdim, scale=0.02), rnd(rtot, inter, scale=0.02)
        for with_y, with_bias, with_lora in ((False, False, False), (True, False, False), (True, True, True)):
            what = f"rows={rows} hdim={hdim} y={with_y} bias={with_bias} lora={with_lora}"
            x = rnd(rows, hdim).bfloat16()
            y = rnd(rows, hdim).bfloat16() if with_y else None
            bias = rnd(hdim).bfloat16() if with_bias else None
            lora = LoraTerm(rnd(rows, 2 * 4), rnd(4, hdim, scale=0.1), 4, 100, 2**31 - 1) if with_lora else None
            x0 = x.clone()
            fused = ops._fused_ranks(rows, hdim, a_h) is not None  # else add_rmsnorm (x in place), lora_shrink
            got = ops.add_rmsnorm_shrink(x, y, bias, lora, w, 1e-6, a_h)
            assert not fused or torch.equal(x, x0), f"{what}: the fused kernel wrote x"
            xr, hr = ops.add_rmsnorm(x0.clone(), y, bias, lora, w, 1e-6)
            want = (xr, hr, ops.lora_shrink(hr, a_h))
            for name, u, v in zip(("x", "h", "s"), got, want):
                assert torch.equal(u, v), f"{what}: {name} differs"
            gu = rnd(rows, 2 * inter).bfloat16()
            bias2 = rnd(2 * inter).bfloat16() if with_bias else None
            lora2 = LoraTerm(rnd(rows, 8), rnd(4, 2 * inter, scale=0.1), 4, inter, 2**31 - 1) if with_lora else None
            out, s = ops.silu_mul_shrink(gu, bias2, lora2, a_i)
            ref = ops.silu_mul(gu, bias2, lora2)
            assert torch.equal(out, ref), f"{what}: silu * up differs"
            assert torch.equal(s, ops.lora_shrink(ref, a_i)), f"{what}: down shrink differs"
    x = rnd(2, 1024).bfloat16()
    assert ops.add_rmsnorm_shrink(x, None, None, None, w[:1024], 1e-6, None)[2] is None
    assert ops.silu_mul_shrink(rnd(2, 64).bfloat16(), None, None, None)[1] is None


# -- the shrinks' K blocks merged in a cluster ----------------------------------------------------
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_shrinks_merged_in_a_cluster_give_the_ticket_paths_bits(ops, rows, monkeypatch):
    """QERL_SHRINK_CLUSTER=1: the plain shrink and the shrinks inside the norm and SiLU kernels
    merge their 2..8 K blocks through distributed shared memory (9 and more: tickets, as without
    it): the same bits as the ticket path, outputs poisoned before, tickets left zero, PDL on and
    off."""
    from engine.rollout.fused_ops import SHRINK_BLOCK_INPUTS

    g = torch.Generator("cuda").manual_seed(1000 + rows)
    for pdl in ("1", "0"):
        monkeypatch.setenv("QERL_PDL", pdl)
        for k in (5120, 18944, 27648, 29568, 8 * SHRINK_BLOCK_INPUTS, 36864):  # 2, 5, 7, 8, 8 and 9 K blocks
            x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
            a = torch.randn(48, k, device="cuda", generator=g) * 0.02
            gu = torch.randn(rows, 2 * k, device="cuda", generator=g).bfloat16()
            got = {}
            for cluster in ("0", "1"):
                monkeypatch.setenv("QERL_SHRINK_CLUSTER", cluster)
                plain = _shrink_into(ops, x, a, torch.full((rows, 48), float("nan"), device="cuda"))
                silu = ops.silu_mul_shrink(gu, None, None, a)
                got[cluster] = (plain, *silu)
            what = f"pdl={pdl} rows={rows} k={k}"
            assert not torch.isnan(got["1"][0]).any(), f"{what}: unwritten outputs"
            for name, u, v in zip(("plain shrink", "silu * up", "down shrink"), got["1"], got["0"]):
                assert torch.equal(u, v), f"{what}: {name} differs from the ticket path"
        for hdim in (5120, 8192):  # the norm's shrink: 2 K blocks
            x = torch.randn(rows, hdim, device="cuda", generator=g).bfloat16()
            y = torch.randn(rows, hdim, device="cuda", generator=g).bfloat16()
            w = torch.rand(hdim, device="cuda", generator=g) + 0.5
            a = torch.randn(32, hdim, device="cuda", generator=g) * 0.02
            got = {}
            for cluster in ("0", "1"):
                monkeypatch.setenv("QERL_SHRINK_CLUSTER", cluster)
                got[cluster] = ops.add_rmsnorm_shrink(x.clone(), y, None, None, w, 1e-6, a)
            for name, u, v in zip(("x", "h", "s"), got["1"], got["0"]):
                assert torch.equal(u, v), f"pdl={pdl} rows={rows} hdim={hdim}: {name} differs from the ticket path"


# -- bias + LoRA in the NVFP4 GEMM's epilogue ------------------------------------------------------
@pytest.mark.parametrize("n,k", [(1024, 1024), (3584, 18944), (1000, 1008), (20480, 1024), (16000, 1024)])
def test_gemm_epilogue_equals_gemm_then_expand(ops, n, k):
    """gemm_small_into(bias=, lora=) = the GEMM, then CudaOps' expand kernel (same bits), and
    TorchOps' epilogue over a float64 product within bf16 rounding; both output writers (split K
    or not), one and two LoRA members, narrow layers (the last with two tiles per warp at 16
    rows) and a wide one (gate/up's launch shapes)."""
    from engine.kernels import nvfp4_gemm as gemm
    from engine.rollout.fused_ops import apply_epilogue
    from tests.test_kernels_gpu import make_layer

    p, wref, gscale = make_layer(n, k, seed=n + k)
    g = torch.Generator("cuda").manual_seed(k)
    r = 16
    for m in (1, 3, 8, 16):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        exact = ((x.double() @ wref.double().t()) / gscale.double()).bfloat16()  # the product, rounded once
        for members in (1, 2):
            edges = (n // 2, 2**31 - 1) if members == 2 else (2**31 - 1, 2**31 - 1)
            lora = LoraTerm(torch.randn(m, members * r, device="cuda", generator=g),
                            torch.randn(r, n, device="cuda", generator=g) * 0.05, r, *edges)
            for bias in (None, torch.randn(n, device="cuda", generator=g).bfloat16()):
                for splits in (1, None):
                    ws = torch.full((p.kg * m * p.ntiles * 16,), float("nan"), device="cuda")
                    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    got = gemm.gemm_small_into(x, p, out, splits=splits, workspace=ws, bias=bias, lora=lora)
                    what = f"{n}x{k} M={m} members={members} bias={bias is not None} splits={splits}"
                    assert not torch.isnan(got).any(), f"{what}: unwritten outputs"
                    y = gemm.gemm_small_into(x, p, torch.empty_like(out), splits=splits, workspace=ws)
                    expand = torch.empty_like(out)
                    ops._check(ops.lib.qerl_lora_expand(y.data_ptr(), None if bias is None else bias.data_ptr(),
                                                        *ops._lora(lora), expand.data_ptr(), m, n, n,
                                                        torch.cuda.current_stream().cuda_stream), "expand")
                    assert torch.equal(got, expand), f"{what}: differs from GEMM + expand kernel"
                    ref = apply_epilogue(exact, bias, lora).float()
                    err = (got.float() - ref).abs()
                    bound = (ref.abs() + exact.float().abs()) * 2.0**-7 + 1e-4 * ref.abs().max()  # ulps of both
                    assert (err <= bound).all(), f"{what}: max err/bound {(err / bound).max().item():.2f}"
                    assert int(p.counters.abs().sum()) == 0, "split-K tickets must be reset"
    assert gemm.matmul_epilogue(torch.randn(64, k, device="cuda").bfloat16(), p, None, None) is None  # not small-M
    want = gemm.gemm_small_into(x, p, torch.empty(x.shape[0], n, dtype=torch.bfloat16, device="cuda"), bias=bias,
                                lora=lora)
    assert torch.equal(gemm.matmul_epilogue(x, p, bias, lora), want)


# -- residual add + RMSNorm inside the NVFP4 GEMMs (residual and norm modes) ------------------------
@pytest.mark.parametrize("n,k", [(1024, 1024), (3584, 3584), (1008, 1024)])
def test_gemm_residual_then_norm_modes(ops, n, k):
    """A residual-mode launch leaves x + its epilogue's output in x and bf16(x * w) beside it (the
    same bits as the plain launch plus a bf16 add and multiply); a norm-mode launch of the next
    layer on that gives float64's RMSNorm-then-GEMM within bf16 rounding, its row factors and LoRA
    shrink (computed by the launch's own task blocks) float64's; both output writers (split K or
    not), with and without LoRA and bias, fresh random data, NaN-poisoned outputs."""
    from engine.kernels import nvfp4_gemm as gemm
    from engine.rollout.fused_ops import apply_epilogue
    from tests.test_kernels_gpu import make_layer

    p, _, _ = make_layer(n, k, seed=n + k)  # the producer: K inputs -> N = the hidden size
    q, wref, gscale = make_layer(2 * n, n, seed=n)  # the consumer: N -> 2N
    g = torch.Generator("cuda").manual_seed(n + 1)
    r, eps = 16, 1e-6
    w = torch.rand(n, device="cuda", generator=g) + 0.5
    for m in (1, 3, 8, 16):
        x2 = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        x = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        for splits in (1, None):
            what = f"{n}x{k} M={m} splits={splits}"
            ws = torch.full((max(p.kg, q.kg) * m * max(p.ntiles, q.ntiles) * 16,), float("nan"), device="cuda")
            bias = torch.randn(n, device="cuda", generator=g).bfloat16()
            lora = LoraTerm(torch.randn(m, r, device="cuda", generator=g),
                            torch.randn(r, n, device="cuda", generator=g) * 0.05, r, 2**31 - 1, 2**31 - 1)
            y = gemm.gemm_small_into(x2, p, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"), splits=splits,
                                     workspace=ws, bias=bias, lora=lora)
            xr, hw = x.clone(), torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm.gemm_small_into(x2, p, xr, splits=splits, workspace=ws, bias=bias, lora=lora, residual=(hw, w))
            assert torch.equal(xr, (x.float() + y.float()).bfloat16()), f"{what}: residual"
            assert torch.equal(hw, (xr.float() * w).bfloat16()), f"{what}: x * w"

            x64 = xr.double()
            r64 = torch.rsqrt(x64.pow(2).mean(-1) + eps)  # (M,)
            for with_lora in (False, True):
                for qbias in (None, torch.randn(2 * n, device="cuda", generator=g).bfloat16()):
                    a = torch.randn(2 * r, n, device="cuda", generator=g) * 0.02 if with_lora else None
                    s = torch.full((m, 2 * r), float("nan"), device="cuda") if with_lora else None
                    rr = torch.full((m,), float("nan"), device="cuda")
                    sync = torch.zeros(1, dtype=torch.int32, device="cuda")
                    term = LoraTerm(s, torch.randn(r, 2 * n, device="cuda", generator=g) * 0.05, r, n,
                                    2**31 - 1) if with_lora else None
                    out = torch.full((m, 2 * n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    got = gemm.gemm_small_into(hw, q, out, splits=splits, workspace=ws, bias=qbias, lora=term,
                                               norm=gemm.RowNorm(xr, a, s, rr, sync, eps))
                    tag = f"{what} lora={with_lora} bias={qbias is not None}"
                    assert not torch.isnan(got).any(), f"{tag}: unwritten outputs"
                    torch.testing.assert_close(rr.double(), r64, rtol=1e-5, atol=0, msg=f"{tag}: row factors")
                    h64 = hw.double() * r64[:, None]  # the normed rows as the kernel sees them (x * w rounded)
                    s64 = None
                    if with_lora:
                        s64 = h64 @ a.double().t()
                        torch.testing.assert_close(s.double(), s64, rtol=1e-4, atol=1e-5 * s64.abs().max().item(),
                                                   msg=f"{tag}: shrink")
                    exact = ((h64 @ wref.double().t()) / gscale.double()).bfloat16()
                    ref_term = None if s64 is None else LoraTerm(s64.float(), term.b, r, n, 2**31 - 1)
                    ref = apply_epilogue(exact, qbias, ref_term).float()
                    err = (got.float() - ref).abs()
                    bound = (ref.abs() + exact.float().abs()) * 2.0**-7 + 1e-4 * ref.abs().max()
                    assert (err <= bound).all(), f"{tag}: max err/bound {(err / bound).max().item():.2f}"
                    # against the RMSNorm of x in float64 (no rounding of x * w): bf16 tolerance
                    true = (x64 * r64[:, None] * w.double()) @ wref.double().t() / gscale.double()
                    if qbias is None and not with_lora:
                        torch.testing.assert_close(got.double(), true, rtol=2e-2, atol=2e-2 * true.abs().max().item())
                    assert int(sync[0]) == (2 * r if with_lora else 1), f"{tag}: tasks"
                    assert int(q.counters.abs().sum()) == 0 and int(p.counters.abs().sum()) == 0, "split-K tickets"
                    again = torch.full_like(out, float("nan"))
                    sync.zero_()
                    gemm.gemm_small_into(hw, q, again, splits=splits, workspace=ws, bias=qbias, lora=term,
                                         norm=gemm.RowNorm(xr, a, s, rr, sync, eps))
                    assert torch.equal(again, got), f"{tag}: not deterministic"


# -- o's LoRA shrink by tasks of its own GEMM launch ------------------------------------------------
@pytest.mark.parametrize("n,k", [(1024, 1024), (3584, 3584), (5120, 5120)])
def test_gemm_shrink_tasks(ops, n, k):
    """shrink_tasks: the launch's tasks compute s = x @ a^T (float64's within fp32 summation order)
    and its epilogue adds the LoRA delta from it: the same bits as the launch given that s, and
    float64's product + bias + delta within bf16 rounding; in plain and residual mode, both output
    writers (split K or not), two members, fresh random data, NaN-poisoned outputs."""
    from engine.kernels import nvfp4_gemm as gemm
    from engine.rollout.fused_ops import apply_epilogue
    from tests.test_kernels_gpu import make_layer

    p, wref, gscale = make_layer(n, k, seed=3 * n + k)
    g = torch.Generator("cuda").manual_seed(n + 7)
    r = 16
    a = torch.randn(2 * r, k, device="cuda", generator=g) * 0.02
    b = torch.randn(r, n, device="cuda", generator=g) * 0.05
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    w = torch.rand(n, device="cuda", generator=g) + 0.5
    for m in (1, 5, 8, 16):
        x2 = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        s64 = x2.double() @ a.double().t()
        for splits in (1, None):
            what = f"{n}x{k} M={m} splits={splits}"
            ws = torch.full((p.kg * m * p.ntiles * 16,), float("nan"), device="cuda")
            sync = torch.zeros(1, dtype=torch.int32, device="cuda")
            tasks = gemm.shrink_tasks(m, a, sync)
            tasks.s.fill_(float("nan"))
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            got = gemm.gemm_small_into(x2, p, out, splits=splits, workspace=ws, bias=bias,
                                       lora=LoraTerm(tasks.s, b, r, n // 2, 2**31 - 1), norm=tasks)
            assert not torch.isnan(got).any(), f"{what}: unwritten outputs"
            assert int(sync[0]) == 2 * r, f"{what}: tasks"
            torch.testing.assert_close(tasks.s.double(), s64, rtol=1e-4, atol=1e-5 * s64.abs().max().item(),
                                       msg=f"{what}: shrink")
            given = LoraTerm(tasks.s.clone(), b, r, n // 2, 2**31 - 1)
            want = gemm.gemm_small_into(x2, p, torch.empty_like(out), splits=splits, workspace=ws, bias=bias,
                                        lora=given)
            assert torch.equal(got, want), f"{what}: differs from the launch given s"
            exact = ((x2.double() @ wref.double().t()) / gscale.double()).bfloat16()
            ref = apply_epilogue(exact, bias, LoraTerm(s64.float(), b, r, n // 2, 2**31 - 1)).float()
            err = (got.float() - ref).abs()
            bound = (ref.abs() + exact.float().abs()) * 2.0**-7 + 1e-4 * ref.abs().max()
            assert (err <= bound).all(), f"{what}: max err/bound {(err / bound).max().item():.2f}"
            if splits is None:  # residual mode with the tasks (its own launch rule): x += the same output
                x = torch.randn(m, n, device="cuda", generator=g).bfloat16()
                sync.zero_()
                xr = x.clone()
                hw = gemm.matmul_residual(x2, p, bias, LoraTerm(tasks.s, b, r, n // 2, 2**31 - 1), xr, w, norm=tasks)
                assert torch.equal(xr, (x.float() + want.float()).bfloat16()), f"{what}: residual"
                assert torch.equal(hw, (xr.float() * w).bfloat16()), f"{what}: x * w"
            assert int(p.counters.abs().sum()) == 0, "split-K tickets must be reset"
    with pytest.raises(ValueError, match="norm mode"):
        gemm.gemm_small_into(x2, p, out, norm=gemm.RowNorm(None, None, None, tasks.r, sync, 0.0))


def _sample(ops, x, q, t):
    """The kernel with NaN-poisoned outputs and a poisoned token buffer; tickets left zero."""
    into = torch.full((x.shape[0] + 2,), -7, dtype=torch.long, device="cuda")
    tok, lp = ops.sample(x, q, t, into)
    assert torch.equal(into[:x.shape[0]], tok) and (into[x.shape[0]:] == -7).all()
    assert int(ops._shrink_tickets(x.device, x.shape[0]).abs().sum()) == 0, "tickets must be left zero"
    return tok, lp


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("vocab", [5, 1000, 1024, 1025, 152064])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sampler_against_float64(ops, rows, vocab, temperature):
    g = torch.Generator("cuda").manual_seed(rows * 7919 + vocab)
    x = torch.randn(rows, vocab + 3, device="cuda", generator=g)[:, :vocab] * 4  # a row stride past the width
    if vocab > 8:
        x[:, 3] = float("-inf")  # a masked token
    q = None if temperature == 0 else torch.empty(rows, vocab, device="cuda").exponential_(generator=g)
    t = temperature if temperature > 0 else 1.0
    tok, lp = _sample(ops, x, q, t)
    tok2, lp2 = _sample(ops, x, q, t)
    assert torch.equal(tok, tok2) and torch.equal(lp, lp2), "the same bits on every call"
    s = x.double() / t
    if q is None:
        assert torch.equal(tok, x.argmax(dim=-1))
    else:
        v = s - q.double().log()
        best = v.max(dim=-1).values
        got = v.gather(-1, tok[:, None]).squeeze(-1)
        assert (got >= best - 1e-5 * (1 + best.abs())).all(), "the drawn token is the argmax up to fp32 rounding"
    assert (tok != 3).all() or vocab <= 8
    want = torch.log_softmax(s, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), want, atol=2e-5, rtol=0)


def test_sampler_ties_go_to_the_first_index(ops):
    x = torch.zeros(2, 3000, device="cuda")
    x[0, [17, 1500, 2999]] = 5.0
    x[1, [2048, 2049]] = 1.0
    tok, lp = _sample(ops, x, None, 1.0)
    assert tok.tolist() == [17, 2048]
    torch.testing.assert_close(lp.double(), torch.log_softmax(x.double(), -1)[[0, 1], [17, 2048]], atol=1e-6, rtol=0)


def test_sampler_frequencies_and_sample_next_dispatch(monkeypatch):
    if cuda_ops(torch.device("cuda")) is None:
        pytest.skip("fused kernels need nvcc")
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0]], device="cuda").repeat(20000, 1)
    probs = torch.softmax(logits[0] / 1.3, -1).cpu()
    gen = torch.Generator("cuda").manual_seed(0)
    tok, lp = sampler.sample_next(logits, temperature=1.3, top_p=1.0, top_k=0, generator=gen)
    freq = torch.bincount(tok.cpu(), minlength=5).double() / len(tok)
    assert (freq - probs.double()).abs().max() < 0.015, (freq, probs)
    torch.testing.assert_close(lp.cpu(), torch.log(probs)[tok.cpu()], atol=1e-5, rtol=0)
    # the same generator state gives the same draws on both paths: tokens equal but for near-ties
    x = torch.randn(8, 50000, device="cuda")
    a = sampler.sample_next(x, temperature=0.9, top_p=1.0, top_k=0, generator=torch.Generator("cuda").manual_seed(5))
    monkeypatch.setattr(sampler, "FUSED", False)
    b = sampler.sample_next(x, temperature=0.9, top_p=1.0, top_k=0, generator=torch.Generator("cuda").manual_seed(5))
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [1, 5])
def test_step_inputs_and_outputs_equal_the_torch_ops(ops, rows):
    g = torch.Generator("cuda").manual_seed(rows)
    vocab, h, d, max_len = 1000, 896, 64, 300
    embed = torch.randn(vocab, h, device="cuda", generator=g).bfloat16()
    cos_t, sin_t = (torch.randn(max_len, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    tok = torch.randint(0, vocab, (rows + 1,), device="cuda", generator=g)
    pos = torch.randint(0, max_len, (rows + 1,), device="cuda", generator=g)
    slot = torch.tensor([123], device="cuda")
    valid = torch.rand(rows + 1, max_len, device="cuda", generator=g) < 0.5
    want_valid = valid.clone()
    want_valid[:rows].index_fill_(1, slot, True)
    x, cos, sin = ops.step_inputs(tok[:rows], pos[:rows], slot, embed, cos_t, sin_t, valid[:rows])
    assert torch.equal(x, embed[tok[:rows]]) and torch.equal(valid, want_valid)
    assert torch.equal(cos, cos_t[pos[:rows]]) and torch.equal(sin, sin_t[pos[:rows]])
    y = torch.randn(rows, vocab, device="cuda", generator=g).bfloat16()
    out = torch.full((rows + 1, vocab), float("nan"), device="cuda")
    p0, s0 = pos.clone(), slot.clone()
    ops.step_outputs(y, out, pos, slot)
    assert torch.equal(out[:rows], y.float()) and out[rows:].isnan().all()
    assert torch.equal(pos[:rows], p0[:rows] + 1) and torch.equal(pos[rows:], p0[rows:]) and int(slot) == int(s0) + 1
