"""ORM models: the database is the queue and the source of truth.

Ids are OpenAI-style strings (``ftjob-...``, ``file-...``). Every user-visible row carries
``project`` (the owning API key's project); queries always filter by it.

Job lifecycle: validating_files -> queued -> running -> succeeded | failed | cancelled,
with ``cancelling`` while a running job winds down, and ``pausing`` -> ``paused`` -> ``queued``
for a pause and a resume. ``attempt`` is the fencing token: a worker writes (events, metrics,
checkpoints, status) only with
``WHERE id = :id AND attempt = :its_attempt AND status IN ('running','cancelling','pausing')``.
"""
from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text,
                        UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


# BigInteger autoincrement ids on Postgres, INTEGER PRIMARY KEY (rowid) on SQLite.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    project: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    prefix: Mapped[str] = mapped_column(String(16))  # first characters, to tell keys apart
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class File(Base):
    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file"))
    project: Mapped[str] = mapped_column(String(64), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(Text)  # relative to ARTIFACT_DIR
    rows: Mapped[int] = mapped_column(Integer, default=0)
    # top-level field -> rows that have it (engine.data.jsonl.field_counts); None: not counted (free-form
    # keys, a results file, or uploaded before it was kept)
    fields: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # distinct questions (engine.data.prompts.count_prompts): what a held-out split can take; None as above
    prompts: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="processed")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("project", "idempotency_key", name="uq_jobs_project_idempotency_key"),
        Index("ix_jobs_status_created", "status", "created_at"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ftjob"))
    project: Mapped[str] = mapped_column(String(64), index=True)
    # fine_tune (POST /v1/fine_tuning/jobs) | eval (POST /v1/evaluations: its adapter's archive is
    # spec["init_adapter"], its test file validation_file, its scores outcome)
    kind: Mapped[str] = mapped_column(String(16), default="fine_tune", server_default="fine_tune")
    model: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(24), default="queued")
    request: Mapped[dict[str, Any]] = mapped_column(JSON)  # the accepted request body, as sent
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # engine.TrainSpec.to_dict(), validated at submit
    training_file: Mapped[str | None] = mapped_column(String(40), ForeignKey("files.id"), nullable=True)
    validation_file: Mapped[str | None] = mapped_column(String(40), ForeignKey("files.id"), nullable=True)
    seed: Mapped[int] = mapped_column(BigInteger, default=0)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # queue state
    attempt: Mapped[int] = mapped_column(Integer, default=0)  # fencing token; +1 per claim
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    lease_owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    wakeup_sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # progress and outcome
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    trained_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    resume_checkpoint_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_param: Mapped[str | None] = mapped_column(String(255), nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(255), nullable=True)
    adapter_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    result_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)  # step_metrics.csv (eval: rows)
    outcome: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # an evaluation's scores
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class JobEvent(Base):
    """Append-only; ``id`` orders the stream (SSE ``id:`` and the ``after`` cursor)."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)
    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(40), ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    level: Mapped[str] = mapped_column(String(8), default="info")  # info | warn | error
    type: Mapped[str] = mapped_column(String(16), default="message")  # message | metrics
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class JobMetric(Base):
    """One row per (job, step, attempt); readers take the latest attempt for each step."""

    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "step", "attempt", name="uq_job_metrics_job_step_attempt"),)
    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(40), ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class JobSample(Base):
    """A few of a step's samples (or of an evaluation's greedy completions) as the engine reported
    them (``qerl.log_samples``); one set per (job, step, kind, attempt), readers take the latest attempt."""

    __tablename__ = "job_samples"
    __table_args__ = (Index("ix_job_samples_job_step", "job_id", "step"),)
    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(40), ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(8))  # train | eval
    index: Mapped[int] = mapped_column(Integer)  # position in the step's samples (prompt-major)
    prompt: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)
    reward: Mapped[float] = mapped_column(Float)
    scores: Mapped[dict[str, Any]] = mapped_column(JSON)  # the grader's named (sub-)scores
    finish_reason: Mapped[str] = mapped_column(String(16))
    tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_job_step", "job_id", "step"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ftckpt"))
    job_id: Mapped[str] = mapped_column(String(40), ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)  # relative to ARTIFACT_DIR
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The step's LoRA packed into the artifact store (qerl.keep_checkpoint_adapters): it outlives
    # the checkpoint, until the checkpoint or the job's fine-tuned model is deleted.
    adapter_path: Mapped[str | None] = mapped_column(Text, nullable=True)  # tar.gz, relative to ARTIFACT_DIR
    adapter_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    adapter_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Adapter(Base):
    __tablename__ = "adapters"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("adapter"))
    project: Mapped[str] = mapped_column(String(64), index=True)
    job_id: Mapped[str] = mapped_column(String(40), ForeignKey("jobs.id"), unique=True)
    name: Mapped[str] = mapped_column(String(255))  # the ft: model name
    base_model: Mapped[str] = mapped_column(String(255))
    path: Mapped[str] = mapped_column(Text)  # tar.gz, relative to ARTIFACT_DIR
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    manifest: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)



class WebhookEvent(Base):
    """Outbox of ``QERL_WEBHOOK_URL`` notifications: written in the transaction that ends a job,
    delivered (and retried with back-off) by the workers' maintenance pass."""

    __tablename__ = "webhook_events"
    __table_args__ = (Index("ix_webhook_events_due", "delivered_at", "next_attempt_at"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("evt"))
    type: Mapped[str] = mapped_column(String(64))  # fine_tuning.job.succeeded | .failed | .cancelled
    job_id: Mapped[str] = mapped_column(String(40), ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    gave_up_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
