"""What the training loop reports, defined in one place.

Per rollout step (``Reporter.metrics``), over all G samples of all prompts of the step:

    reward_mean, reward_std      grader score (population std)
    reward/<part>                mean of each named part the grader returns (e.g. format, answer)
    accuracy                     share of samples whose answer got full credit (``is_correct``)
    completion_len_mean          generated tokens per sample
    truncated_frac               share of samples cut by max_new_tokens (finish_reason "length")
    zero_var_frac                share of prompt groups whose G rewards are all equal
    entropy                      mean token entropy of the learner on the trained tokens
    kl_ref                       token-mean k3 KL(learner || reference with LoRA off), when
                                 rl.kl_coef > 0 (0 otherwise)
    kl_sampler                   token-mean k3 KL(sampler || learner before the update): the
                                 rollout/learner mismatch (AQN noise, kernels, precision)
    kl                           kl_ref when a reference is computed, else kl_sampler
    clip_frac(_low/_high), ratio_mean, tis_frac, loss, grad_norm
                                 from the last update of the step (grad norm before clipping,
                                 tis_frac = share of tokens whose importance weight was capped)
    lr                           learning rate used by that update
    aqn_sigma                    noise std on the norms during the rollout
    rollout_tokens_per_s, rollout_s   generated tokens / rollout seconds; rollout seconds
    grade_s                      seconds the grader took over the step's samples (a judge model's
                                 requests, python graders' sandboxes)
    judge_tokens                 prompt + completion tokens a model grader's judge reported using
                                 for the step (only with model graders whose judge reports usage)
    step_s, peak_memory_mb       wall time of the step; peak CUDA allocation since the job started, or process max RSS
    updates_skipped              1 when every group was dropped and no update ran (the update
                                 keys above are then absent)
    trained_tokens               completion tokens trained on so far (cumulative)

Evaluation (``eval/`` prefix): greedy decoding with the adapter, no AQN noise, on the eval split:
``eval/reward_mean``, ``eval/accuracy``, ``eval/completion_len_mean``, ``eval/truncated_frac``.

Samples (``Reporter.samples(step, kind, rows)``, kind "train" or "eval"): the first ``log_samples``
of a step's samples (prompt-major: the first prompt's group first) and of an evaluation's greedy
completions, each with its prompt, completion, reward and the grader's named scores.
"""
from __future__ import annotations

import math
import resource
import sys
from typing import Any, Iterable

import torch


def is_correct(score: float, parts: dict[str, float], grader: Any) -> bool:
    """Full credit for the answer.

    Graders that name an answer part (``grader.answer_part``, or a part called "answer" /
    "correct") are judged on that part reaching its maximum (1.0); format-only credit does not
    count. Otherwise the whole score must reach ``grader.max_score`` (default 1.0)."""
    key = getattr(grader, "answer_part", None)
    if key is None:
        key = next((k for k in ("answer", "correct", "accuracy") if k in parts), None)
    if key is not None and key in parts:
        return parts[key] >= 1.0 - 1e-6
    top = float(getattr(grader, "max_score", 1.0) or 1.0)
    return score >= top - 1e-6


def mean(values: Iterable[float]) -> float:
    vals = list(values)
    return float(sum(vals) / len(vals)) if vals else 0.0


def std(values: Iterable[float]) -> float:
    vals = list(values)
    if not vals:
        return 0.0
    mu = mean(vals)
    return math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))


def sample_metrics(scores: list[float], parts: list[dict[str, float]], correct: list[bool],
                   lengths: list[int], truncated: list[bool], prefix: str = "") -> dict[str, float]:
    """Reward, accuracy and length statistics of a set of graded samples."""
    out = {
        f"{prefix}reward_mean": mean(scores),
        f"{prefix}reward_std": std(scores),
        f"{prefix}accuracy": mean(float(c) for c in correct),
        f"{prefix}completion_len_mean": mean(float(n) for n in lengths),
        f"{prefix}truncated_frac": mean(float(t) for t in truncated),
    }
    for key in sorted({k for p in parts for k in p}):
        out[f"{prefix}reward/{key}"] = mean(p.get(key, 0.0) for p in parts)
    return out


class UpdateStats:
    """Token-weighted means of the per-micro-batch loss statistics of one optimizer update."""

    _WEIGHTED = ("clip_frac", "clip_frac_low", "clip_frac_high", "kl", "ratio_mean", "tis_frac")

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.tokens = 0.0
        self.loss = 0.0

    def add(self, stats: dict[str, float], mask: torch.Tensor, entropy: torch.Tensor, learner_logp: torch.Tensor,
            sampler_logp: torch.Tensor) -> None:
        """``stats`` from policy_loss; mask, entropy, learner (old) and sampler log-probs (b, t-1)."""
        n = stats["tokens"]
        self.tokens += n
        self.loss += stats["loss"]  # each micro-batch loss already carries the whole batch's denominator
        d = (learner_logp - sampler_logp).clamp(-20, 20)  # log pi_learner / pi_sampler on sampled tokens
        k3 = torch.exp(d) - d - 1.0  # KL(sampler || learner), k3 estimator
        sums = {"entropy": float((entropy * mask).sum()), "kl_sampler": float((k3 * mask).sum())}
        for key in self._WEIGHTED:
            sums[key] = stats.get(key, 0.0) * n
        for key, v in sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + v

    def result(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        out = {k: v / n for k, v in self.sums.items()}
        out["kl_ref"] = out.pop("kl", 0.0)
        out.update(loss=self.loss, tokens=self.tokens)
        return out


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by torch on a GPU (engine.train_loop resets it as a job starts);
    the process's max resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


SAMPLE_CHARS = 4096  # a reported prompt or completion is cut to this many characters (the end kept for prompts)


def sample_rows(tokenizer: Any, prompts: list[list[int]], completions: list[Any], scores: list[float],
                parts: list[dict[str, float]], limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` samples as the service stores them (``Reporter.samples``)."""
    rows = []
    for i in range(min(limit, len(completions))):
        prompt = tokenizer.decode(prompts[i])
        c = completions[i]
        rows.append({"index": i, "prompt": prompt[-SAMPLE_CHARS:], "completion": c.text[:SAMPLE_CHARS],
                     "reward": float(scores[i]), "scores": {k: float(v) for k, v in parts[i].items()},
                     "finish_reason": c.finish_reason, "tokens": len(c.token_ids)})
    return rows


def report_samples(reporter: Any, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
    """``reporter.samples(step, kind, rows)`` where the reporter takes samples (it is optional)."""
    take = getattr(reporter, "samples", None)
    if rows and take is not None:
        take(step, kind, rows)
