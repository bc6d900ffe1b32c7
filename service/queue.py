"""The job queue: Postgres (or SQLite) rows are the queue, a Celery message is only a wake-up.

Why this shape (DESIGN.md): a lost, duplicated or late message must never lose, duplicate or
corrupt a job. So a worker *claims* the row atomically (queued -> running, ``attempt + 1``),
holds a lease it renews by heartbeat, and writes only while ``id, attempt`` still match a
running/cancelling/pausing row (``attempt`` is the fencing token). A reaper returns jobs whose lease
expired to ``queued`` (resume from the latest checkpoint) or fails them after
``max_attempts``; a sweeper re-sends wake-ups nobody acted on.

Every public function here is one transaction and commits it, except cancel(), pause() and
resume() (the API's request commits them). Times are UTC from this host's clock (keep hosts NTP-synced; leases are
tens of seconds).
Torch-free, and Celery is imported only when a Celery sender is configured.
"""
from __future__ import annotations

import heapq
import logging
import os
from collections import deque
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from service.models import Checkpoint, Job, JobEvent, WebhookEvent, utcnow

log = logging.getLogger(__name__)

ACTIVE = ("running", "cancelling", "pausing")  # a worker holds the lease
TERMINAL = ("succeeded", "failed", "cancelled")
TASK_NAME = "qerl.run_job"


class LeaseLost(Exception):
    """This worker no longer owns the job (reaped, cancelled and finished, or re-claimed)."""


class JobConflict(Exception):
    """The job's state does not allow the request (the API answers 409)."""


# -- wake-ups ---------------------------------------------------------------------------------
_dispatch: Callable[[str], None] | None = None
_senders: dict[tuple[str, str], "CelerySender"] = {}


def reset_after_fork() -> None:
    """Drop connections inherited from a parent process (a Celery pool child calls this)."""
    _senders.clear()


def set_dispatcher(fn: Callable[[str], None] | None) -> None:
    """Route wake-ups to ``fn`` (the embedded worker's poke) instead of the configured broker."""
    global _dispatch
    _dispatch = fn


def configure(settings: Any) -> None:
    """The API with a broker: send wake-ups per ``settings`` (not the environment's)."""
    if settings.redis_url:
        set_dispatcher(CelerySender(settings.redis_url, settings.celery_queue))


class CelerySender:
    """Sends the task by name, so the API never imports the worker (or torch)."""

    def __init__(self, broker_url: str, queue: str) -> None:
        from celery import Celery  # only processes that send messages pay for the import

        self.queue = queue
        self.app = Celery("qerl-sender", broker=broker_url, set_as_current=False)
        self.app.conf.update(broker_connection_retry_on_startup=True,
                             broker_transport_options={"socket_connect_timeout": 3, "socket_timeout": 5})

    def pending(self) -> int:
        """Messages waiting in the broker queue (workers take one only when idle)."""
        from kombu.exceptions import ChannelError

        with self.app.connection_for_read() as conn:
            try:
                return conn.default_channel.queue_declare(queue=self.queue, passive=True).message_count
            except ChannelError:  # Redis drops an empty queue's list: nothing waits
                return 0

    def __call__(self, job_id: str) -> None:
        self.app.send_task(TASK_NAME, args=[job_id], queue=self.queue, ignore_result=True,
                           retry=True, retry_policy={"max_retries": 2, "interval_start": 0.2,
                                                     "interval_step": 0.5, "interval_max": 1})


def _dispatcher() -> Callable[[str], None] | None:
    if _dispatch is not None:
        return _dispatch
    from service.settings import get_settings

    s = get_settings()
    if s.redis_url is None:
        return None  # embedded, but no worker thread in this process
    key = (s.redis_url, s.celery_queue)
    if key not in _senders:
        _senders[key] = CelerySender(*key)
    return _senders[key]


def wake(job_id: str, session: Session, *, older_than: datetime | None = None) -> bool:
    """Tell a worker to look at a queued job; call after the job row is committed.

    Stamps ``wakeup_sent_at`` first (conditionally, so concurrent sweepers send once), then
    sends. Returns True if a message went out. A send that fails raises; the stamp stays and
    the sweeper re-sends after ``sweep_after_seconds``.
    """
    cond = [Job.id == job_id, Job.status == "queued"]
    if older_than is not None:
        cond.append(or_(Job.wakeup_sent_at.is_(None), Job.wakeup_sent_at < older_than))
    stamped = session.execute(update(Job).where(*cond).values(wakeup_sent_at=utcnow()).returning(Job.id)).first()
    session.commit()
    send = _dispatcher()
    if stamped is None or send is None:
        return False
    send(job_id)
    return True


def _wake_quietly(session: Session, job_id: str, **kw: Any) -> bool:
    try:
        return wake(job_id, session, **kw)
    except Exception:  # broker down: the next sweep re-sends
        log.exception("could not send the wake-up for job %s", job_id)
        return False


# -- claiming and the lease -------------------------------------------------------------------
def claim(session: Session, job_id: str, worker_id: str, *, lease_seconds: float = 60) -> Job | None:
    """queued -> running for this worker, or None (already claimed, cancelled, finished: a
    duplicate or late message is harmless). Workers take jobs by claim_next(); this claims one
    job by its id (tools, tests)."""
    locked = session.execute(select(Job.id).where(Job.id == job_id, Job.status == "queued")
                             .with_for_update(skip_locked=True)).scalar()  # SQLite: no-op clause
    return _claim_locked(session, locked, worker_id, lease_seconds)


def _queued_turns() -> tuple[Any, Any, Any]:
    """A select of the queued jobs joined to what their turn depends on, with those two columns:
    the number of their project's jobs running and the project's latest start (None: never)."""
    running = (select(Job.project, func.count().label("n")).where(Job.status.in_(ACTIVE))
               .group_by(Job.project).subquery())
    started = (select(Job.project, func.max(Job.started_at).label("at")).where(Job.started_at.is_not(None))
               .group_by(Job.project).subquery())
    stmt = (select(Job.id).where(Job.status == "queued")
            .outerjoin(running, running.c.project == Job.project)
            .outerjoin(started, started.c.project == Job.project))
    return stmt, func.coalesce(running.c.n, 0), started.c.at


def fair_order() -> Any:
    """The queued jobs' ids in the order workers take them: first the projects with the fewest
    jobs running, then the project whose latest start is oldest (never started: first), then the
    oldest job. With one project this is first come, first served; with several, a project that
    queued many jobs takes turns with the others instead of holding every GPU until its jobs are
    done."""
    stmt, running, started = _queued_turns()
    return stmt.order_by(running, started.asc().nulls_first(), Job.created_at, Job.id)


def queued_with_turns() -> Any:
    """Every queued job with what its turn depends on: id, project, created_at, running, started."""
    stmt, running, started = _queued_turns()
    return stmt.add_columns(Job.project, Job.created_at, running.label("running"), started.label("started"))


def rank(rows: Any) -> dict[str, int]:
    """Queue positions (1 = next) from queued_with_turns()'s rows: the order in which workers would
    take the queued jobs if each job, once taken, kept running and nothing else changed. Each take
    is what claim_next() would take (fair_order()'s first), after which its project has one more
    job running and the newest start. Jobs finishing, and new jobs, move the positions."""
    waiting: dict[str, deque[Any]] = {}
    running: dict[str, int] = {}
    started: dict[str, tuple[int, Any]] = {}  # (0, latest start or never) before any take, (1, take) after
    for r in sorted(rows, key=lambda r: (_naive(r.created_at), r.id)):
        waiting.setdefault(r.project, deque()).append(r)
        running[r.project] = r.running or 0
        started[r.project] = (0, _naive(r.started) if r.started is not None else datetime.min)

    def turn(project: str) -> tuple[Any, ...]:  # fair_order()'s terms for the project's oldest job
        head = waiting[project][0]
        return (running[project], started[project], _naive(head.created_at), head.id, project)

    heap = [turn(p) for p in waiting]
    heapq.heapify(heap)
    out: dict[str, int] = {}
    while heap:
        project = heapq.heappop(heap)[-1]
        out[waiting[project].popleft().id] = len(out) + 1
        running[project] += 1
        started[project] = (1, len(out))
        if waiting[project]:
            heapq.heappush(heap, turn(project))
    return out


def _naive(t: datetime) -> datetime:
    return t.replace(tzinfo=None) if t.tzinfo else t


def positions_of(session: Session, ids: Any) -> dict[str, int]:
    """Queue positions (rank()) of those of ``ids`` that are queued."""
    wanted = set(ids)
    if not wanted:
        return {}
    return {jid: pos for jid, pos in rank(session.execute(queued_with_turns()).all()).items() if jid in wanted}


def claim_next(session: Session, worker_id: str, *, lease_seconds: float = 60) -> Job | None:
    """Claim the queued job that comes first in fair_order(), skipping rows other workers are
    claiming right now."""
    locked = session.execute(fair_order().limit(1).with_for_update(skip_locked=True, of=Job)).scalar()
    return _claim_locked(session, locked, worker_id, lease_seconds)


def _claim_locked(session: Session, job_id: str | None, worker_id: str, lease_seconds: float) -> Job | None:
    """The claim itself, in the transaction that locked the row (Postgres) or holds the write
    lock (SQLite's BEGIN IMMEDIATE); the status condition keeps it exclusive either way."""
    if job_id is None:
        session.rollback()
        return None
    now = utcnow()
    row = session.execute(
        update(Job).where(Job.id == job_id, Job.status == "queued")
        .values(status="running", attempt=Job.attempt + 1, lease_owner=worker_id,
                lease_expires_at=now + timedelta(seconds=lease_seconds), heartbeat_at=now,
                started_at=func.coalesce(Job.started_at, now))
        .returning(Job.attempt, Job.resume_checkpoint_id)).first()
    if row is None:
        session.rollback()
        return None
    attempt, ckpt_id = row
    ckpt = session.get(Checkpoint, ckpt_id) if ckpt_id else None
    msg = (f"Resuming from checkpoint step {ckpt.step} (attempt {attempt})" if ckpt
           else f"Job started (attempt {attempt})")
    add_event(session, job_id, attempt, msg, data={"worker": worker_id})
    session.commit()
    return session.get(Job, job_id, populate_existing=True)


def heartbeat(session: Session, job_id: str, attempt: int, worker_id: str, *, lease_seconds: float = 60) -> str:
    """Extend the lease iff this worker still owns this attempt; return the job's status
    (``cancelling`` or ``pausing``: the runner stops). Raises LeaseLost otherwise."""
    now = utcnow()
    row = session.execute(
        update(Job).where(_owned(job_id, attempt), Job.lease_owner == worker_id)
        .values(lease_expires_at=now + timedelta(seconds=lease_seconds), heartbeat_at=now)
        .returning(Job.status)).first()
    session.commit()
    if row is None:
        raise LeaseLost(f"job {job_id} attempt {attempt} is no longer held by {worker_id}")
    return row[0]


def _owned(job_id: str, attempt: int):
    return and_(Job.id == job_id, Job.attempt == attempt, Job.status.in_(ACTIVE))


def fence(session: Session, job_id: str, attempt: int) -> str:
    """Start a worker write: lock the job row iff this attempt still owns it (a no-op UPDATE,
    so a reaper waits for our commit) and return its status; raise LeaseLost otherwise."""
    row = session.execute(update(Job).where(_owned(job_id, attempt)).values(attempt=Job.attempt)
                          .returning(Job.status)).first()
    if row is None:
        session.rollback()
        raise LeaseLost(f"job {job_id} attempt {attempt} no longer owns the job")
    return row[0]


def add_event(session: Session, job_id: str, attempt: int, message: str, *, level: str = "info",
              type: str = "message", data: dict[str, Any] | None = None) -> None:
    """Append an event in the caller's transaction (worker writes call fence() first)."""
    session.add(JobEvent(job_id=job_id, attempt=attempt, level=level, type=type, message=message,
                         data=data, created_at=utcnow()))


def _ended(session: Session, job_id: str, status: str) -> None:
    """A job just ended (in the caller's transaction): queue its webhook event (OpenAI's
    ``fine_tuning.job.<status>``; an evaluation's ``evaluation.<status>``), which the workers
    deliver when QERL_WEBHOOK_URL is set."""
    kind = session.scalar(select(Job.kind).where(Job.id == job_id))
    session.add(WebhookEvent(type=f"{'evaluation' if kind == 'eval' else 'fine_tuning.job'}.{status}", job_id=job_id))


def latest_checkpoint(session: Session, job_id: str) -> Checkpoint | None:
    return session.execute(select(Checkpoint).where(Checkpoint.job_id == job_id)
                           .order_by(Checkpoint.step.desc(), Checkpoint.created_at.desc()).limit(1)).scalar()


# -- outcomes ---------------------------------------------------------------------------------
def finish(session: Session, job_id: str, attempt: int, status: str, *, error_code: str | None = None,
           error_message: str | None = None, adapter: Any = None, results: Any = None,
           outcome: dict[str, Any] | None = None) -> str:
    """End the job (fenced). ``adapter`` (an Adapter row) and ``results`` (the File row of its
    step_metrics.csv, optional) go in with ``succeeded``; an evaluation's ``outcome`` (its scores)
    and ``results`` (its rows) instead of an adapter.

    A job whose cancel arrived after the last heartbeat ends ``cancelled`` even if the run
    completed (the user was told it is cancelling); the status written is returned.
    """
    if status not in TERMINAL:
        raise ValueError(f"finish status must be one of {', '.join(TERMINAL)}; got {status!r}")
    current = fence(session, job_id, attempt)
    if current == "cancelling":
        status = "cancelled"
    values: dict[str, Any] = dict(status=status, finished_at=utcnow(), lease_owner=None, lease_expires_at=None)
    if status == "succeeded":
        if (adapter is None) == (outcome is None):
            raise ValueError("finish(succeeded) needs the Adapter row (a training job) or the outcome (an evaluation)")
        if results is not None:
            session.add(results)
            values.update(result_file_id=results.id)
        if adapter is not None:
            session.add(adapter)
            session.flush()  # assigns the id
            values.update(adapter_id=adapter.id, fine_tuned_model=adapter.name)
        else:
            values.update(outcome=outcome)
        msg, level = "The job has successfully completed", "info"
    elif status == "failed":
        values.update(error_code=error_code or "internal_error", error_message=error_message or "")
        msg, level = f"The job failed: {error_message}", "error"
    else:
        msg, level = "The job was cancelled", "info"
    session.execute(update(Job).where(Job.id == job_id).values(**values))
    add_event(session, job_id, attempt, msg, level=level,
              data={"error_code": values.get("error_code")} if status == "failed" else None)
    _ended(session, job_id, status)
    session.commit()
    return status


def requeue(session: Session, job_id: str, attempt: int, reason: str, *, pause: bool = False) -> str:
    """A worker hands its job back (warm shutdown, or the engine stopped for a pause): queued
    again (and woken), or ``paused`` if a pause was asked for, resuming from the latest
    checkpoint either way. ``pause``: paused whatever was asked, ``reason`` saying why (the
    engine stopped on something the user or operator must fix first, a judge model that does
    not answer). It does not use up an attempt (max_attempts + 1). A job that was cancelling is
    cancelled instead. Returns the status written."""
    current = fence(session, job_id, attempt)
    if current == "cancelling":
        session.rollback()
        return finish(session, job_id, attempt, "cancelled")
    ckpt = latest_checkpoint(session, job_id)
    status = "paused" if current == "pausing" or pause else "queued"
    session.execute(update(Job).where(Job.id == job_id).values(
        status=status, lease_owner=None, lease_expires_at=None, max_attempts=Job.max_attempts + 1,
        resume_checkpoint_id=ckpt.id if ckpt else None, step=ckpt.step if ckpt else 0))
    if pause:
        add_event(session, job_id, attempt, f"{reason}; the job was paused and will resume {_from(ckpt)} when "
                                            "resumed", level="warn")
    elif status == "paused":
        add_event(session, job_id, attempt, f"The job was paused; it will resume {_from(ckpt)} when resumed")
    else:
        add_event(session, job_id, attempt, f"{reason}; job requeued, will resume {_from(ckpt)}", level="warn")
    session.commit()
    if status == "queued":
        _wake_quietly(session, job_id)
    return status


def _from(ckpt: Checkpoint | None) -> str:
    return f"from checkpoint step {ckpt.step}" if ckpt else "from step 0 (no checkpoint yet)"


def cancel(session: Session, job: Job) -> Job:
    """API cancel: queued or paused -> cancelled now; running or pausing -> cancelling (the engine
    stops within a step and the runner marks it cancelled); cancelling stays; terminal ->
    JobConflict. Flushes; the caller commits."""
    for _ in range(4):  # each branch is a conditional UPDATE, so a racing claim/finish is seen
        row = session.execute(update(Job).where(Job.id == job.id, Job.status.in_(("queued", "validating_files",
                                                                                   "paused")))
                              .values(status="cancelled", finished_at=utcnow(), cancel_requested=True)
                              .returning(Job.attempt)).first()
        if row is not None:
            add_event(session, job.id, row[0], "The job was cancelled")
            _ended(session, job.id, "cancelled")
            break
        row = session.execute(update(Job).where(Job.id == job.id, Job.status.in_(("running", "pausing")))
                              .values(status="cancelling", cancel_requested=True).returning(Job.attempt)).first()
        if row is not None:
            add_event(session, job.id, row[0], "Cancellation requested; the job stops after the current step")
            break
        status = session.execute(select(Job.status).where(Job.id == job.id)).scalar()
        if status == "cancelling":
            break
        _refuse(job.id, status, "cancelled", "queued, running or paused")
    session.flush()
    session.refresh(job)
    return job


def _refuse(job_id: str, status: str | None, action: str, allowed: str) -> None:
    """JobConflict if a job in ``status`` (being cancelled, or finished) cannot be ``action``."""
    if status == "cancelling":
        raise JobConflict(f"Job {job_id} is being cancelled; it cannot be {action}")
    if status in TERMINAL:
        done = {"succeeded": "succeeded", "failed": "failed", "cancelled": "been cancelled"}[status]
        raise JobConflict(f"Job {job_id} has already {done}; only {allowed} jobs can be {action}")


def pause(session: Session, job: Job) -> Job:
    """API pause: queued -> paused now; running -> pausing (the engine stops within a step,
    saving a checkpoint, and the runner marks it paused); pausing and paused stay;
    cancelling and terminal -> JobConflict. Flushes; the caller commits."""
    for _ in range(4):  # each branch is a conditional UPDATE, so a racing claim/finish is seen
        row = session.execute(update(Job).where(Job.id == job.id, Job.status.in_(("queued", "validating_files")))
                              .values(status="paused").returning(Job.attempt)).first()
        if row is not None:
            add_event(session, job.id, row[0], "The job was paused before it started; resume it to queue it again")
            break
        row = session.execute(update(Job).where(Job.id == job.id, Job.status == "running")
                              .values(status="pausing").returning(Job.attempt)).first()
        if row is not None:
            add_event(session, job.id, row[0], "Pause requested; the job saves a checkpoint after the current step")
            break
        status = session.execute(select(Job.status).where(Job.id == job.id)).scalar()
        if status in ("pausing", "paused"):
            break
        _refuse(job.id, status, "paused", "queued or running")
    session.flush()
    session.refresh(job)
    return job


def resume(session: Session, job: Job) -> Job:
    """API resume: paused -> queued (from the latest checkpoint; the caller wakes a worker
    after committing); queued, running and validating_files stay (nothing to resume); pausing,
    cancelling and terminal -> JobConflict. Flushes; the caller commits."""
    row = session.execute(update(Job).where(Job.id == job.id, Job.status == "paused")
                          .values(status="queued", wakeup_sent_at=None).returning(Job.attempt, Job.step)).first()
    if row is not None:
        ckpt = latest_checkpoint(session, job.id)
        add_event(session, job.id, row[0], f"The job was resumed; it is queued and will resume {_from(ckpt)}")
    else:
        status = session.execute(select(Job.status).where(Job.id == job.id)).scalar()
        if status == "pausing":
            raise JobConflict(f"Job {job.id} is still pausing (saving its checkpoint); resume it once its status "
                              "is paused")
        _refuse(job.id, status, "resumed", "paused")
    session.flush()
    session.refresh(job)
    return job


# -- recovery ---------------------------------------------------------------------------------
SIGKILL_HINT = ("the kernel's out-of-memory killer sends SIGKILL when the host runs out of memory: the job likely "
                "needs more memory than the worker has; lower micro_batch_size, rollout.max_batch or "
                "rollout.num_generations, use a smaller model, or give the worker more memory")


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has this pid (a reaped child no longer has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def worker_exited(session: Session, node: str, how: str, *, alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """A worker's main process saw one of its pool processes die while running a job (``how``:
    e.g. "signal 9 (SIGKILL)"). End the lease of every attempt that a process of ``node`` (lease
    owner ``node:pid``, on this host) holds and that is gone, so the next reaper pass recovers the
    job instead of waiting out the lease, and record why, once. Returns the jobs touched (none:
    already reaped or reported, or the process finished its job before it died)."""
    rows = session.execute(select(Job.id, Job.attempt, Job.lease_owner)
                           .where(Job.status.in_(ACTIVE), Job.lease_owner.like(f"{node}:%"),
                                  Job.lease_expires_at > utcnow())  # not already ended
                           .with_for_update()).all()
    hint = f"; {SIGKILL_HINT}" if "SIGKILL" in how else ""
    touched = []
    for job_id, attempt, owner in rows:
        head, _, pid = owner.rpartition(":")
        if head != node or not pid.isdigit() or alive(int(pid)):
            continue
        session.execute(update(Job).where(_owned(job_id, attempt), Job.lease_owner == owner)
                        .values(lease_expires_at=utcnow()))
        add_event(session, job_id, attempt,
                  f"The worker process running attempt {attempt} ({owner}) died: {how}{hint}",
                  level="error", data={"worker_exit": how})
        touched.append(job_id)
    session.commit()
    return touched


def _exit_cause(session: Session, job_id: str, attempt: int) -> str:
    """What worker_exited() recorded for this attempt, as a clause for the reaper's message."""
    for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.attempt == attempt,
                                                    JobEvent.level == "error").order_by(JobEvent.id.desc()).limit(5)):
        how = (e.data or {}).get("worker_exit")
        if how:
            return f" (its process died: {how}{'; ' + SIGKILL_HINT if 'SIGKILL' in how else ''})"
    return ""


def reap(session: Session) -> list[str]:
    """Jobs whose lease expired: back to queued (resume from the latest checkpoint), failed
    ``worker_lost`` after max_attempts, cancelled if they were cancelling, or paused (resuming
    from the latest checkpoint once resumed) if they were pausing. Idempotent and
    safe to run in every worker at once. Returns the requeued ids (already woken)."""
    now = utcnow()
    rows = session.execute(select(Job.id, Job.status, Job.attempt, Job.max_attempts)
                           .where(Job.status.in_(ACTIVE), Job.lease_expires_at < now)
                           .with_for_update(skip_locked=True)).all()
    requeued = []
    for job_id, status, attempt, max_attempts in rows:
        fence_ = and_(_owned(job_id, attempt), Job.lease_expires_at < now)
        ckpt = latest_checkpoint(session, job_id)
        cleared = dict(lease_owner=None, lease_expires_at=None)
        if status == "cancelling":
            values, level = dict(status="cancelled", finished_at=now, **cleared), "info"
            msg = "Worker lost while cancelling; the job was cancelled"
        elif status == "pausing":
            values, level = dict(status="paused", resume_checkpoint_id=ckpt.id if ckpt else None,
                                 step=ckpt.step if ckpt else 0, **cleared), "warn"
            msg = f"Worker lost while pausing; the job was paused and will resume {_from(ckpt)} when resumed"
        elif attempt >= max_attempts:
            msg = (f"Worker lost on attempt {attempt} of {max_attempts}{_exit_cause(session, job_id, attempt)}; "
                   f"giving up (last checkpoint step {ckpt.step if ckpt else 0})")
            values, level = dict(status="failed", finished_at=now, error_code="worker_lost", error_message=msg,
                                 **cleared), "error"
        else:
            msg = f"Worker lost; resuming {_from(ckpt)} (attempt {attempt + 1})"
            values, level = dict(status="queued", resume_checkpoint_id=ckpt.id if ckpt else None,
                                 step=ckpt.step if ckpt else 0, **cleared), "warn"
        if session.execute(update(Job).where(fence_).values(**values).returning(Job.id)).first() is None:
            continue
        add_event(session, job_id, attempt, msg, level=level)
        if values["status"] in TERMINAL:
            _ended(session, job_id, values["status"])
        if values["status"] == "queued":
            requeued.append(job_id)
        log.warning("job %s: %s", job_id, msg)
    session.commit()
    for job_id in requeued:
        _wake_quietly(session, job_id)
    return requeued


def sweep(session: Session, *, older_than_s: float = 60, limit: int = 100) -> list[str]:
    """Re-send wake-ups for queued jobs nobody claimed within ``older_than_s``. Only while the
    broker queue is empty: a message still waiting there will be taken by the next idle worker
    (workers never reserve more than they run), and re-sending behind a backlog would only
    pile up duplicates. A job whose message was lost is re-sent once the queue drains.
    Returns the ids woken."""
    send = _dispatcher()
    pending = getattr(send, "pending", None)
    if pending is not None:
        try:
            if pending() > 0:
                return []
        except Exception:
            log.warning("cannot read the broker queue length; skipping this sweep", exc_info=True)
            return []
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    ids = session.execute(select(Job.id).where(
        Job.status == "queued",
        or_(Job.wakeup_sent_at < cutoff, and_(Job.wakeup_sent_at.is_(None), Job.created_at < cutoff)))
        .order_by(Job.created_at).limit(limit)).scalars().all()
    session.rollback()
    return [jid for jid in ids if _wake_quietly(session, jid, older_than=cutoff)]
