"""Held-out evaluation: greedy decoding with the adapter attached and no AQN noise.

Each eval prompt gets one greedy (temperature 0) completion, graded in full by the job's
grader, so the number measures the policy the user downloads rather than the noisy sampler
the run explores with.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from engine.metrics import is_correct, sample_metrics, sample_rows
from engine.rl.aqn import clear_noise


def evaluate(model: Any, tokenizer: Any, prompts: list[list[int]], items: list[dict[str, Any]], grader: Any,
             sampling: Any, *, max_batch: int = 64, should_stop: Callable[[], bool] | None = None,
             samples: list[dict[str, Any]] | None = None, keep: int = 0) -> dict[str, float] | None:
    """``eval/*`` metrics (see engine.metrics), or None when ``should_stop`` cut decoding short;
    the first ``keep`` completions are appended to ``samples`` (engine.metrics.sample_rows)."""
    if not prompts:
        return {}
    completions = greedy_completions(model, tokenizer, prompts, sampling, max_batch=max_batch, should_stop=should_stop)
    if completions is None:
        return None
    scores, parts, correct = grade(grader, completions, items)
    if samples is not None and keep:
        samples.extend(sample_rows(tokenizer, prompts, completions, scores, parts, keep))
    return metrics_of(completions, scores, parts, correct)


def greedy_completions(model: Any, tokenizer: Any, prompts: list[list[int]], sampling: Any, *, max_batch: int = 64,
                       should_stop: Callable[[], bool] | None = None) -> list[Any] | None:
    """One greedy completion per prompt from the model as it is (its LoRA attached unless disabled),
    without AQN noise; None when ``should_stop`` cut decoding short."""
    from engine.rollout.backend import native_generate

    greedy = dataclasses.replace(sampling, temperature=0.0, top_p=1.0, top_k=0)
    clear_noise(model.aqn_norms())
    generator = torch.Generator(device="cpu").manual_seed(0)  # unused by greedy decoding; never the run's
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            completions = native_generate(model, tokenizer, prompts, greedy, generator=generator,
                                          should_stop=should_stop, max_batch=max_batch)
    finally:
        model.train(was_training)
    return None if any(c.finish_reason == "cancelled" for c in completions) else completions


def metrics_of(completions: list[Any], scores: list[float], parts: list[dict[str, float]],
               correct: list[bool]) -> dict[str, float]:
    """The ``eval/*`` metrics of graded completions."""
    return sample_metrics(scores, parts, correct, [len(c.token_ids) for c in completions],
                          [c.finish_reason == "length" for c in completions], prefix="eval/")


def examples_problem(grader: Any, examples: list[Any], where: str) -> str | None:
    """Why ``grader`` cannot score every one of ``examples`` (engine.data.load.Example; ``where``
    names their file in the message), or None: a row without an item field the grader reads (it
    would fail at its first such row, mid-run), or without what one of its graders checks (a
    reasoning_gym grader without a task: a task the row names)."""
    from engine.data.jsonl import field_counts, missing_item_fields
    from engine.rewards.multi import leaves

    needed = grader.item_fields
    counts = field_counts(ex.item for ex in examples)
    if counts is None:  # free-form keys: count only what the grader reads
        counts = {name: sum(name in ex.item for ex in examples) for name in needed}
    first: dict[str, int] = {}
    for ex in examples:
        for name in needed:
            if name not in ex.item and ex.line is not None:
                first[name] = min(first.get(name, ex.line), ex.line)
    problem = missing_item_fields(needed, counts, len(examples), where, first) if needed else None
    if problem:
        return problem
    graders = list(leaves(grader))
    for k, ex in sorted(enumerate(examples), key=lambda kx: (kx[1].line or 0, kx[0])):  # file order
        problem = next(filter(None, (g.check_item(ex.item) for g in graders)), None)
        if problem:
            return f"{where} {f'line {ex.line}' if ex.line is not None else f'row {k + 1}'}: {problem}"
    return None


def grade(grader: Any, completions: list[Any], items: list[dict[str, Any]]
          ) -> tuple[list[float], list[dict[str, float]], list[bool]]:
    """(scores, parts, correct) per completion; a row the grader cannot read is a dataset error."""
    from engine.types import TrainError

    scores, parts, correct = [], [], []
    try:
        graded = grader.batch([c.text for c in completions], items)
    except TrainError:  # the grader's own failure (grader_error: a python grader's code, a judge model): as it is
        raise
    except ValueError as exc:
        raise TrainError("invalid_dataset", str(exc)) from None
    for score, p in graded:
        if not math.isfinite(float(score)):  # would turn every advantage and the adapter into NaN
            raise TrainError("grader_error", f"the grader {getattr(grader, 'name', '')!r} returned {score} for a "
                                             f"sample (parts {p}); keep its output finite (calculate_output's "
                                             "constants well below 1e308, a python grader's return value)")
        scores.append(float(score))
        parts.append({k: float(v) for k, v in p.items()})
        correct.append(is_correct(float(score), p, grader))
    return scores, parts, correct
