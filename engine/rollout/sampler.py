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

# CUDA logits (fp32) without top-k / top-p are sampled by one kernel (fused_decode.cu) where it
# builds: the same draws from the generator, the argmax taken in logs (see sample_next).
FUSED = True


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None,
                tokens_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) fp32 -> (tokens (B,) long, logprobs (B,) fp32); ``tokens_into[:B]`` (if given)
    gets the tokens too.

    A token is drawn as argmax(p / q) over the (unnormalised) probabilities p with q ~ Exp(1)
    from ``generator``, which picks token i with probability p_i / sum(p) (torch.multinomial
    draws one sample the same way, after validity checks that cost four more reductions); the
    log-prob is (x_i - max) - log(sum(exp(x - max))), log_softmax's formula, at the drawn token.
    With only temperature on, exp(x - max) serves both, so a step runs no softmax over the
    vocabulary (one block per row there: ~35 us per softmax at batch 1 for a 152k vocabulary).
    On an sm_90 GPU (``FUSED``) that case is one kernel after the draws: argmax(x / T - log q),
    the same argmax in logs (ties and last-bit roundings aside), and the log-prob from one pass."""
    if (FUSED and logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[0] > 0
            and logits.stride(1) == 1 and not _truncates(top_k, top_p, logits.shape[-1])):
        from engine.rollout.fused_ops import cuda_ops

        ops = cuda_ops(logits.device)
        if ops is not None:
            q = None if temperature <= 0 else _exponential(logits.shape, logits.device, generator)
            return ops.sample(logits, q, temperature if temperature > 0 else 1.0, tokens_into)
    tokens, lp = _sample_torch(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
    if tokens_into is not None:
        tokens_into[:tokens.shape[0]].copy_(tokens)
    return tokens, lp


def _truncates(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether top-k or top-p drops any token of a ``vocab``-wide row."""
    return 0 < top_k < vocab or top_p < 1.0


def _exponential(shape: torch.Size, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) draws of ``shape`` from ``generator`` (on its own device), on ``device``."""
    dev = generator.device if generator is not None else device
    return torch.empty(shape, device=dev).exponential_(generator=generator).to(device)


def _sample_torch(logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_next in torch ops (any device, top-k and top-p too)."""
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
        return tokens, _logprob_at(logits - logits.amax(dim=-1, keepdim=True), None, tokens)
    scaled = logits / temperature
    shifted = scaled - scaled.amax(dim=-1, keepdim=True)
    exp = shifted.exp()
    weights = exp
    if _truncates(top_k, top_p, scaled.shape[-1]):
        filtered = scaled
        if 0 < top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # (B, 1)
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if top_p < 1.0:
            probs, order = torch.sort(torch.softmax(filtered, dim=-1), dim=-1, descending=True)
            drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # mass before this token already >= p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            filtered = filtered.masked_fill(drop, float("-inf"))
        weights = exp.masked_fill(filtered == float("-inf"), 0.0)
    q = _exponential(weights.shape, weights.device, generator)
    tokens = (weights / q).argmax(dim=-1)
    return tokens, _logprob_at(shifted, exp, tokens)


def _logprob_at(shifted: torch.Tensor, exp: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax of ``shifted`` (x - max per row; ``exp`` its exp, if made) at ``tokens``."""
    total = (shifted.exp() if exp is None else exp).sum(dim=-1)
    return shifted.gather(-1, tokens[:, None]).squeeze(-1) - total.log()
