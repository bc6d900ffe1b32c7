"""The decode-attention kernel (engine.rollout.attention) against float64 torch on fresh random
queries, caches and masks (left padding, holes, one valid column), over batch sizes, kv-head
groupings, head sizes and attention lengths that give one split and many; deterministic,
capturable in a CUDA graph, correct when it reads the cache before the kernel that writes the
step's column ends, and the same greedy rollout as SDPA. CPU: the
split rule. Skipped without a GPU (or with another GPU than sm_90)."""
from __future__ import annotations

import math

import pytest
import torch

from engine.rollout.attention import KEYS, MAX_SPLITS, SPLIT_BLOCKS, SdpaAttention, splits_for

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU")


def test_splits_cover_every_column_once():
    for rows in (1, 3, 8, 64):
        for kvh in (1, 4, 8):
            for s in (1, 63, 64, 65, 300, 512, 1280, 2048, 4096):
                splits, per = splits_for(rows, kvh, s)
                assert per % KEYS == 0 and splits * per >= s > (splits - 1) * per
                assert 1 <= splits <= MAX_SPLITS
                assert rows * kvh * splits >= min(SPLIT_BLOCKS, rows * kvh * min(MAX_SPLITS, -(-s // KEYS))) // 2


def _case(b, kvh, n_rep, d, s_max, s, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, kvh * n_rep, d, device="cuda", generator=g).to(torch.bfloat16)
    kc = (torch.randn(b + 2, kvh, s_max, d, device="cuda", generator=g) * 2).to(torch.bfloat16)  # more rows than used
    vc = torch.randn(b + 2, kvh, s_max, d, device="cuda", generator=g).to(torch.bfloat16)
    valid = torch.rand(b + 2, s_max, device="cuda", generator=g) > 0.2
    for r in range(b):  # left padding of row r, and its last column always valid
        valid[r, :r * 3] = False
        valid[r, s - 1] = True
    if b > 1:
        valid[1, :s - 1] = False  # one valid column only
    return q, kc, vc, valid


def _reference(q, kc, vc, valid, s):
    b, heads, d = q.shape
    kvh = kc.shape[1]
    k = kc[:b, :, :s].double().repeat_interleave(heads // kvh, dim=1)  # (B, heads, S, D)
    v = vc[:b, :, :s].double().repeat_interleave(heads // kvh, dim=1)
    att = torch.einsum("bhd,bhsd->bhs", q.double(), k) / math.sqrt(d)
    att = att.masked_fill(~valid[:b, None, :s], float("-inf")).softmax(-1)
    return torch.einsum("bhs,bhsd->bhd", att, v).reshape(b, heads * d)


@needs_sm90
@pytest.mark.parametrize(("b", "kvh", "n_rep", "d", "s_max", "s"), [
    (1, 4, 7, 128, 2048, 512),    # 7B, one row: many splits
    (1, 8, 5, 128, 1024, 1),      # 32B, first column only
    (8, 4, 7, 128, 512, 300),     # 7B, a batch: fewer splits
    (3, 8, 8, 128, 2048, 1280),   # 72B grouping
    (5, 3, 3, 64, 256, 97),       # SmolLM2-135M grouping, head size 64
    (64, 4, 7, 128, 512, 512),    # a big batch: one split per row
    (2, 2, 1, 64, 4096, 4096),    # no grouping, long
])
def test_kernel_matches_float64(b, kvh, n_rep, d, s_max, s):
    from engine.rollout.attention import _library, KernelAttention

    lib = _library()
    assert lib is not None, "the decode attention kernel must build on an sm_90 machine"
    att = KernelAttention(lib)
    for seed in range(2):
        q, kc, vc, valid = _case(b, kvh, n_rep, d, s_max, s, seed)
        out = att(q, kc, vc, valid, s)
        ref = _reference(q, kc, vc, valid, s)
        torch.testing.assert_close(out.double(), ref, atol=1.5e-2, rtol=1e-2)
        assert torch.equal(att(q, kc, vc, valid, s), out)  # deterministic
        sdpa = SdpaAttention()
        sdpa.begin_step(valid, b, n_rep, s, torch.bfloat16)
        torch.testing.assert_close(out.double(), sdpa(q, kc, vc, valid, s).double(), atol=3e-2, rtol=2e-2)


@needs_sm90
def test_kernel_in_a_cuda_graph():
    from engine.rollout.attention import _library, KernelAttention

    att = KernelAttention(_library())
    q, kc, vc, valid = _case(2, 4, 7, 128, 1024, 700, 5)
    out = att(q, kc, vc, valid, 700)  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = att(q, kc, vc, valid, 700)
    q2, kc2, vc2, valid2 = _case(2, 4, 7, 128, 1024, 700, 6)
    for src, dst in ((q2, q), (kc2, kc), (vc2, vc), (valid2, valid)):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, out)
    torch.testing.assert_close(captured.double(), _reference(q, kc, vc, valid, 700), atol=1.5e-2, rtol=1e-2)


@needs_sm90
@pytest.mark.parametrize(("b", "kvh", "n_rep", "s_max", "s"), [
    (1, 4, 7, 1024, 300),   # the write column inside a split's only tile
    (2, 8, 5, 512, 65),     # the write column is the first key of the last split
    (64, 4, 7, 2048, 2048), # several tiles per split: the write column in a split's last tile
])
def test_kernel_reads_the_cache_early_but_the_write_column_late(b, kvh, n_rep, s_max, s):
    """As in a decode step: the fused q/k/v kernel writes the queries and cache column ``slot``
    and the attention kernel follows it through programmatic dependent launch, reading the rest
    of the cache before it ends. The column holds a stale key and value before (so an early read
    of it would show), and the result must be the one computed with nothing read early, within
    rounding of float64 on the new cache, eagerly and replayed in a CUDA graph."""
    from engine.rollout.attention import KernelAttention, _library
    from engine.rollout.fused_ops import CudaOps, pick_ops

    ops = pick_ops(torch.device("cuda"), torch.bfloat16, qk_norm=False, head_dim=128)
    assert isinstance(ops, CudaOps)
    att = KernelAttention(_library())
    d, heads = 128, kvh * n_rep
    _, kc, vc, valid = _case(b, kvh, n_rep, d, s_max, s, 11)
    slot = torch.tensor([s - 1], dtype=torch.long, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(12)
    y = torch.randn(b, (heads + 2 * kvh) * d, device="cuda", generator=g).to(torch.bfloat16)
    ang = torch.rand(b, d // 2, device="cuda", generator=g) * 6.28
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16)

    def step(early: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kc[:, :, s - 1].fill_(30.0)  # stale: what an early read of the write column would see
        vc[:, :, s - 1].fill_(-7.0)
        q = ops.qkv_rope_cache(y, None, None, cos, sin, kc, vc, slot, heads=heads, kv_heads=kvh, d=d)
        return q, att(q, kc, vc, valid, s, slot if early else None)

    q, late = step(False)
    ref = _reference(q, kc, vc, valid, s)
    torch.testing.assert_close(late.double(), ref, atol=1.5e-2, rtol=1e-2)
    _, early = step(True)
    assert torch.equal(early, late)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, captured = step(True)
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, late)


@needs_sm90
def test_engine_with_kernel_attention_as_accurate_as_sdpa(monkeypatch):
    """Greedy rollouts of a small head-size-128 model: the GPU engine with the kernel and with
    SDPA against the CPU fp32 engine; on the tokens all three agree on, the kernel's log-probs
    are no further from fp32 than SDPA's."""
    from engine.model.shapes import NumberTokenizer, build_random_model, shape_config
    from engine.rollout import SamplingParams
    from engine.rollout.cuda_graph import GraphRollout

    cfg = shape_config("7b", hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                       intermediate_size=1024, vocab_size=512)
    base = build_random_model(cfg, quantization="bf16", device="cpu", dtype=torch.bfloat16, seed=2, std=0.1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 512, (int(n),), generator=g).tolist() for n in (5, 70, 33)]
    params = SamplingParams(max_new_tokens=80, temperature=0.0, eos_token_ids=[10**6])
    tok = NumberTokenizer()
    ref = GraphRollout(base.float(), max_batch=4, max_len=256, len_bucket=64).generate(tok, prompts, params)
    m = base.to(device="cuda", dtype=torch.bfloat16)
    runs = {}
    for choice in ("kernel", "sdpa"):
        monkeypatch.setenv("QERL_DECODE_ATTENTION", choice)
        eng = GraphRollout(m, max_batch=4, max_len=256, len_bucket=64)
        assert (eng.attention.kernel is not None) == (choice == "kernel")
        runs[choice] = eng.generate(tok, prompts, params)
    err = {"kernel": [], "sdpa": []}
    for i, want in enumerate(ref):
        seqs = [want.token_ids, runs["kernel"][i].token_ids, runs["sdpa"][i].token_ids]
        n = next((j for j in range(len(want.token_ids)) if len({s[j] for s in seqs}) > 1), len(want.token_ids))
        for choice in err:
            err[choice].append((runs[choice][i].logprobs[:n] - want.logprobs[:n]).abs())
    assert sum(len(e) for e in err["kernel"]) >= 16  # tokens compared
    e_kernel, e_sdpa = (torch.cat(err[c]).mean().item() for c in ("kernel", "sdpa"))
    assert e_kernel <= 1.2 * e_sdpa + 1e-3, (e_kernel, e_sdpa)
