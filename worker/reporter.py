"""The engine's Reporter backed by the database, fenced by the job's attempt.

Each call is one short transaction that starts with ``queue.fence`` (so a reaped or
re-claimed attempt can write nothing) and raises ``LeaseLost`` when the fence fails; the
engine lets that propagate. Every write also notices a pending cancel or pause, so the runner
stops within one step even between heartbeats. A write that finds the database down (a
restart) is retried by ``retry`` (``LeaseKeeper.retry``: back-off while the lease lasts), so
the run waits out the outage instead of failing.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from engine.types import NO_UPDATE
from service import queue
from service.models import Checkpoint, Job, JobMetric, JobSample, new_id, utcnow
from service.storage import ArtifactStore, StoreUnavailable
from worker.artifacts import pack_checkpoint_adapter, push_workdir

log = logging.getLogger(__name__)

# Shown first in "Step 3/30: ..." events; the rest follow alphabetically.
_HEADLINE = ("reward", "reward_mean", "accuracy", "loss", "kl", "entropy", "clip_frac", "lr", "sigma")
_HEADLINE_MAX = 6


def clean_values(values: dict[str, Any]) -> dict[str, float | None]:
    """JSON-safe floats (tensors and numpy scalars to float; NaN/inf to None)."""
    out: dict[str, float | None] = {}
    for k, v in values.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        out[str(k)] = f if math.isfinite(f) else None
    return out


def _text(value: Any) -> str:
    """Text Postgres stores: a NUL (which a model can emit) becomes U+FFFD."""
    return str(value).replace("\x00", "\ufffd")


def step_message(step: int, total: int, values: dict[str, float | None]) -> str:
    keys = [k for k in _HEADLINE if k in values] + sorted(k for k in values if k not in _HEADLINE)
    parts = [f"{k}={values[k]:.4g}" if values[k] is not None else f"{k}=nan" for k in keys[:_HEADLINE_MAX]]
    return f"Step {step}/{total}: " + ", ".join(parts) + (f" ({NO_UPDATE})" if values.get("updates_skipped") else "")


class DBReporter:
    def __init__(self, sessions: Callable[[], Session], job_id: str, attempt: int, *, store: ArtifactStore,
                 total_steps: int, retry: Callable[[Callable[[], None], str], None],
                 on_status: Callable[[str], None] = lambda status: None,
                 keep_checkpoint_adapters: bool = False) -> None:
        self.sessions, self.job_id, self.attempt = sessions, job_id, attempt
        self.store, self.total_steps, self.on_status = store, total_steps, on_status
        self.retry, self.keep_checkpoint_adapters = retry, keep_checkpoint_adapters

    # -- the Reporter protocol --------------------------------------------------------------
    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        level = level if level in ("info", "warn", "error") else ("warn" if level == "warning" else "info")
        self._write(lambda s: queue.add_event(s, self.job_id, self.attempt, message, level=level, data=data),
                    "writing an event")

    def metrics(self, step: int, values: dict[str, float]) -> None:
        vals = clean_values(values)

        def write(s: Session) -> None:
            # The engine may report twice for one step (training, then evaluation): merge them.
            row = s.execute(select(JobMetric).where(JobMetric.job_id == self.job_id, JobMetric.step == step,
                                                    JobMetric.attempt == self.attempt)).scalar()
            if row is None:
                s.add(JobMetric(job_id=self.job_id, step=step, attempt=self.attempt, values=vals, created_at=utcnow()))
            else:
                row.values = {**row.values, **vals}
            progress: dict[str, Any] = {"step": step, "total_steps": self.total_steps}
            if vals.get("trained_tokens") is not None:
                progress["trained_tokens"] = int(vals["trained_tokens"])
            s.execute(update(Job).where(Job.id == self.job_id).values(**progress))
            if any(not k.startswith("eval") for k in vals):  # evaluations get the engine's own event
                queue.add_event(s, self.job_id, self.attempt, step_message(step, self.total_steps, vals),
                                type="metrics", data={"step": step, "total_steps": self.total_steps, **vals})

        self._write(write, f"writing the metrics of step {step}")

    def samples(self, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
        """A step's (or evaluation's) reported samples; a re-run of the step by this attempt replaces them."""
        def write(s: Session) -> None:
            s.execute(delete(JobSample).where(JobSample.job_id == self.job_id, JobSample.step == step,
                                              JobSample.kind == kind, JobSample.attempt == self.attempt))
            now = utcnow()
            s.add_all(JobSample(job_id=self.job_id, attempt=self.attempt, step=step, kind=kind, index=r["index"],
                                prompt=_text(r["prompt"]), completion=_text(r["completion"]),
                                reward=float(r["reward"]), scores=clean_values(r["scores"]),
                                finish_reason=str(r["finish_reason"])[:16], tokens=int(r["tokens"]), created_at=now)
                      for r in rows)

        self._write(write, f"writing the samples of step {step}")

    def checkpoint(self, step: int, path: Path, metrics: dict[str, float] | None = None) -> None:
        path = Path(path).resolve()
        try:
            rel = str(path.relative_to(self.store.root))
        except ValueError:  # outside the artifact store: keep it absolute rather than lose it
            rel = str(path)
        else:  # with a bucket, the checkpoint is there before its row names it
            if self.store.remote is not None:  # a fenced-out attempt must not touch the new one's copies
                self._write(lambda s: None, f"checking the lease before copying checkpoint step {step}")
            try:
                push_workdir(self.store, self.job_id, rel)
            except StoreUnavailable as exc:  # the job goes on; only this host can resume it from this step
                self.event("warn", f"Checkpoint step {step} could not be copied to the artifact bucket ({exc}); "
                                   "until a later one is, only this host can resume the job from it", {"step": step})
        vals = clean_values(metrics or {})
        row_id, kept = new_id("ftckpt"), None
        if self.keep_checkpoint_adapters:  # packed before the row names it; an orphan at worst
            kept = pack_checkpoint_adapter(path / "adapter", self.store, self.job_id, row_id)

        def write(s: Session) -> None:
            s.add(Checkpoint(id=row_id, job_id=self.job_id, attempt=self.attempt, step=step, path=rel, metrics=vals,
                             created_at=utcnow(), adapter_path=kept.path if kept else None,
                             adapter_bytes=kept.bytes if kept else None,
                             adapter_sha256=kept.sha256 if kept else None))

        try:
            self._write(write, f"recording the checkpoint of step {step}")
        except BaseException:
            if kept is not None:
                self.store.delete(kept.path)
            raise

    # -- plumbing ---------------------------------------------------------------------------
    def _write(self, fn: Callable[[Session], None], what: str) -> None:
        """Fence, write, commit: one transaction, retried whole while the database is down."""
        def attempt() -> None:
            with self.sessions() as s:
                self.on_status(queue.fence(s, self.job_id, self.attempt))
                fn(s)
                s.commit()

        self.retry(attempt, what)
