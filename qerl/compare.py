"""`qerl jobs compare`: jobs side by side, their settings and what they reached, for choosing
among the runs of a sweep. Pure functions over the API's job and metrics objects."""
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


def _duration(job: dict[str, Any]) -> str:
    start, end = (job.get("qerl") or {}).get("started_at"), job.get("finished_at")
    if not start or not end or end < start:
        return "-"
    s = int(end - start)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def results(job: dict[str, Any], metrics: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """What a job reached: its steps and time, the training reward of its first and last step, the
    held-out accuracy and reward from its first evaluation (before training) to its last, and the
    rollouts' mean speed."""
    p = (job.get("qerl") or {}).get("progress") or {}
    speeds = [v for m in metrics if (v := _number(m["values"], "rollout_tokens_per_s")) is not None]
    return [
        ("status", job.get("status", "")),
        ("steps", f"{p.get('step', 0)}/{p.get('total_steps', 0)}"),
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
