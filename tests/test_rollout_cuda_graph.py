"""The graph decode engine (engine.rollout.cuda_graph) against the eager sampler.

CPU: the same engine code runs eagerly (torch ops, fused dense projections) and must give the
eager sampler's tokens and log-probs (greedy and sampled, eos, stop strings, sub-batches, rows
leaving the batch, LoRA, AQN noise). GPU (skipped without one): graph replay equals the same
engine without graphs, the fused kernels equal the torch ops, and the log-probs the sampler
reports match a CPU fp32 reference within bf16 tolerance.
"""
from __future__ import annotations

import pytest
import torch

from engine.lora import adapter_params, apply_lora
from engine.model.shapes import NumberTokenizer, build_random_model, shape_config
from engine.rollout import SamplingParams, generate
from engine.rollout.cuda_graph import GraphRollout
from engine.spec import LoraSpec

TINY = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
            vocab_size=512)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(quantization: str, *, device="cpu", dtype=torch.float32, lora: bool = True, seed: int = 3):
    """Built on CPU (same weights whatever the device), then moved and cast."""
    m = build_random_model(shape_config("7b", **TINY), quantization=quantization, device="cpu",
                           dtype=torch.bfloat16 if dtype == torch.bfloat16 or device != "cpu" else dtype,
                           seed=seed, std=0.3).to(device=device, dtype=dtype)
    if lora:
        apply_lora(m, LoraSpec(r=4), seed=seed)
        with torch.no_grad():
            for p in adapter_params(m):
                if p.shape[1] == 4:  # B: make the adapter non-trivial
                    p.normal_(0, 0.05, generator=torch.Generator(device=p.device).manual_seed(seed))
    for i, n in enumerate(m.aqn_norms()):
        n.noise = 0.01 * torch.randn(n.weight.shape, generator=torch.Generator().manual_seed(i)).to(n.weight.device)
    return m


def _prompts(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 512, (int(k),), generator=g).tolist() for k in (5, 9, 3, 7, 4)[:n]]


def _same(a, b, atol=1e-4):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    assert [c.text for c in a] == [c.text for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize(("quantization", "sync_every"), [("nvfp4", 16), ("bf16", 1), ("bf16", 3)])
def test_cpu_engine_matches_eager_greedy_with_stops(quantization, sync_every):
    m = _model(quantization)
    tok = NumberTokenizer()
    prompts = _prompts(5)
    ref = generate(m, tok, prompts, SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_ids=[10**6]))
    eos = ref[0].token_ids[3]  # row 0 ends early on it, other rows maybe too
    stop = ref[1].text.split()[5]  # a stop string
    params = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_ids=[eos], stop=[f" {stop} "])
    want = generate(m, tok, prompts, params, max_batch=4)
    eng = GraphRollout(m, max_batch=4, max_len=64, sync_every=sync_every)
    got = eng.generate(tok, prompts, params, max_batch=4)
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) <= 4
    assert any(c.finish_reason == "length" for c in got)
    _same(got, want)


def test_cpu_engine_matches_eager_sampled_and_refreshes_lora():
    m = _model("nvfp4")
    tok = NumberTokenizer()
    prompts = _prompts(4)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=50, top_p=0.9, eos_token_ids=[7, 11, 13])
    eng = GraphRollout(m, max_batch=4, max_len=32)
    for _ in range(2):  # the second round after an adapter update and new noise: the engine reads them again
        want = generate(m, tok, prompts, params, generator=torch.Generator().manual_seed(5))
        got = eng.generate(tok, prompts, params, generator=torch.Generator().manual_seed(5))
        _same(got, want)
        with torch.no_grad():
            for p in adapter_params(m):
                p.add_(0.05)
        for n in m.aqn_norms():
            n.noise = n.noise.flip(0)


def test_refresh_copies_the_live_weights_exactly():
    """refresh (batched copies) leaves each group's A rows, its B^T * scaling columns (zero for a
    disabled adapter), and each norm's weight + noise exactly as copying them one by one."""
    from engine.lora import LoRALinear

    m = _model("bf16", dtype=torch.bfloat16)
    eng = GraphRollout(m, max_batch=2, max_len=16)
    eng.refresh()  # k_proj's block is non-zero now; disabled, the next refresh must clear it
    m.model.layers[1].self_attn.k_proj.disabled = True
    with torch.no_grad():
        for p in adapter_params(m):
            p.add_(0.25)
    eng.refresh()
    norms = [(L.norm_in, L.w_in) for L in eng.layers] + [(L.norm_post, L.w_post) for L in eng.layers]
    for norm, w in norms + [(m.model.norm, eng.w_final)]:
        want = norm.weight.float() + norm.noise if getattr(norm, "noise", None) is not None else norm.weight.float()
        assert torch.equal(w, want)
    checked = 0
    for L in eng.layers:
        for g in (L.qkv, L.o, L.gu, L.down):
            n0 = 0
            for i, (mem, s) in enumerate(zip(g.members, g.sizes)):
                assert isinstance(mem, LoRALinear)
                r = mem.lora_A.shape[0]
                assert torch.equal(g.a_cat[i * g.r:i * g.r + r], mem.lora_A.float())
                want = torch.zeros(r, s) if mem.disabled else (mem.lora_B.t() * mem.scaling).float()
                assert torch.equal(g.b_pack[:r, n0:n0 + s], want)
                n0 += s
                checked += 1
    assert checked == 2 * 7


def test_a_rebuilt_engine_lets_the_old_one_go_before_it_allocates(monkeypatch):
    """engine_for rebuilds the cached engine when a call needs more rows or a longer KV cache; the
    old engine (KV cache, graphs) must be gone before the new one allocates, or a rebuild's peak is
    both engines' memory (which the memory plan does not count). Kept when it is big enough."""
    import weakref

    from engine.rollout import cuda_graph

    m = _model("nvfp4")
    small = cuda_graph.engine_for(m, max_batch=2, max_len=64)
    assert cuda_graph.engine_for(m, max_batch=2, max_len=32) is small  # big enough: kept
    old, alive_at_build = weakref.ref(small), []
    del small
    real_init = cuda_graph.GraphRollout.__init__

    def init(self, *args, **kwargs):
        alive_at_build.append(old() is not None)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(cuda_graph.GraphRollout, "__init__", init)
    bigger = cuda_graph.engine_for(m, max_batch=4, max_len=128)
    assert alive_at_build == [False] and (bigger.max_batch, bigger.max_len) == (4, 128)
    assert m._graph_rollout is bigger


def test_cpu_engine_cancel_and_length_checks():
    m = _model("bf16", lora=False)
    tok = NumberTokenizer()
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 2

    # should_stop is polled before each sub-batch and each time the host reads the tokens
    # (every 2 steps here): the 1st sub-batch (prompts 2 and 4, the shortest) is cancelled
    # after its 2nd read, with 4 tokens each; the other prompts never start.
    eng = GraphRollout(m, max_batch=2, max_len=32, sync_every=2)
    out = eng.generate(tok, _prompts(5), SamplingParams(max_new_tokens=6, temperature=0.0, eos_token_ids=[10**6]),
                       should_stop=stop)
    assert [c.finish_reason for c in out] == ["cancelled"] * 5
    assert [len(c.token_ids) for c in out] == [0, 0, 4, 0, 4]
    assert [len(c.logprobs) for c in out] == [0, 0, 4, 0, 4]
    with pytest.raises(ValueError, match="max_len"):
        eng.generate(tok, [[1] * 30], SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize(("device", "quantization"), [
    ("cpu", "nvfp4"), ("cpu", "bf16"),
    pytest.param("cuda", "nvfp4", marks=gpu), pytest.param("cuda", "bf16", marks=gpu)])
def test_engine_prefill_matches_the_model_forward(monkeypatch, device, quantization):
    """The engine's prefill (fused groups, rows = prompt tokens, in chunks of sequences) fills
    the cache and gives the last-token logits as the model's forward with a KVCache does."""
    from engine.rollout import cuda_graph
    from engine.rollout.batching import left_pad

    monkeypatch.setattr(cuda_graph, "PREFILL_ROWS", 20)  # 2 sequences per chunk: 3 chunks
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    m = _model(quantization, device=device, dtype=dtype)
    ids, mask = (t.to(device) for t in left_pad(_prompts(5), 0))  # (5, 9), left-padded
    n, t = ids.shape
    with torch.no_grad():
        cache = m.new_cache(n, 32)
        want = m.logits(m(ids, mask, cache)[:, -1]).float()
        eng = GraphRollout(m, max_batch=8, max_len=32)
        eng.refresh()
        eng.kc.fill_(float("nan"))
        got = eng._prefill(ids, mask)
    atol, rtol = (1e-4, 1e-4) if device == "cpu" else (0.05, 0.02)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert torch.equal(eng.valid[:n, :t], cache.valid[:, :t]) and not eng.valid[:n, t:].any()
    assert eng.pos[:n].tolist() == cache.next_pos.tolist() and int(eng.slot) == t
    for i in range(m.config.num_layers):
        torch.testing.assert_close(eng.kc[i, :n, :, :t], cache.k[i][:, :, :t], atol=atol, rtol=rtol)
        torch.testing.assert_close(eng.vc[i, :n, :, :t], cache.v[i][:, :, :t], atol=atol, rtol=rtol)


class _ReplayOnCpu:
    """Stands in for a captured prefill graph on CPU: replay runs the engine's eager prefill on
    the static inputs into the static logits (what a captured graph's replay does)."""

    def __init__(self, eng, ids, mask):
        self.eng, self.ids, self.mask, self.replays = eng, ids, mask, 0
        self.logits = eng._prefill(ids, mask)

    def replay(self):
        self.replays += 1
        self.logits.copy_(self.eng._prefill(self.ids, self.mask))


def test_prefill_graph_rule_second_sighting_and_lru(monkeypatch):
    """_run_prefill: a small shape runs eagerly the first time and replays its graph from the
    second time (with that call's tokens); capture=True captures a new shape at once; large
    shapes never get one; at most PREFILL_GRAPHS shapes are kept, the least recently used go
    first. The graph is a CPU stand-in here (tests below capture real ones on a GPU)."""
    from engine.rollout import cuda_graph
    from engine.rollout.batching import left_pad

    monkeypatch.setattr(cuda_graph, "PREFILL_GRAPHS", 2)
    monkeypatch.setattr(cuda_graph, "PREFILL_GRAPH_ROWS", 40)
    m = _model("nvfp4")
    eng = GraphRollout(m, max_batch=8, max_len=32)
    eng.use_graphs = True
    made = []

    def fake_capture(ids, mask, *, warm):
        g = _ReplayOnCpu(eng, ids.clone(), mask.clone())
        made.append((tuple(ids.shape), warm, g))
        return g, g.ids, g.mask, g.logits

    monkeypatch.setattr(eng, "_capture_prefill", fake_capture)
    eng.refresh()
    ids, mask = left_pad(_prompts(3), 0)  # (3, 9): 27 rows
    with torch.no_grad():
        want = eng._prefill(ids, mask)
        assert torch.equal(eng._run_prefill(ids, mask), want) and not made  # first time: eager
        assert torch.equal(eng._run_prefill(ids, mask), want)  # second: captured (no warm-up) and replayed
        assert [(s, w) for s, w, _ in made] == [((3, 9), False)] and made[0][2].replays == 1
        other = ids.flip(0)
        assert torch.equal(eng._run_prefill(other, mask.flip(0)), eng._prefill(other, mask.flip(0)))
        assert made[0][2].replays == 2 and len(made) == 1  # the same graph with the new tokens
        big, big_mask = left_pad(_prompts(5), 0)  # (5, 9): 45 rows, over the limit
        for _ in range(3):
            eng._run_prefill(big, big_mask)
        assert len(made) == 1 and list(eng.prefill_graphs) == [(3, 9)]
        for n in (1, 2):  # capture=True: new shapes at once, with a warm-up
            eng._run_prefill(ids[:n], mask[:n], capture=True)
        assert [(s, w) for s, w, _ in made[1:]] == [((1, 9), True), ((2, 9), True)]
        assert list(eng.prefill_graphs) == [(1, 9), (2, 9)]  # (3, 9) was the least recently used
        eng._run_prefill(ids, mask)  # seen before: captured again
        assert len(made) == 4 and list(eng.prefill_graphs) == [(2, 9), (3, 9)]


# -- GPU ----------------------------------------------------------------------------------------
def _fuse_norms(monkeypatch, on: bool, o_tasks: bool | None = None) -> None:
    """Run the residual adds and RMSNorms inside the NVFP4 GEMMs (cuda_graph.FUSED_NORM_ROWS) at any
    batch and hidden size, or never; o's LoRA shrink by tasks of its GEMM (O_SHRINK_TASK_ROWS) at
    any batch or never (by default as the norms)."""
    import engine.rollout.cuda_graph as cg

    monkeypatch.setattr(cg, "FUSED_NORM_ROWS", 16 if on else 0)
    monkeypatch.setattr(cg, "FUSED_NORM_MIN_HIDDEN", 0)
    monkeypatch.setattr(cg, "O_SHRINK_TASK_ROWS", 16 if (on if o_tasks is None else o_tasks) else 0)


@gpu
@pytest.mark.parametrize(("quantization", "fused_norm", "o_tasks"), [
    ("nvfp4", False, False), ("nvfp4", False, True), ("nvfp4", True, True), ("bf16", False, False)])
def test_gpu_graph_replay_equals_eager_engine(quantization, fused_norm, o_tasks, monkeypatch):
    _fuse_norms(monkeypatch, fused_norm, o_tasks)
    m = _model(quantization, device="cuda", dtype=torch.bfloat16)
    tok = NumberTokenizer()
    prompts = _prompts(5)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, eos_token_ids=[3, 5])
    a = GraphRollout(m, max_batch=8, max_len=512, use_graphs=True)
    if a.ops.name == "cuda":
        assert a._fused_norm(8) == a._fused_norm(1) == fused_norm
        assert a._o_tasks(8) == a._o_tasks(1) == (o_tasks and quantization == "nvfp4")
    got = a.generate(tok, prompts, params, generator=torch.Generator("cuda").manual_seed(0))
    assert a.stats.graphs_captured >= 1
    b = GraphRollout(m, max_batch=8, max_len=512, use_graphs=False)
    want = b.generate(tok, prompts, params, generator=torch.Generator("cuda").manual_seed(0))
    _same(got, want, atol=2e-3)  # cuBLAS may pick another algorithm under capture


@gpu
def test_gpu_fused_ops_equal_torch_ops():
    from engine.rollout.fused_ops import TorchOps, pick_ops

    ops = pick_ops(torch.device("cuda"), torch.bfloat16, qk_norm=False, head_dim=128)
    if ops.name != "cuda":
        pytest.skip("fused kernels need an sm_90 GPU and nvcc")
    ref, dev, g = TorchOps(), "cuda", torch.Generator("cuda").manual_seed(0)

    def rnd(*s, dtype=torch.bfloat16):
        return torch.randn(*s, device=dev, generator=g).to(dtype)

    b, heads, kvh, d, h, inter, S, r = 5, 8, 2, 128, 1024, 3072, 64, 16
    from engine.rollout.fused_ops import LoraTerm

    def lora(sizes):  # a LoRA term of a fused projection with these member widths
        n = sum(sizes)
        edges = [sum(sizes[:i + 1]) for i in range(len(sizes))] + [2**31 - 1] * 2
        return LoraTerm(rnd(b, len(sizes) * r, dtype=torch.float32), rnd(r, n, dtype=torch.float32) * 0.05, r,
                        edges[0], edges[1])

    def close(a, c):  # the in-kernel expand sums in another order than torch's matmul: 1 bf16 ulp
        torch.testing.assert_close(a.float(), c.float(), atol=1e-2, rtol=8e-3)

    # the shrink against float64
    for k in (1024, 3584, 27648):
        xs, a = rnd(b, k), torch.randn(3 * r, k, device=dev, generator=g) * 0.02
        want = xs.double() @ a.double().t()
        torch.testing.assert_close(ops.lora_shrink(xs, a).double(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ref.lora_shrink(xs, a).double(), want, atol=1e-4, rtol=1e-4)
    y, bias = rnd(b, (heads + 2 * kvh) * d), rnd((heads + 2 * kvh) * d)
    ang = torch.rand(b, d // 2, device=dev, generator=g) * 100
    cos, sin = torch.cat((ang, ang), -1).cos().bfloat16(), torch.cat((ang, ang), -1).sin().bfloat16()
    slot = torch.tensor([17], device=dev)
    caches = [rnd(8, kvh, S, d) for _ in range(2)]
    caches2 = [c.clone() for c in caches]
    for bi, lo in ((bias, lora([heads * d, kvh * d, kvh * d])), (None, None)):
        q1 = ops.qkv_rope_cache(y, bi, lo, cos, sin, *caches, slot, heads=heads, kv_heads=kvh, d=d)
        q2 = ref.qkv_rope_cache(y, bi, lo, cos, sin, *caches2, slot, heads=heads, kv_heads=kvh, d=d)
        if lo is None:
            assert torch.equal(q1, q2) and torch.equal(caches[0], caches2[0]) and torch.equal(caches[1], caches2[1])
        else:
            close(q1, q2), close(caches[0], caches2[0]), close(caches[1], caches2[1])
    x, w = rnd(b, h), torch.rand(h, device=dev, generator=g) + 0.5
    for yy, bi, lo in ((rnd(b, h), rnd(h), lora([h])), (None, None, None)):
        x1, o1 = ops.add_rmsnorm(x.clone(), yy, bi, lo, w, 1e-6)
        x2, o2 = ref.add_rmsnorm(x.clone(), yy, bi, lo, w, 1e-6)
        close(x1, x2)
        if lo is None:
            assert torch.equal(x1, x2)
        assert (o1.float() - o2.float()).abs().max() <= 0.01 * o2.float().abs().max()
    gu = rnd(b, 2 * inter) * 4
    lo = lora([inter, inter])
    close(ops.silu_mul(gu, None, lo), ref.silu_mul(gu, None, lo))
    torch.testing.assert_close(ops.silu_mul(gu, None, None).float(), ref.silu_mul(gu, None, None).float(), atol=0,
                               rtol=8e-3)


@gpu
@pytest.mark.parametrize(("fused_norm", "o_tasks"), [(False, False), (False, True), (True, True)])
def test_gpu_sampler_logprobs_match_cpu_reference(fused_norm, o_tasks, monkeypatch):
    """The log-probs the graph engine reports for its own tokens = a CPU fp32 forward's, with the
    RMSNorms in their own kernels or inside the NVFP4 GEMMs, o's shrink in its own launch or in
    o's GEMM."""
    _fuse_norms(monkeypatch, fused_norm, o_tasks)
    m = _model("nvfp4", device="cuda", dtype=torch.bfloat16)
    tok = NumberTokenizer()
    prompts = _prompts(4)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, eos_token_ids=[10**6])
    eng = GraphRollout(m, max_batch=4, max_len=256)
    assert eng._fused_norm(4) == (fused_norm and eng.ops.name == "cuda")
    assert eng._o_tasks(4) == (o_tasks and eng.ops.name == "cuda")
    out = eng.generate(tok, prompts, params, generator=torch.Generator("cuda").manual_seed(1))
    cpu = _model("nvfp4", device="cpu", dtype=torch.bfloat16).float()  # same codes, fp32 arithmetic
    errs, eager_errs = [], []
    for c in out:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        p0 = len(c.prompt_ids) - 1
        with torch.no_grad():
            ref = cpu.token_logprobs(ids, from_position=p0)[0][0, p0:]
            eager = m.token_logprobs(ids.cuda(), from_position=p0)[0][0, p0:].cpu()  # the eager GPU decoder
        errs.append((ref - c.logprobs).abs())
        eager_errs.append((ref - eager).abs())
    err, eager_err = torch.cat(errs), torch.cat(eager_errs)
    # bf16 tolerance: no worse than the eager GPU decoder's own distance from the fp32 reference
    assert err.mean() <= 2 * eager_err.mean() + 0.02, (err.mean(), eager_err.mean())
    assert err.max() <= 2 * eager_err.max() + 0.1, (err.max(), eager_err.max())


@gpu
@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_gpu_prefill_graph_equals_eager_prefill(quantization):
    """A replayed prefill graph gives the eager prefill's logits, cache, valid mask and positions,
    for the prompts it was captured with and for other prompts of the same shape; and a rollout
    whose prefill replays a graph equals one on an engine without graphs."""
    from engine.rollout.batching import left_pad

    m = _model(quantization, device="cuda", dtype=torch.bfloat16)
    eng = GraphRollout(m, max_batch=8, max_len=64)
    with torch.no_grad():
        eng.refresh()
        for prompts in (_prompts(5), _prompts(5)[::-1]):
            ids, mask = (t.cuda() for t in left_pad(prompts, 0))
            n, t = ids.shape
            eng.kc.fill_(float("nan"))
            want = eng._prefill(ids, mask)
            kc, vc, valid, pos = eng.kc[:, :n, :, :t].clone(), eng.vc[:, :n, :, :t].clone(), eng.valid.clone(), eng.pos.clone()
            eng.kc.fill_(float("nan"))
            eng.valid.zero_()
            eng.pos.zero_()
            got = eng._run_prefill(ids, mask, capture=True)
            assert (n, t) in eng.prefill_graphs
            torch.testing.assert_close(got, want, atol=2e-3, rtol=0)  # cuBLAS may pick another algorithm under capture
            torch.testing.assert_close(eng.kc[:, :n, :, :t], kc, atol=2e-3, rtol=0)
            torch.testing.assert_close(eng.vc[:, :n, :, :t], vc, atol=2e-3, rtol=0)
            assert torch.equal(eng.valid, valid) and torch.equal(eng.pos, pos) and int(eng.slot) == t
    tok = NumberTokenizer()
    params = SamplingParams(max_new_tokens=12, temperature=1.0, eos_token_ids=[10**6])
    eng = GraphRollout(m, max_batch=8, max_len=64)  # a fresh cache (the one above holds NaN past the prompts)
    eng.capture(4, 9, 9 + 12, prompts=4)
    prompts = [p + [7] * (9 - len(p)) for p in _prompts(4)]  # 4 prompts of 9 tokens: the captured shape
    assert (4, 9) in eng.prefill_graphs
    got = eng.generate(tok, prompts, params, generator=torch.Generator("cuda").manual_seed(2))
    want = GraphRollout(m, max_batch=8, max_len=64, use_graphs=False).generate(
        tok, prompts, params, generator=torch.Generator("cuda").manual_seed(2))
    _same(got, want, atol=2e-3)


def test_fused_shrink_rank_rows_rule(monkeypatch):
    """CudaOps' choice of rank rows per block for the fused norm / SiLU + shrink kernels on a
    132-SM GPU: the fewest of 1, 2, 4, 8 that keep one block per SM; None (the two kernels)
    beyond that."""
    from engine.kernels import nvfp4_gemm
    from engine.rollout.fused_ops import CudaOps

    monkeypatch.setattr(nvfp4_gemm, "sm_count", lambda device: 132)
    ops = CudaOps(None)
    a7, a16, a48 = torch.zeros(7, 4), torch.zeros(16, 4), torch.zeros(48, 4)
    assert [ops._fused_ranks(r, 27648, a7) for r in (1, 3, 8, 13)] == [1, 2, 4, 8]
    assert ops._fused_ranks(1, 3584, a48) == 1  # 7B q/k/v at one row: 48 blocks
    assert ops._fused_ranks(3, 3584, a48) == 2  # one K block: 144 blocks are too many, 72 with pairs
    assert ops._fused_ranks(8, 3584, a48) == 4  # 7B q/k/v at batch 8: 8 x 12 blocks
    assert ops._fused_ranks(8, 5120, a48) == 8  # 32B q/k/v at batch 8: 16 x 6 blocks
    assert ops._fused_ranks(8, 18944, a16) == 8  # 5 K blocks x 8 rows x 2 groups
    assert ops._fused_ranks(32, 5120, a48) is None  # 64 x 6 blocks even with 8 rank rows
