"""A job's settings and what it reached, as lines: `qerl jobs get` prints the settings, `qerl jobs
compare` both for jobs side by side (choosing among the runs of a sweep). Pure functions over the
API's job and metrics objects."""
from __future__ import annotations

import math
from typing import Any, Sequence

Row = tuple[str, list[str]]


def _number(values: dict[str, Any], key: str) -> float | None:
    v = values.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _first_last(metrics: Sequence[dict[str, Any]], key: str, digits: int) -> str:
    """``first -> last`` of a metric over the steps that report it (``-`` where none does)."""
    seen = [(m["step"], v) for m in metrics if (v := _number(m["values"], key)) is not None]
    if not seen:
        return "-"
    (a_step, a), (b_step, b) = seen[0], seen[-1]
    if len(seen) == 1:
        return f"{a:.{digits}f} (step {a_step})"
    return f"{a:.{digits}f} -> {b:.{digits}f} (steps {a_step}-{b_step})"


def steps_done(job: dict[str, Any], unit: str = "") -> str:
    """``step/total_steps``, and why a succeeded job has fewer (early_stop_patience ended it)."""
    p = (job.get("qerl") or {}).get("progress") or {}
    early = " (stopped early)" if p.get("stopped_early") else ""
    return f"{p.get('step', 0)}/{p.get('total_steps', 0)}{unit}{early}"


def _duration(job: dict[str, Any]) -> str:
    start, end = (job.get("qerl") or {}).get("started_at"), job.get("finished_at")
    if not start or not end or end < start:
        return "-"
    s = int(end - start)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def settings(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """A job's training settings in a few lines (its spec, as the worker runs it): `qerl jobs get`
    prints them and the dashboard's Settings panel shows the same."""
    if not spec:
        return []
    rl, lora, optim, r, aqn, data = (spec.get(k) or {} for k in ("rl", "lora", "optim", "rollout", "aqn", "data"))
    grader = spec.get("grader") or {}
    held = data.get("eval_size", 0)
    if data.get("validation_file"):
        evaluation = f"{held} rows of the validation file"
    else:
        evaluation = f"{held} held-out prompts" if held else "none held out"
    if held or data.get("validation_file"):
        every = spec.get("eval_interval") or 0
        evaluation += f", every {every} steps" if every else ", at the start and the end"
    kl, patience = rl.get("kl_coef") or 0, spec.get("early_stop_patience") or 0
    return [
        ("algorithm", f"{rl.get('algorithm', '')}" + (f", KL {kl:g}" if kl else "")),
        ("LoRA", f"r={lora.get('r')}, alpha={lora.get('alpha', 0):g}" + (", rsLoRA" if lora.get("use_rslora") else "")),
        ("learning rate", f"{optim.get('lr', 0):g} ({optim.get('schedule', '')}, warmup {optim.get('warmup_ratio', 0):g})"),
        ("rollouts", f"{spec.get('prompts_per_step')} prompts x {r.get('num_generations')} samples a step, up to "
                     f"{r.get('max_new_tokens')} tokens, temperature {r.get('temperature', 1):g}"),
        ("AQN", f"sigma {aqn.get('sigma_start', 0):g} -> {aqn.get('sigma_end', 0):g} in {aqn.get('stages')} stages"
                if aqn.get("enabled") else "off"),
        ("evaluation", evaluation),
        ("early stop", f"after {patience} evaluations without a higher held-out reward" if patience else "off"),
        ("grader", f"{grader.get('type', '')} {grader.get('name', '')}".strip()),
    ]


def results(job: dict[str, Any], metrics: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """What a job reached: its steps and time, the training reward of its first and last step, the
    held-out accuracy and reward from its first evaluation (before training) to its last, and the
    rollouts' mean speed."""
    speeds = [v for m in metrics if (v := _number(m["values"], "rollout_tokens_per_s")) is not None]
    return [
        ("status", job.get("status", "")),
        ("steps", steps_done(job)),
        ("time", _duration(job)),
        ("reward", _first_last(metrics, "reward_mean", 3)),
        ("held-out accuracy", _first_last(metrics, "eval/accuracy", 3)),
        ("held-out reward", _first_last(metrics, "eval/reward_mean", 3)),
        ("rollout tokens/s", f"{sum(speeds) / len(speeds):.0f}" if speeds else "-"),
    ]


def side_by_side(columns: Sequence[list[tuple[str, str]]]) -> list[Row]:
    """Rows of (name, one value per column) in the first column's order; a name some column lacks
    gets '-' there."""
    names: list[str] = []
    for col in columns:
        names += [k for k, _ in col if k not in names]
    by = [dict(col) for col in columns]
    return [(name, [c.get(name, "-") for c in by]) for name in names]
