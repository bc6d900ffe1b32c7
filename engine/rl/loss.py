"""Clipped policy-gradient loss for GRPO, DAPO and Dr.GRPO, chosen by ``RLSpec``.

Per completion token t of sequence i (shapes (B, T), only tokens with mask 1 count):

    ratio   = exp(logp - old_logp)
    pg      = -min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)   # asymmetric clip (DAPO)
    kl      = exp(ref - logp) - (ref - logp) - 1                                  # k3 estimator, >= 0
    w       = min(exp(old_logp - sampler_logp), tis_cap), detached               # truncated IS
    l_it    = w * (pg + kl_coef * kl)

The weight w corrects for the tokens being drawn by the sampler (noisy AQN weights, other
kernels, an older adapter) rather than by the learner's ``old_logp`` policy; it multiplies the
whole per-token term because the KL estimate is taken over the same samples. ``tis_cap`` 0 or
no ``sampler_logp`` turns it off. The KL term is on only when ``kl_coef`` > 0 and a reference
is given (QeRL runs without it); with a reference and ``kl_coef`` 0 it is still reported.

Aggregation (``spec.loss_agg``):
    token_mean   (DAPO)    sum_it l_it / number of counted tokens
    seq_mean     (GRPO)    mean over sequences of (sum_t l_it / tokens of i)
    seq_sum_norm (Dr.GRPO) sum_it l_it / (B * L), L a constant length (the generation budget)

Truncated completions (``truncated`` (B,) bool, finish_reason "length") get zero weight when
``spec.mask_truncated``: they drop out of numerator and denominator alike. With micro-batches,
pass ``denominator`` = ``loss_denominator`` of the whole rollout batch so that the summed
micro-batch gradients equal the full-batch gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.spec import RLSpec

_KL_LOG_CLAMP = 20.0  # keeps exp(ref - logp) finite when the policies drift far apart


def effective_mask(mask: Tensor, spec: RLSpec, truncated: Tensor | None = None) -> Tensor:
    """(B, T) fp32 weights of the tokens that count: ``mask`` minus truncated rows when masked."""
    m = mask.float()
    if spec.mask_truncated and truncated is not None:
        m = m * (~truncated.bool()).float()[:, None]
    return m


def loss_denominator(mask: Tensor, spec: RLSpec, *, truncated: Tensor | None = None,
                     max_len: int | None = None) -> float:
    """The aggregation's denominator over a whole rollout batch (see module docstring).

    ``max_len`` is Dr.GRPO's constant L (default: the mask's width T)."""
    m = effective_mask(mask, spec, truncated)  # (B, T)
    if spec.loss_agg == "token_mean":
        return float(m.sum())
    if spec.loss_agg == "seq_mean":
        return float((m.sum(dim=1) > 0).sum())
    return float(m.shape[0] * (max_len if max_len is not None else m.shape[1]))


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    spec: RLSpec,
    *,
    sampler_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    truncated: Tensor | None = None,
    denominator: float | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Return (scalar loss differentiable w.r.t. ``logp``, detached float stats).

    logp, old_logp, sampler_logp, ref_logp, mask: (B, T); advantages, truncated: (B,)."""
    if logp.shape != old_logp.shape or logp.shape != mask.shape or advantages.shape != logp.shape[:1]:
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
                         f"mask {tuple(mask.shape)}, advantages {tuple(advantages.shape)}")
    dt = torch.float64 if logp.dtype == torch.float64 else torch.float32  # fp32 at least
    m = effective_mask(mask, spec, truncated).to(dt)  # (B, T)
    valid = m > 0

    def counted(x: Tensor) -> Tensor:  # padding may hold -inf/NaN; keep it out of exp and its gradient
        return torch.where(valid, x.to(dt), torch.zeros((), dtype=dt, device=x.device))

    logp = counted(logp)
    old = counted(old_logp.detach())
    adv = advantages.detach().to(dt)[:, None]  # (B, 1)

    ratio = torch.exp(logp - old)  # (B, T)
    clipped = ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)  # (B, T)
    per_token = pg

    kl = None
    if ref_logp is not None:
        d = (counted(ref_logp.detach()) - logp).clamp(-_KL_LOG_CLAMP, _KL_LOG_CLAMP)
        kl = torch.exp(d) - d - 1.0  # (B, T)
        if spec.kl_coef > 0:
            per_token = per_token + spec.kl_coef * kl

    w = capped = None
    if sampler_logp is not None and spec.tis_cap > 0:
        raw = torch.exp(old - counted(sampler_logp.detach()))
        w = raw.clamp(max=spec.tis_cap)  # (B, T), detached: inputs are detached
        capped = (raw > spec.tis_cap).to(dt)
        per_token = per_token * w

    if denominator is None:
        denominator = loss_denominator(mask, spec, truncated=truncated, max_len=max_len)
    denom = max(float(denominator), 1.0)
    if spec.loss_agg == "seq_mean":
        per_seq = (per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # (B,)
        loss = per_seq.sum() / denom
    else:  # token_mean and seq_sum_norm differ only in the denominator
        loss = (per_token * m).sum() / denom

    stats = _stats(loss, pg, ratio, adv, kl, w, capped, m, spec)
    return loss, stats


def _stats(loss: Tensor, pg: Tensor, ratio: Tensor, adv: Tensor, kl: Tensor | None, w: Tensor | None,
           capped: Tensor | None, m: Tensor, spec: RLSpec) -> dict[str, float]:
    """Token-mean diagnostics, gathered with one device sync."""
    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        low = ((ratio < 1.0 - spec.eps_low) & (adv < 0)).to(m.dtype)
        high = ((ratio > 1.0 + spec.eps_high) & (adv > 0)).to(m.dtype)
        zero = torch.zeros((), device=m.device, dtype=m.dtype)
        values = {
            "loss": loss.detach(),
            "pg_loss": (pg.detach() * m).sum() / n,
            "ratio_mean": (ratio.detach() * m).sum() / n,
            "clip_frac_low": (low * m).sum() / n,
            "clip_frac_high": (high * m).sum() / n,
            "kl": (kl.detach() * m).sum() / n if kl is not None else zero,
            "tis_weight_mean": (w * m).sum() / n if w is not None else zero + 1.0,
            "tis_frac": (capped * m).sum() / n if capped is not None else zero,
            "tokens": m.sum(),
        }
        flat = torch.stack([v.to(m.dtype).reshape(()) for v in values.values()]).tolist()
    out = dict(zip(values, flat))
    out["clip_frac"] = out["clip_frac_low"] + out["clip_frac_high"]
    return out
