"""AdamW settings, the warmup + decay schedule, grad clipping and state_dict round trips."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from engine.optim import build_optimizer, build_scheduler, clip_grad_norm, lr_factor, uses_eight_bit
from engine.spec import OptimSpec


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def test_optimizer_is_adamw_with_spec_settings():
    spec = OptimSpec(lr=2e-5, betas=(0.9, 0.99), weight_decay=0.1)
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    opt = build_optimizer(_params() + [frozen], spec, "cpu")
    assert isinstance(opt, torch.optim.AdamW)
    (group,) = opt.param_groups
    assert group["lr"] == 2e-5 and group["betas"] == (0.9, 0.99) and group["weight_decay"] == 0.1
    assert len(group["params"]) == 2  # frozen parameters are left out
    assert not uses_eight_bit(OptimSpec(), "cpu")


def test_eight_bit_on_cpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="optim.eight_bit"):
        build_optimizer(_params(), OptimSpec(eight_bit=True), "cpu")


def test_no_trainable_parameters_is_an_error():
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], OptimSpec(), "cpu")


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_shape(schedule):
    spec = OptimSpec(lr=1e-3, warmup_ratio=0.1, schedule=schedule)
    total = 30
    opt = build_optimizer(_params(), spec, "cpu")
    sched = build_scheduler(opt, spec, total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    warm = 3
    assert lrs[:warm] == pytest.approx([1e-3 * (s + 1) / warm for s in range(warm)])
    for s in range(warm, total):
        p = (s - warm) / (total - warm)
        want = {"cosine": 0.5 * (1 + math.cos(math.pi * p)), "linear": 1 - p, "constant": 1.0}[schedule]
        assert lrs[s] == pytest.approx(1e-3 * want)
    if schedule != "constant":
        assert all(a >= b for a, b in zip(lrs[warm - 1:], lrs[warm:]))  # non-increasing after warmup
        assert 0 < lrs[-1] < 1e-3 * 0.1


def test_no_warmup_starts_at_full_rate():
    assert lr_factor(0, 10, OptimSpec(warmup_ratio=0.0)) == 1.0


def test_state_dict_round_trip_continues_identically():
    spec = OptimSpec(lr=1e-2, warmup_ratio=0.2)
    total = 12

    def run(params, opt, sched, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            sched.step()

    params = _params(1)
    opt = build_optimizer(params, spec, "cpu")
    sched = build_scheduler(opt, spec, total)
    run(params, opt, sched, 4, seed=0)
    saved = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict()))
    run(params, opt, sched, 4, seed=1)
    want = [p.detach().clone() for p in params]

    params2 = [torch.nn.Parameter(p.clone()) for p in saved[0]]
    opt2 = build_optimizer(params2, spec, "cpu")
    sched2 = build_scheduler(opt2, spec, total)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_factor(4, total, spec) * 1e-2)
    run(params2, opt2, sched2, 4, seed=1)
    for a, b in zip(want, params2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_clip_grad_norm_returns_pre_clip_norm():
    params = _params(2)
    g = torch.Generator().manual_seed(3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 5
    want = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    norm = clip_grad_norm(params, 0.2)
    assert norm == pytest.approx(want, rel=1e-5)
    after = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    assert after == pytest.approx(0.2, rel=1e-4)
    assert clip_grad_norm(params, 0.0) == pytest.approx(after, rel=1e-5)  # 0: measure only
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0) == 0.0  # no grads yet
