"""policy_loss and group_advantages against float64 references written token by token."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.rl.advantages import group_advantages, keep_groups
from engine.rl.loss import loss_denominator, policy_loss
from engine.spec import RLSpec

B, T = 6, 9


def _inputs(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some ratios outside the clip range
    sampler = old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some TIS weights above the cap
    ref = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    truncated = torch.zeros(B, dtype=torch.bool)
    truncated[[1, 4]] = True
    return [x.to(dtype) if x.is_floating_point() else x for x in (logp, old, sampler, ref, adv, mask)] + [truncated]


def reference(logp, old, sampler, ref, adv, mask, truncated, spec, *, use_tis, use_ref, max_len):
    """Loss and d loss / d logp with plain Python floats, one token at a time."""
    lp, ol, sl, rf = (x.double().tolist() for x in (logp, old, sampler, ref))
    A, M = adv.double().tolist(), mask.double().tolist()
    w_tok = [[M[i][t] * (0.0 if (spec.mask_truncated and bool(truncated[i])) else 1.0) for t in range(T)]
             for i in range(B)]
    per = [[0.0] * T for _ in range(B)]
    dper = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            r = math.exp(lp[i][t] - ol[i][t])
            rc = min(max(r, 1 - spec.eps_low), 1 + spec.eps_high)
            unclipped, clipped = -A[i] * r, -A[i] * rc
            if unclipped >= clipped:
                value, grad = unclipped, -A[i] * r
            else:
                value, grad = clipped, 0.0
            if use_ref and spec.kl_coef > 0:
                d = rf[i][t] - lp[i][t]
                value += spec.kl_coef * (math.exp(d) - d - 1)
                grad += spec.kl_coef * (1 - math.exp(d))
            if use_tis and spec.tis_cap > 0:
                w = min(math.exp(ol[i][t] - sl[i][t]), spec.tis_cap)
                value, grad = value * w, grad * w
            per[i][t], dper[i][t] = value, grad
    loss = 0.0
    dlogp = [[0.0] * T for _ in range(B)]
    if spec.loss_agg == "seq_mean":
        counts = [sum(w_tok[i]) for i in range(B)]
        n_seq = sum(1 for c in counts if c > 0)
        for i in range(B):
            if counts[i] == 0:
                continue
            for t in range(T):
                loss += per[i][t] * w_tok[i][t] / counts[i] / n_seq
                dlogp[i][t] = dper[i][t] * w_tok[i][t] / counts[i] / n_seq
    else:
        denom = sum(map(sum, w_tok)) if spec.loss_agg == "token_mean" else B * max_len
        for i in range(B):
            for t in range(T):
                loss += per[i][t] * w_tok[i][t] / denom
                dlogp[i][t] = dper[i][t] * w_tok[i][t] / denom
    return loss, torch.tensor(dlogp, dtype=torch.float64)


CASES = list(itertools.product(("grpo", "dapo", "dr_grpo"), (0.0, 0.05), (0.0, 2.0), (True, False)))


@pytest.mark.parametrize("algorithm,kl_coef,tis_cap,mask_truncated", CASES)
def test_loss_and_grad_match_reference(algorithm, kl_coef, tis_cap, mask_truncated):
    spec = RLSpec(algorithm=algorithm, kl_coef=kl_coef, tis_cap=tis_cap, mask_truncated=mask_truncated)
    seed = int(torch.randint(0, 2**31, ()).item())  # fresh data each run; the seed is in the failure report
    logp, old, sampler, ref, adv, mask, truncated = _inputs(seed)
    logp.requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, mask, spec, sampler_logp=sampler, ref_logp=ref,
                              truncated=truncated, max_len=T + 3)
    loss.backward()
    want_loss, want_grad = reference(logp.detach(), old, sampler, ref, adv, mask, truncated, spec,
                                     use_tis=True, use_ref=True, max_len=T + 3)
    assert loss.item() == pytest.approx(want_loss, rel=1e-10, abs=1e-12), seed
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-10, atol=1e-12, msg=f"seed {seed}")
    assert stats["loss"] == pytest.approx(want_loss, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo"])
def test_fp32_inputs_and_optional_terms_off(algorithm):
    spec = RLSpec(algorithm=algorithm, kl_coef=0.1, tis_cap=2.0)
    logp, old, sampler, ref, adv, mask, truncated = _inputs(int(torch.randint(0, 2**31, ()).item()), torch.float32)
    logp.requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, mask, spec, truncated=truncated)  # no sampler, no reference
    loss.backward()
    want_loss, want_grad = reference(logp.detach(), old, sampler, ref, adv, mask, truncated, spec,
                                     use_tis=False, use_ref=False, max_len=T)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(logp.grad.double(), want_grad, rtol=1e-4, atol=1e-6)
    assert stats["kl"] == 0.0 and stats["tis_weight_mean"] == 1.0 and stats["tis_frac"] == 0.0


def test_stats_match_counts():
    spec = RLSpec(algorithm="dapo", kl_coef=0.0, tis_cap=1.5)
    logp, old, sampler, ref, adv, mask, truncated = _inputs(int(torch.randint(0, 2**31, ()).item()))
    _, stats = policy_loss(logp, old, adv, mask, spec, sampler_logp=sampler, ref_logp=ref, truncated=truncated)
    m = mask * (~truncated).double()[:, None]
    ratio = torch.exp(logp - old)
    low = ((ratio < 0.8) & (adv[:, None] < 0)).double()
    high = ((ratio > 1.28) & (adv[:, None] > 0)).double()
    raw_w = torch.exp(old - sampler)
    n = m.sum()
    assert stats["tokens"] == n.item()
    assert stats["clip_frac_low"] == pytest.approx(((low * m).sum() / n).item())
    assert stats["clip_frac_high"] == pytest.approx(((high * m).sum() / n).item())
    assert stats["clip_frac"] == pytest.approx(stats["clip_frac_low"] + stats["clip_frac_high"])
    assert 0 < stats["clip_frac"] < 1
    assert stats["ratio_mean"] == pytest.approx(((ratio * m).sum() / n).item())
    assert stats["tis_frac"] == pytest.approx((((raw_w > 1.5).double() * m).sum() / n).item())
    assert stats["tis_weight_mean"] == pytest.approx(((raw_w.clamp(max=1.5) * m).sum() / n).item())
    d = ref - logp
    assert stats["kl"] == pytest.approx((((d.exp() - d - 1) * m).sum() / n).item())  # reported with kl_coef 0
    assert all(isinstance(v, float) for v in stats.values())


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_with_global_denominator_equal_full_batch(algorithm):
    spec = RLSpec(algorithm=algorithm, kl_coef=0.05)
    logp, old, sampler, ref, adv, mask, truncated = _inputs(int(torch.randint(0, 2**31, ()).item()))
    full = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(full, old, adv, mask, spec, sampler_logp=sampler, ref_logp=ref, truncated=truncated)
    loss.backward()
    denom = loss_denominator(mask, spec, truncated=truncated)
    parts = logp.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part, _ = policy_loss(parts[sl], old[sl], adv[sl], mask[sl], spec, sampler_logp=sampler[sl],
                              ref_logp=ref[sl], truncated=truncated[sl], denominator=denom)
        part.backward()
        total += part.item()
    assert total == pytest.approx(loss.item(), rel=1e-10)
    torch.testing.assert_close(parts.grad, full.grad, rtol=1e-10, atol=1e-14)


def test_padding_values_do_not_leak_into_loss_or_grad():
    spec = RLSpec(algorithm="dapo", kl_coef=0.05, tis_cap=2.0)
    logp, old, sampler, ref, adv, mask, truncated = _inputs(int(torch.randint(0, 2**31, ()).item()))
    pad = mask == 0
    pad[1] = True  # a truncated row, masked whole
    junk = [x.masked_fill(pad, v) for x, v in ((old, float("nan")), (sampler, float("-inf")), (ref, float("inf")))]
    a = logp.clone().requires_grad_(True)
    b = logp.masked_fill(pad, float("-inf")).requires_grad_(True)
    la, _ = policy_loss(a, old, adv, mask, spec, sampler_logp=sampler, ref_logp=ref, truncated=truncated)
    lb, stats = policy_loss(b, *junk[:1], adv, mask, spec, sampler_logp=junk[1], ref_logp=junk[2], truncated=truncated)
    la.backward()
    lb.backward()
    assert torch.isfinite(lb) and lb.item() == pytest.approx(la.item(), rel=1e-12)
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
    assert all(math.isfinite(v) for v in stats.values())


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), RLSpec())


@pytest.mark.parametrize("std_normalize", [True, False])
def test_group_advantages_match_reference(std_normalize):
    G, N = 4, 5
    rewards = torch.rand(N * G, dtype=torch.float64)
    rewards[8:12] = 0.7  # one group without variance
    adv, zero_var = group_advantages(rewards, G, std_normalize=std_normalize, eps=1e-4)
    r = rewards.tolist()
    for n in range(N):
        grp = r[n * G:(n + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        for k in range(G):
            want = (grp[k] - mean) / (std + 1e-4) if std_normalize else grp[k] - mean
            assert adv[n * G + k].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert zero_var.tolist() == [False, False, True, False, False]
    assert (adv[8:12] == 0).all()


def test_keep_groups_follows_dynamic_sampling():
    zero_var = torch.tensor([False, True, False])
    assert keep_groups(zero_var, 2, RLSpec(algorithm="dapo")).tolist() == [True, True, False, False, True, True]
    assert keep_groups(zero_var, 2, RLSpec(algorithm="grpo")).all()


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(7), 4, std_normalize=True, eps=1e-4)
