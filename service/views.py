"""ORM rows -> response schemas. Times become unix seconds (SQLite hands back naive UTC)."""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from service import models as m
from service import schemas as s

TERMINAL = ("succeeded", "failed", "cancelled")
ACTIVE = ("validating_files", "queued", "running", "cancelling", "pausing", "paused")  # not finished
DEFAULT_LR = 1e-5


def unix(dt: datetime | None) -> int | None:
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp())


def file_view(f: m.File) -> s.FileObject:
    return s.FileObject(id=f.id, bytes=f.bytes, created_at=unix(f.created_at) or 0, filename=f.filename,
                        purpose=f.purpose, status=f.status, qerl={"rows": f.rows, "prompts": f.prompts, "fields": f.fields, "sha256": f.sha256})


def event_id(event_pk: int) -> str:
    return f"ftevent-{event_pk}"


def parse_event_id(value: str | None) -> int | None:
    """``ftevent-12`` or ``12`` -> 12; anything else -> None."""
    if not value:
        return None
    tail = value.strip().removeprefix("ftevent-")
    return int(tail) if tail.isdigit() else None


def event_view(e: m.JobEvent) -> s.FineTuningJobEvent:
    return s.FineTuningJobEvent(id=event_id(e.id), created_at=unix(e.created_at) or 0, level=e.level,
                                message=e.message, type=e.type, data=e.data)


def _hyperparameters(spec: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    given = ((request.get("method") or {}).get("reinforcement") or {}).get("hyperparameters") \
        or request.get("hyperparameters") or {}
    optim, rollout = spec.get("optim", {}), spec.get("rollout", {})
    return {
        "batch_size": spec.get("prompts_per_step"),
        "learning_rate_multiplier": round(float(optim.get("lr", DEFAULT_LR)) / DEFAULT_LR, 6),
        "n_epochs": given.get("n_epochs", "auto"),
        "eval_interval": spec.get("eval_interval"),
        "eval_samples": spec.get("data", {}).get("eval_size"),
        "compute_multiplier": rollout.get("num_generations", 4) / 4,
        "reasoning_effort": given.get("reasoning_effort", "default"),
    }


def _estimated_finish(j: m.Job) -> int | None:
    """Linear in steps since the first start (a resumed job's estimate is pessimistic)."""
    start = unix(j.started_at)
    if j.status != "running" or start is None or j.step <= 0 or j.total_steps <= 0:
        return None
    return int(start + (time.time() - start) * j.total_steps / j.step)


def job_view(j: m.Job, queue_position: int | None = None) -> s.FineTuningJob:
    spec, request = j.spec or {}, j.request or {}
    hyper = _hyperparameters(spec, request)
    error = None
    if j.status == "failed" or j.error_code:
        error = s.JobError(code=j.error_code or "failed", message=j.error_message or "the job failed",
                           param=j.error_param)
    return s.FineTuningJob(
        id=j.id, created_at=unix(j.created_at) or 0, error=error, fine_tuned_model=j.fine_tuned_model,
        finished_at=unix(j.finished_at), hyperparameters=hyper, model=j.model, organization_id=j.project,
        result_files=[j.result_file_id] if j.result_file_id else [], seed=j.seed, status=j.status, estimated_finish=_estimated_finish(j),
        trained_tokens=j.trained_tokens if j.status in TERMINAL else None,
        training_file=j.training_file, validation_file=j.validation_file, metadata=j.user_metadata,
        method={"type": "reinforcement", "reinforcement": {"grader": spec.get("grader"), "hyperparameters": hyper}},
        user_provided_suffix=j.suffix,
        qerl=s.JobQerl(quantization=spec.get("quantization", ""), progress=s.JobProgress(
            step=j.step, total_steps=j.total_steps, stopped_early=j.status == "succeeded" and j.step < j.total_steps), attempt=j.attempt, max_attempts=j.max_attempts,
            cancel_requested=j.cancel_requested, adapter_id=j.adapter_id, started_at=unix(j.started_at),
            dataset=spec.get("data", {}).get("dataset"), spec=spec,
            queue_position=queue_position if j.status == "queued" else None),
    )


def checkpoint_view(c: m.Checkpoint, job: m.Job) -> s.FineTuningJobCheckpoint:
    name = f"{job.fine_tuned_model or fine_tuned_model_name(job)}:ckpt-step-{c.step}"
    return s.FineTuningJobCheckpoint(id=c.id, created_at=unix(c.created_at) or 0, fine_tuned_model_checkpoint=name,
                                     fine_tuning_job_id=job.id, metrics={"step": c.step, **(c.metrics or {})},
                                     step_number=c.step, qerl=s.CheckpointQerl(adapter_bytes=c.adapter_bytes,
                                                                               adapter_sha256=c.adapter_sha256))


def adapter_view(a: m.Adapter) -> s.Adapter:
    return s.Adapter(id=a.id, created_at=unix(a.created_at) or 0, name=a.name, base_model=a.base_model,
                     job_id=a.job_id, bytes=a.bytes, sha256=a.sha256, manifest=a.manifest)


def base_model_of(job: m.Job) -> str:
    """The base model a job trains on: its model, or the base of the fine-tuned model it trains further."""
    return (job.spec or {}).get("model") or job.model if job.model.startswith("ft:") else job.model


def fine_tuned_model_name(job: m.Job) -> str:
    """OpenAI's pattern ``ft:<base>:<org>:<suffix>:<id>`` (the base model, also for a model trained
    further); the worker names adapters with it."""
    return f"ft:{base_model_of(job)}:{job.project}:{job.suffix or ''}:{job.id.removeprefix('ftjob-')}"


def evaluation_view(j: m.Job, queue_position: int | None = None) -> s.Evaluation:
    spec = j.spec or {}
    error = None
    if j.status == "failed" or j.error_code:
        error = s.JobError(code=j.error_code or "failed", message=j.error_message or "the evaluation failed",
                           param=j.error_param)
    return s.Evaluation(
        id=j.id, created_at=unix(j.created_at) or 0, started_at=unix(j.started_at), finished_at=unix(j.finished_at),
        status=j.status, model=j.model, file=j.validation_file, dataset=spec.get("dataset"), grader=spec.get("grader"),
        limit=spec.get("limit"),
        max_new_tokens=spec.get("max_new_tokens"), compare_base=bool(spec.get("compare_base", True)),
        metadata=j.user_metadata, error=error,
        result=s.EvaluationResult(**j.outcome) if j.outcome and j.status == "succeeded" else None,
        result_files=[j.result_file_id] if j.result_file_id else [],
        queue_position=queue_position if j.status == "queued" else None, attempt=j.attempt)
