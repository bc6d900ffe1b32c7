"""A succeeded job's results file: OpenAI's ``result_files``, a CSV of every step's metrics
(``step_metrics.csv``, purpose ``fine-tune-results``), read with the Files API; an evaluation's,
every test row's answers and rewards as JSON lines (``evaluation_rows.jsonl``)."""
from __future__ import annotations

import csv
import io
from collections.abc import Sequence

from service.models import JobMetric

RESULTS_PURPOSE = "fine-tune-results"
RESULTS_FILENAME = "step_metrics.csv"
EVAL_ROWS_FILENAME = "evaluation_rows.jsonl"


def step_metrics_csv(rows: Sequence[JobMetric]) -> bytes:
    """``step`` then every metric name that any step reported, sorted (``eval/*`` only on the
    steps that evaluated); a step without a value leaves its cell empty."""
    names = sorted({k for r in rows for k in r.values if k != "step"})
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *names])
    for r in rows:
        writer.writerow([r.step, *(_cell(r.values.get(k)) for k in names)])
    return out.getvalue().encode()


def _cell(value: object) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)
