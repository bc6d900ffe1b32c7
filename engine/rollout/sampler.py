"""Next-token sampling: temperature, top-k, top-p, and the log-prob the learner must match.

The returned log-prob is log softmax(logits / T) at the sampled token: the temperature-scaled
distribution without the top-k/top-p truncation, which is exactly what the learner computes
(``CausalLM.token_logprobs(temperature=T)``), so the importance ratio pi_learner / pi_sampler
measures only the numeric mismatch (noise, kernels, precision) and is 1 when there is none.
With top-k/top-p on, the truncated mass is not reflected. Greedy (T = 0) reports T = 1
log-probs, as the learner does for temperature <= 0.
"""
from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) fp32 -> (tokens (B,) long, logprobs (B,) fp32)."""
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
    filtered = scaled
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # (B, 1)
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(filtered, dim=-1), dim=-1, descending=True)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # mass before this token already >= p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    dev = generator.device if generator is not None else probs.device
    tokens = torch.multinomial(probs.to(dev), 1, generator=generator).to(probs.device).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
