"""AQN: the staged exponential sigma schedule and fp32 channel noise on norms."""
from __future__ import annotations

import math

import pytest
import torch

from engine.rl.aqn import apply_noise, clear_noise, sigma_for_step, stage_for_step
from engine.spec import AQNSpec


class StandInNorm(torch.nn.Module):
    """Just what AQN touches: a weight (bf16, as in the model) and a ``noise`` slot."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h, dtype=torch.bfloat16))
        self.noise = None


def test_schedule_values_follow_the_paper():
    spec = AQNSpec(sigma_start=1e-2, sigma_end=1e-4, stages=10)
    total = 100
    sigmas = [sigma_for_step(s, total, spec) for s in range(total)]
    assert sigmas[:10] == [0.0] * 10  # stage 0 is noise-free
    for k in range(1, 10):
        want = 1e-2 * (1e-4 / 1e-2) ** ((k - 1) / 8)
        assert sigmas[10 * k: 10 * k + 10] == pytest.approx([want] * 10, rel=1e-12)
    assert sigmas[10] == pytest.approx(1e-2) and sigmas[-1] == pytest.approx(1e-4)
    # geometric: each stage is the same factor below the last
    ratios = [sigmas[10 * (k + 1)] / sigmas[10 * k] for k in range(1, 9)]
    assert ratios == pytest.approx([ratios[0]] * 8) and ratios[0] == pytest.approx(10 ** (-2 / 8))


def test_stages_on_uneven_runs_and_edge_cases():
    assert [stage_for_step(s, 7, 3) for s in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    assert stage_for_step(50, 7, 3) == 2  # past the end stays in the last stage
    spec2 = AQNSpec(sigma_start=3e-3, sigma_end=1e-4, stages=2)
    assert [sigma_for_step(s, 4, spec2) for s in range(4)] == [0.0, 0.0, 3e-3, 3e-3]
    off = AQNSpec(enabled=False)
    assert all(sigma_for_step(s, 10, off) == 0.0 for s in range(10))
    few = AQNSpec(stages=10)  # fewer steps than stages: equal stages, some skipped, still non-increasing
    got = [sigma_for_step(s, 3, few) for s in range(3)]
    assert got[0] == 0.0 and got[1] >= got[2] > 0


def test_noise_is_fp32_channel_vector_with_sigma_std():
    h = 4096
    norms = [StandInNorm(h) for _ in range(3)]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    sigma = 3e-3
    apply_noise(norms, sigma, gen)
    for norm in norms:
        assert norm.noise.dtype == torch.float32 and norm.noise.shape == (h,)
        assert norm.noise.device == norm.weight.device
        std = norm.noise.std().item()
        assert abs(std - sigma) < 4 * sigma / math.sqrt(2 * h)  # ~4 standard errors of a sample std
        assert abs(norm.noise.mean().item()) < 4 * sigma / math.sqrt(h)
        assert norm.noise.abs().min().item() < 4e-3  # below bf16's resolution near 1: kept because fp32
    assert not torch.equal(norms[0].noise, norms[1].noise)  # independent per norm
    first = [n.noise.clone() for n in norms]
    apply_noise(norms, sigma, gen)
    assert not torch.equal(first[0], norms[0].noise)  # resampled per call
    assert all(n.weight.dtype == torch.bfloat16 and torch.all(n.weight == 1) for n in norms)  # weight untouched


def test_noise_is_reproducible_from_the_generator_and_clears():
    norms = [StandInNorm(64), StandInNorm(64)]
    apply_noise(norms, 1e-2, torch.Generator().manual_seed(7))
    a = [n.noise.clone() for n in norms]
    apply_noise(norms, 1e-2, torch.Generator().manual_seed(7))
    assert all(torch.equal(x, n.noise) for x, n in zip(a, norms))
    apply_noise(norms, 0.0, torch.Generator())
    assert all(n.noise is None for n in norms)
    apply_noise(norms, 1e-2, torch.Generator())
    clear_noise(norms)
    assert all(n.noise is None for n in norms)
