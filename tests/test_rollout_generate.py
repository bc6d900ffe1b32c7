"""Native sampler: greedy equals transformers, padding/sub-batch invariance, eos and stop
strings, cancellation, seeded sampling, top-k/top-p, and log-probs the learner reproduces."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model import load_model
from engine.model.tiny import make_tiny_model
from engine.rollout import SamplingParams, generate
from engine.rollout.sampler import sample_next

PROMPTS = [[1, 504, 3458, 314, 2114], [1, 77, 9001], [1, 4000, 12, 13, 14, 15, 16, 17], [1, 30000]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # larger init than the default: peaked next-token distributions, so sampling is not uniform
    return make_tiny_model(tmp_path_factory.mktemp("roll") / "llama", arch="llama", seed=21, initializer_range=0.3)


@pytest.fixture(scope="module")
def fp32(tiny_dir):
    return load_model(str(tiny_dir), quantization="bf16", dtype=torch.float32)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def test_greedy_equals_transformers_and_is_batch_invariant(fp32, tiny_dir):
    model, tok = fp32
    outs = generate(model, tok, PROMPTS, _greedy(10), max_batch=3)  # two sub-batches, left padding
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    for p, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
        assert out.token_ids == ref and out.prompt_ids == p
        assert out.finish_reason == ("stop" if 2 in ref else "length")
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.logprobs.shape == (len(ref),) and out.logprobs.dtype == torch.float32
        alone = generate(model, tok, [p], _greedy(10))[0]
        assert alone.token_ids == out.token_ids


def test_eos_and_max_tokens_end_sequences(fp32):
    model, tok = fp32
    free = generate(model, tok, PROMPTS[:2], _greedy(12, eos_token_ids=[-1]))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in free)
    eos = free[0].token_ids[4]
    outs = generate(model, tok, PROMPTS[:2], _greedy(12, eos_token_ids=[eos]))
    cut = free[0].token_ids.index(eos) + 1
    assert outs[0].token_ids == free[0].token_ids[:cut] and outs[0].finish_reason == "stop"
    other = free[1].token_ids
    assert outs[1].token_ids == (other[:other.index(eos) + 1] if eos in other else other)


def test_stop_string_is_kept_and_later_tokens_dropped(fp32):
    model, tok = fp32
    free = generate(model, tok, [PROMPTS[2]], _greedy(12, eos_token_ids=[-1]))[0]
    full = tok.decode(free.token_ids, skip_special_tokens=True)
    piece = tok.decode(free.token_ids[5:7], skip_special_tokens=True).strip()[:3]
    assert piece and piece in full
    out = generate(model, tok, [PROMPTS[2]], _greedy(12, eos_token_ids=[-1], stop=["\x00never", piece]))[0]
    end = full.index(piece) + len(piece)
    assert out.finish_reason == "stop" and out.text == full[:end]
    n = len(out.token_ids)
    assert out.token_ids == free.token_ids[:n] and len(out.logprobs) == n
    assert piece in tok.decode(out.token_ids[:n]) and piece not in tok.decode(out.token_ids[:n - 1])


def test_should_stop_cancels_between_steps_and_sub_batches(fp32):
    model, tok = fp32
    calls = {"n": 0}

    def should_stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 3  # allow the first sub-batch to start and decode two steps

    outs = generate(model, tok, PROMPTS, _greedy(20, eos_token_ids=[-1]), should_stop=should_stop, max_batch=2)
    assert [o.finish_reason for o in outs] == ["cancelled"] * 4
    started = [o for o in outs if o.token_ids]
    assert len(started) == 2 and all(len(o.token_ids) == 3 for o in started)
    assert all(o.prompt_ids == p for o, p in zip(outs, PROMPTS))


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(fp32):
    model, tok = fp32
    params = SamplingParams(max_new_tokens=8, temperature=1.0, eos_token_ids=[-1])
    a = generate(model, tok, PROMPTS, params, generator=torch.Generator().manual_seed(1))
    b = generate(model, tok, PROMPTS, params, generator=torch.Generator().manual_seed(1))
    c = generate(model, tok, PROMPTS, params, generator=torch.Generator().manual_seed(2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b] != [o.token_ids for o in c]
    greedy = generate(model, tok, PROMPTS, _greedy(8, eos_token_ids=[-1]))
    top1 = generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.3, top_k=1, eos_token_ids=[-1]),
                    generator=torch.Generator().manual_seed(3))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_top_p_top_k_sample_only_the_nucleus():
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    probs = torch.softmax(logits[0], -1)  # 0.53, 0.32, 0.07, ...
    gen = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, temperature=1.0, top_p=0.8, top_k=0, generator=gen)
    counts = torch.bincount(tok, minlength=5).float() / 4000
    assert counts[2:].sum() == 0  # 0.53 + 0.32 >= 0.8: the rest is cut
    assert abs(counts[0] - probs[0] / probs[:2].sum()) < 0.03
    torch.testing.assert_close(lp, torch.log(probs)[tok])  # untruncated log-probs
    tok_k, _ = sample_next(logits, temperature=2.0, top_p=1.0, top_k=3, generator=gen)
    assert tok_k.max() <= 2 and (tok_k == 2).any()


@pytest.mark.parametrize("quantization", ["bf16", "nvfp4"])
def test_sampler_logprobs_equal_learner_logprobs(tiny_dir, quantization):
    model, tok = load_model(str(tiny_dir), quantization=quantization)  # bf16 activations
    temp = 0.8
    outs = generate(model, tok, PROMPTS, SamplingParams(max_new_tokens=10, temperature=temp, eos_token_ids=[-1]),
                    generator=torch.Generator().manual_seed(4))
    plen = max(len(p) for p in PROMPTS)
    ids = torch.full((len(PROMPTS), plen + 10), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for r, (p, o) in enumerate(zip(PROMPTS, outs)):  # left-padded prompt + completion, as a learner batches it
        ids[r, plen - len(p):] = torch.tensor(p + o.token_ids)
        mask[r, plen - len(p):] = 1
    with torch.no_grad():
        logp, _ = model.token_logprobs(ids, mask, temperature=temp, from_position=plen - 1)
        logp_t1, _ = model.token_logprobs(ids, mask, temperature=1.0, from_position=plen - 1)
    learner = logp[:, plen - 1:]
    sampler = torch.stack([o.logprobs for o in outs])
    assert sampler.std() > 1.0  # a spread of confident and unlikely tokens
    # bf16 logits (magnitude ~10, ulp 0.06) computed in differently shaped batches
    assert (learner - sampler).abs().max() < 0.15, (learner - sampler).abs().max()
    assert (logp_t1[:, plen - 1:] - sampler).abs().max() > 0.5  # a temperature mix-up would show


def test_generate_restores_training_mode_and_checks_input(fp32):
    model, tok = fp32
    model.train()
    generate(model, tok, [PROMPTS[0]], _greedy(2))
    assert model.training
    model.eval()
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, tok, [[]], _greedy(2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_dense_base_rollout_is_identical_and_restored(tiny_dir):
    model, tok = load_model(str(tiny_dir), quantization="nvfp4")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, eos_token_ids=[-1])
    a = generate(model, tok, PROMPTS, params, generator=torch.Generator().manual_seed(5), dense_base=True)
    b = generate(model, tok, PROMPTS, params, generator=torch.Generator().manual_seed(5), dense_base=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    q = model.model.layers[0].self_attn.q_proj
    assert "_matmul" not in q.__dict__  # the per-call dequantizing path is back
