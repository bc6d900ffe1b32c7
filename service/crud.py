"""The API's data access: every query filters by the caller's project, and the routes write
only through here (job state changes such as cancel go through ``service.queue``)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, Text, and_, bindparam, cast, func, or_, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.models import Adapter, Checkpoint, File, Job, JobEvent, JobMetric, JobSample, utcnow
from service.views import ACTIVE, base_model_of, fine_tuned_model_name

MAX_LIMIT = 10_000

# What pollers run on every request (GET job, the events page, the SSE loop), built once: building
# a select() costs more CPU than running it.
_JOB = select(Job).where(Job.id == bindparam("job_id"), Job.project == bindparam("project"),
                         Job.kind == bindparam("kind"))
_JOB_FOR_UPDATE = _JOB.with_for_update()
_EVENTS_DESC = (select(JobEvent).where(JobEvent.job_id == bindparam("job_id"))
                .order_by(JobEvent.id.desc()).limit(bindparam("n")))
_EVENTS_DESC_BEFORE = (select(JobEvent).where(JobEvent.job_id == bindparam("job_id"), JobEvent.id < bindparam("before"))
                       .order_by(JobEvent.id.desc()).limit(bindparam("n")))
_EVENTS_SINCE = (select(JobEvent).where(JobEvent.job_id == bindparam("job_id"), JobEvent.id > bindparam("after"))
                 .order_by(JobEvent.id.asc()).limit(bindparam("n")))


def page(session: Session, stmt: Select[Any], limit: int) -> tuple[list[Any], bool]:
    """Fetch ``limit`` rows plus one to learn whether there are more."""
    rows = list(session.scalars(stmt.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def newest_first_after(stmt: Select[Any], model: Any, cursor: Any | None) -> Select[Any]:
    """Order by (created_at, id) descending, starting below ``cursor`` (an object of ``model``)."""
    if cursor is not None:
        stmt = stmt.where(or_(model.created_at < cursor.created_at,
                              and_(model.created_at == cursor.created_at, model.id < cursor.id)))
    return stmt.order_by(model.created_at.desc(), model.id.desc())


# ---- files ----------------------------------------------------------------------------------
def get_file(session: Session, project: str, file_id: str, *, for_update: bool = False) -> File | None:
    stmt = select(File).where(File.id == file_id, File.project == project, File.deleted_at.is_(None))
    return session.scalar(stmt.with_for_update() if for_update else stmt)


def list_files(session: Session, project: str, *, after: str | None, limit: int, purpose: str | None,
               order: str) -> tuple[list[File], bool]:
    stmt = select(File).where(File.project == project, File.deleted_at.is_(None))
    if purpose:
        stmt = stmt.where(File.purpose == purpose)
    cursor = get_file(session, project, after) if after else None
    if order == "asc":
        if cursor is not None:
            stmt = stmt.where(or_(File.created_at > cursor.created_at,
                                  and_(File.created_at == cursor.created_at, File.id > cursor.id)))
        stmt = stmt.order_by(File.created_at.asc(), File.id.asc())
    else:
        stmt = newest_first_after(stmt, File, cursor)
    return page(session, stmt, limit)


def add_file(session: Session, file: File) -> File:
    session.add(file)
    session.flush()
    return file


def active_jobs_using(session: Session, project: str, file_id: str) -> list[str]:
    stmt = select(Job.id).where(Job.project == project, Job.status.in_(ACTIVE),
                                or_(Job.training_file == file_id, Job.validation_file == file_id))
    return list(session.scalars(stmt))


@dataclass
class Parent:
    """A LoRA a job can start from: a fine-tuned model (``ft:...``) or one of its jobs' kept
    checkpoint LoRAs (``ft:...:ckpt-step-N``)."""
    name: str
    base_model: str
    lora: dict[str, Any]  # its LoraSpec fields
    path: str  # the archive, relative to the artifact store
    sha256: str
    job_id: str = ""  # the job that trained it


def _parent_of(a: Adapter) -> Parent:
    return Parent(a.name, a.base_model, (a.manifest or {}).get("lora") or {}, a.path, a.sha256, a.job_id)


_CHECKPOINT_NAME = re.compile(r"^(ft:.+):ckpt-step-(\d+)$")


def find_parent(session: Session, project: str, name: str) -> Parent | None:
    """The fine-tuned model or kept checkpoint LoRA called ``name`` in ``project``, its row locked
    (against a concurrent delete), or None."""
    m = _CHECKPOINT_NAME.match(name)
    if m is None:
        a = get_adapter_by_name(session, project, name, for_update=True)
        return _parent_of(a) if a else None
    job = get_job(session, project, "ftjob-" + m.group(1).rsplit(":", 1)[-1])
    if job is None or (job.fine_tuned_model or fine_tuned_model_name(job)) != m.group(1):
        return None
    c = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == int(m.group(2)),
                                                Checkpoint.adapter_path.is_not(None))
                       .order_by(Checkpoint.created_at.desc()).limit(1).with_for_update())
    if c is None or c.adapter_path is None or c.adapter_sha256 is None:
        return None
    return Parent(name, base_model_of(job), (job.spec or {}).get("lora") or {}, c.adapter_path, c.adapter_sha256,
                  job.id)


def find_model(session: Session, project: str, ref: str) -> Parent | None:
    """The LoRA ``ref`` names in ``project``: a fine-tuned model or kept checkpoint (find_parent), a
    succeeded job's id or an adapter id; its row locked against a concurrent delete."""
    if ref.startswith("ft:"):
        return find_parent(session, project, ref)
    adapter_id = ref
    if ref.startswith("ftjob-"):
        job = get_job(session, project, ref)
        adapter_id = job.adapter_id if job is not None and job.adapter_id else ""
    a = get_adapter(session, project, adapter_id, for_update=True) if adapter_id.startswith("adapter-") else None
    return _parent_of(a) if a else None


def active_jobs_starting_from(session: Session, project: str, paths: set[str]) -> list[str]:
    """Unfinished jobs of ``project`` whose start (init_adapter) is one of the archives ``paths``."""
    if not paths:
        return []
    stmt = select(Job.id, Job.spec).where(Job.project == project, Job.status.in_(ACTIVE))
    return [job_id for job_id, spec in session.execute(stmt) if (spec or {}).get("init_adapter") in paths]


def mark_file_deleted(session: Session, file: File) -> None:
    file.deleted_at = utcnow()


# ---- jobs -----------------------------------------------------------------------------------
def get_job(session: Session, project: str, job_id: str, *, for_update: bool = False,
            kind: str = "fine_tune") -> Job | None:
    """One of the project's training jobs (``kind="eval"``: its evaluations)."""
    return session.scalar(_JOB_FOR_UPDATE if for_update else _JOB, {"job_id": job_id, "project": project, "kind": kind})


QUEUE_HOLDING = ("validating_files", "queued", "running", "pausing", "cancelling")  # waiting for or holding a worker


def count_queue_holding_jobs(session: Session, project: str) -> int:
    """The project's jobs that wait for or hold a worker, counted under a per-project lock held
    until the transaction ends (Postgres: an advisory lock; SQLite's transactions already write
    one at a time), so that two requests cannot both take the last place."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"SELECT pg_advisory_xact_lock({PROJECT_LOCK_CLASS}, hashtext(:project))"),
                        {"project": project})
    return session.scalar(select(func.count()).select_from(Job).where(
        Job.project == project, Job.status.in_(QUEUE_HOLDING))) or 0


PROJECT_LOCK_CLASS = 0x7165  # the first key of the per-project advisory locks ("qe")


def job_by_idempotency_key(session: Session, project: str, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.project == project, Job.idempotency_key == key))


def insert_job(session: Session, job: Job, first_event: str) -> Job | None:
    """Insert and commit; None when the (project, Idempotency-Key) pair already exists."""
    session.add(job)
    try:
        session.flush()
        session.add(JobEvent(job_id=job.id, attempt=0, level="info", type="message", message=first_event))
        session.commit()
    except IntegrityError:
        session.rollback()
        if job.idempotency_key is None:
            raise
        return None
    return job


def list_jobs(session: Session, project: str, *, after: str | None, limit: int, status: str | None,
              metadata: dict[str, str] | None = None, kind: str = "fine_tune",
              model: str | None = None) -> tuple[list[Job], bool]:
    """``metadata``: every pair must be in the job's metadata ({} : jobs without metadata)."""
    stmt = select(Job).where(Job.project == project, Job.kind == kind)
    if model:
        stmt = stmt.where(Job.model == model)
    if status:
        stmt = stmt.where(Job.status == status)
    if metadata == {}:  # a JSON column stores Python's None as SQL NULL or as JSON null
        stmt = stmt.where(or_(Job.user_metadata.is_(None), func.coalesce(cast(Job.user_metadata, Text), "null")
                              .in_(("null", "{}"))))
    for k, v in (metadata or {}).items():
        if session.get_bind().dialect.name == "sqlite":  # its JSON paths cannot quote every key: match pairs
            pairs = func.json_each(Job.user_metadata).table_valued("key", "value")
            stmt = stmt.where(select(pairs.c.key).where(pairs.c.key == k, pairs.c.value == v).exists())
        else:
            stmt = stmt.where(Job.user_metadata[k].as_string() == v)
    cursor = get_job(session, project, after, kind=kind) if after else None
    return page(session, newest_first_after(stmt, Job, cursor), limit)


def count_jobs_by_status(session: Session) -> dict[str, int]:
    return dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())


def queue_summary(session: Session) -> tuple[datetime | None, int]:
    """The oldest queued job's creation time (None: nothing queued) and how many projects have
    jobs queued."""
    oldest, projects = session.execute(select(func.min(Job.created_at), func.count(Job.project.distinct()))
                                       .where(Job.status == "queued")).one()
    return oldest, projects


# ---- events, metrics, checkpoints -----------------------------------------------------------
def list_events_desc(session: Session, job_id: str, *, before: int | None, limit: int) -> tuple[list[JobEvent], bool]:
    params: dict[str, Any] = {"job_id": job_id, "n": limit + 1}  # one more: are there more?
    if before is not None:
        params["before"] = before
    rows = list(session.scalars(_EVENTS_DESC if before is None else _EVENTS_DESC_BEFORE, params))
    return rows[:limit], len(rows) > limit


def events_since(session: Session, job_id: str, after: int, limit: int = 500) -> list[JobEvent]:
    return list(session.scalars(_EVENTS_SINCE, {"job_id": job_id, "after": after, "n": limit}))


def _latest_attempts(model: Any, job_id: str, *keys: str) -> Select[Any]:
    """The job's rows of ``model`` (JobMetric, JobSample) from the latest attempt that wrote each
    value of ``keys`` (a resumed job may re-run steps)."""
    cols = [getattr(model, k) for k in keys]
    best = (select(*cols, func.max(model.attempt).label("attempt")).where(model.job_id == job_id)
            .group_by(*cols).subquery())
    on = and_(*(col == best.c[k] for col, k in zip(cols, keys)), model.attempt == best.c.attempt)
    return select(model).join(best, on).where(model.job_id == job_id)


def _latest_metrics(job_id: str) -> Select[tuple[JobMetric]]:
    """One row per step: the one from the latest attempt."""
    return _latest_attempts(JobMetric, job_id, "step")


def latest_metrics(session: Session, job_id: str, *, after_step: int | None, limit: int) -> tuple[list[JobMetric], bool]:
    stmt = _latest_metrics(job_id)
    if after_step is not None:
        stmt = stmt.where(JobMetric.step > after_step)
    return page(session, stmt.order_by(JobMetric.step.asc()), limit)


def all_metrics(session: Session, job_id: str) -> list[JobMetric]:
    """Every step's metrics (the latest attempt's), in step order."""
    return list(session.scalars(_latest_metrics(job_id).order_by(JobMetric.step.asc())))


def job_samples(session: Session, job_id: str, *, step: int | None, kind: str | None, after_step: int | None,
                limit: int, newest_first: bool) -> tuple[list[JobSample], bool]:
    """Every reported sample of up to ``limit`` steps (the latest attempt's set for each step and
    kind), in step order (``newest_first``: descending), steps past ``after_step`` in that order."""
    where = [JobSample.job_id == job_id]
    if step is not None:
        where.append(JobSample.step == step)
    if kind is not None:
        where.append(JobSample.kind == kind)
    if after_step is not None:
        where.append(JobSample.step < after_step if newest_first else JobSample.step > after_step)
    order = JobSample.step.desc() if newest_first else JobSample.step.asc()
    steps = list(session.scalars(select(JobSample.step).where(*where).distinct().order_by(order).limit(limit + 1)))
    more, steps = len(steps) > limit, steps[:limit]
    rows = session.scalars(_latest_attempts(JobSample, job_id, "step", "kind").where(*where, JobSample.step.in_(steps))
                           .order_by(order, JobSample.kind.desc(), JobSample.index.asc()))
    return list(rows), more


def list_checkpoints(session: Session, job_id: str, *, after: str | None, limit: int) -> tuple[list[Checkpoint], bool]:
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id)
    cursor = session.get(Checkpoint, after) if after else None
    if cursor is not None and cursor.job_id == job_id:
        stmt = stmt.where(or_(Checkpoint.step < cursor.step,
                              and_(Checkpoint.step == cursor.step, Checkpoint.id < cursor.id)))
    return page(session, stmt.order_by(Checkpoint.step.desc(), Checkpoint.id.desc()), limit)


# ---- adapters -------------------------------------------------------------------------------
def get_adapter(session: Session, project: str, adapter_id: str, *, for_update: bool = False) -> Adapter | None:
    stmt = select(Adapter).where(Adapter.id == adapter_id, Adapter.project == project)
    return session.scalar(stmt.with_for_update() if for_update else stmt)


def get_adapter_by_name(session: Session, project: str, name: str, *, for_update: bool = False) -> Adapter | None:
    stmt = select(Adapter).where(Adapter.name == name, Adapter.project == project)
    return session.scalar(stmt.with_for_update() if for_update else stmt)


def delete_adapter(session: Session, adapter: Adapter) -> list[str]:
    """Drop the adapter's row, release its job's kept checkpoint LoRAs (their rows stay, without an
    archive) and say so on the job (whose ``adapter_id`` is cleared; the job keeps its
    ``fine_tuned_model`` name, as OpenAI's jobs do). Returns the checkpoint archives' paths. The
    caller commits, then deletes the files: a crash in between leaves orphan files, never a row
    without its file."""
    from service.queue import add_event

    job = session.get(Job, adapter.job_id)
    released: list[str] = []
    if job is not None:
        if job.adapter_id == adapter.id:
            job.adapter_id = None
        for c in kept_checkpoints(session, job.id):
            released.append(c.adapter_path or "")
            c.adapter_path = c.adapter_bytes = c.adapter_sha256 = None
        add_event(session, job.id, job.attempt, f"The fine-tuned model {adapter.name} ({adapter.id}) was deleted"
                  + (f", with the LoRAs of {len(released)} checkpoints" if released else ""))
    session.delete(adapter)
    return released


def kept_checkpoints(session: Session, job_id: str, *, for_update: bool = False) -> list[Checkpoint]:
    """The job's checkpoints whose LoRA is archived (keep_checkpoint_adapters); ``for_update`` locks
    them, so that a job created from one of them meanwhile is seen before they are released."""
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.adapter_path.is_not(None))
    return list(session.scalars(stmt.with_for_update() if for_update else stmt))


def delete_checkpoint(session: Session, job: Job, checkpoint: Checkpoint) -> None:
    """Drop a checkpoint's row (the caller commits, then deletes its kept archive, if any)."""
    from service.queue import add_event

    add_event(session, job.id, job.attempt, f"Checkpoint {checkpoint.id} (step {checkpoint.step}) was deleted")
    session.delete(checkpoint)


def list_adapters(session: Session, project: str, *, after: str | None, limit: int) -> tuple[list[Adapter], bool]:
    cursor = get_adapter(session, project, after) if after else None
    stmt = newest_first_after(select(Adapter).where(Adapter.project == project), Adapter, cursor)
    return page(session, stmt, limit)
