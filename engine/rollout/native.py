"""Native batched sampler on CausalLM's KV cache (token ids in, token ids out).

Prompts are sorted by length and decoded in sub-batches of ``max_batch``; each sub-batch is
left-padded, prefilled once, then decoded one token per step for all live rows. A row ends
on an eos id (kept as its last token), on a stop string (text cut after it, later tokens
dropped) or at ``max_new_tokens``; finished rows leave the cache, so the rest decode
cheaper. ``should_stop()`` is polled before each sub-batch and between decode steps: then
every unfinished row ends "cancelled" with what it has, and prompts not started come back
empty and "cancelled". The model runs in eval mode (no LoRA dropout) with whatever AQN
noise is set on its norms.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.rollout.batching import Rows, check_prompts, eos_ids, left_pad, sub_batches
from engine.rollout.dense import dequantized_base
from engine.rollout.params import Completion, SamplingParams
from engine.rollout.sampler import sample_next


def generate(model, tokenizer, prompts: list[list[int]], params: SamplingParams, *,
             generator: torch.Generator | None = None, should_stop: Callable[[], bool] | None = None,
             max_batch: int = 64, dense_base: bool | None = None) -> list[Completion]:
    """One Completion per prompt, in prompt order. ``dense_base`` (default: on for CPU models)
    dequantizes the base once for the whole rollout (engine.rollout.dense)."""
    check_prompts(prompts, max_batch)
    eos = eos_ids(model, tokenizer, params)
    stop = should_stop or (lambda: False)
    was_training = model.training
    model.eval()
    dense = model.device.type == "cpu" if dense_base is None else dense_base
    try:
        with dequantized_base(model, dense):
            return sub_batches(prompts, max_batch, stop,
                               lambda batch: _generate_batch(model, tokenizer, batch, params, eos, generator, stop))
    finally:
        model.train(was_training)


@torch.inference_mode()
def _generate_batch(model, tokenizer, prompts: list[list[int]], params: SamplingParams, eos: set[int],
                    generator: torch.Generator | None, stop: Callable[[], bool]) -> tuple[list[Completion], bool]:
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    cache = model.new_cache(len(prompts), ids.shape[1] + params.max_new_tokens)
    hidden = model(ids.to(model.device), mask.to(model.device), cache)[:, -1]  # (B, H)
    rows = Rows(tokenizer, params, eos, len(prompts))
    cancelled = False
    for _ in range(params.max_new_tokens):
        logits = model.logits(hidden).float()  # (b_live, V)
        nxt, lp = sample_next(logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                              generator=generator)
        keep = rows.record(nxt, lp)
        if not keep:
            break
        if stop():
            cancelled = True
            rows.cancel(keep)
            break
        if len(keep) < len(rows.live):
            sel = torch.tensor(keep, device=nxt.device)
            cache.keep(sel)
            nxt = nxt.index_select(0, sel)
            rows.live = [rows.live[j] for j in keep]
        hidden = model(nxt[:, None], None, cache)[:, -1]
    return rows.completions(prompts), cancelled
