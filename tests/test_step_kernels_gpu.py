"""A decode step's own kernels (engine/rollout/fused_decode.cu): the sampler, the step's input
gathers and its output copy, against float64 / plain torch on fresh random data.

- The sampler: greedy tokens equal torch.argmax (ties to the first index), sampled tokens are
  the argmax of x / T - log q in float64 up to fp32 rounding, every log-prob equals float64
  log_softmax(x / T) at the token, outputs NaN-poisoned before, the same bits on every call,
  tickets left zero, masked (-inf) logits never drawn, the drawn frequencies those of softmax.
- The step kernels: the same values as the index ops, copy and increments they replace.
Needs an sm_90 GPU and nvcc; skipped elsewhere (CI has none).
"""
from __future__ import annotations

import pytest
import torch

from engine.rollout import sampler
from engine.rollout.fused_ops import cuda_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 (Hopper) GPU",
    ),
]


@pytest.fixture(scope="module")
def ops():
    o = cuda_ops(torch.device("cuda"))
    if o is None:
        pytest.skip("fused kernels need nvcc")
    return o


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
