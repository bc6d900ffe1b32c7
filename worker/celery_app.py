"""Celery app: ``qerl.run_job(job_id)``, one worker process per GPU.

Why these settings (DESIGN.md, Celery's task guide): the message is only a wake-up and the
database row is the truth, so the task acks early and never relies on redelivery
(``acks_late`` + ``visibility_timeout`` would re-run multi-hour jobs that are still running);
recovery comes from leases. Concurrency 1 with no prefetch, so a busy worker never sits on a
message another worker could run; a fresh child per job, so GPU memory starts clean.

Each worker's main process also runs the reaper and sweeper every few seconds on its event
loop's timer (idempotent conditional UPDATEs, so many workers doing it at once is safe): no beat
process. Not in a thread: the main process forks a child per job, and a fork while another
thread holds a lock (an import in progress) leaves the child deadlocked.

A warm shutdown (SIGTERM to the main process) makes the running job checkpoint and go back to
the queue; SIGKILL is recovered by the reapers of the other workers.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from celery import Celery, bootsteps, signals

from service.settings import get_settings

log = logging.getLogger(__name__)
settings = get_settings()
if not settings.redis_url:
    raise RuntimeError("the Celery worker needs REDIS_URL (e.g. redis://localhost:6379/0); without a broker, "
                       "`qerl serve` runs jobs in its embedded worker")
if settings.artifact_url:  # fail at start, not at the first job, when the bucket's client cannot be made
    from worker.artifacts import worker_store

    worker_store(settings)

app = Celery("qerl", broker=settings.redis_url, set_as_current=True)
app.conf.update(
    task_default_queue=settings.celery_queue,
    task_acks_late=False,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    worker_concurrency=1,
    worker_prefetch_multiplier=1,
    worker_disable_prefetch=True,
    worker_max_tasks_per_child=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_shutdown = threading.Event()  # set on warm shutdown (solo pool) or by SIGUSR2 from the parent (prefork)
_sessions: Any = None  # this process's sessionmaker, created after fork


def _session_factory() -> Any:
    global _sessions
    if _sessions is None:
        from service.db import make_engine, make_sessionmaker

        _sessions = make_sessionmaker(make_engine(str(settings.database_url),
                                                  idle_in_transaction_s=settings.lease_seconds))
    return _sessions


@app.task(name="qerl.run_job", acks_late=False, ignore_result=True)
def run_job(job_id: str) -> str:
    """A wake-up sent for job ``job_id``: claim the queued job that comes first in the fair order
    (service.queue.fair_order: ``job_id`` itself unless another project's turn has come) and run
    it, or return if nothing is queued. Each queued job has its own wake-up, so a message that ran
    another job leaves ``job_id``'s turn to the message of the job it ran."""
    from billiard.process import current_process

    from worker.runner import WorkerContext, run_next

    in_child = current_process().name != "MainProcess"
    if in_child:
        signal.signal(signal.SIGUSR2, lambda *_: _shutdown.set())
    ctx = WorkerContext(settings=settings, sessions=_session_factory(), shutdown=_shutdown,
                        worker_id=f"{run_job.request.hostname or socket.gethostname()}:{os.getpid()}",
                        parent_pid=os.getppid() if in_child else None)
    outcome = run_next(ctx)
    if outcome is None:
        log.info("wake-up for job %s: no job is queued (taken, cancelled or finished); nothing to do", job_id)
    return outcome or "skipped"


# -- process life cycle -----------------------------------------------------------------------
@signals.worker_process_init.connect
def _child_init(**_: Any) -> None:
    """A forked child must not share the parent's database connections."""
    from service import queue

    global _sessions
    if _sessions is not None:
        _sessions.kw["bind"].dispose(close=False)
        _sessions = None
    queue.reset_after_fork()
    signal.signal(signal.SIGUSR2, lambda *_: _shutdown.set())


# Heavy imports every job needs (torch, transformers, the task generators), done once in the
# parent so each job's forked child starts with them loaded. No CUDA is touched by importing.
PRELOAD = ("engine.train_loop", "engine.model", "engine.lora", "engine.rollout", "engine.data", "engine.rewards",
           "engine.optim", "reasoning_gym")


@signals.worker_init.connect
def _preload(**_: Any) -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # the job reports the real error
            log.warning("could not preload %s", name, exc_info=True)


@signals.worker_shutting_down.connect
def _on_shutdown(how: str = "Warm", **_: Any) -> None:
    """Warm shutdown: the running job checkpoints and is requeued instead of finishing here."""
    _shutdown.set()
    from billiard.process import active_children

    for child in active_children():
        try:
            os.kill(child.pid, signal.SIGUSR2)
        except OSError:
            pass


@signals.task_failure.connect
def _on_worker_lost(sender: Any = None, exception: BaseException | None = None, args: Any = None, **_: Any) -> None:
    """In the main process: the pool process running a job died (SIGKILL from the kernel's
    out-of-memory killer, a segfault). Say so on the job and end its lease now, so the reaper
    requeues it (or fails it ``worker_lost`` after max_attempts) at its next pass."""
    from billiard.exceptions import WorkerLostError

    if not isinstance(exception, WorkerLostError) or getattr(sender, "name", None) != "qerl.run_job":
        return
    from service import queue

    how = str(exception).removeprefix("Worker exited prematurely: ").split(" Job:")[0].rstrip(".") or "exited"
    try:  # the task may have run another job than its message named: the dead process's lease tells which
        with _session_factory()() as s:
            queue.worker_exited(s, sender.request.hostname, how)
    except Exception as exc:  # the database is down: the reaper recovers the job once the lease runs out
        log.warning("could not record the loss of a job's worker process: %s: %s", type(exc).__name__,
                    str(exc).splitlines()[0][:300] if str(exc) else "")


class Maintenance(bootsteps.StartStopStep):
    """Reaper, sweeper and workdir cleanup on the worker's timer (the main thread's event loop with
    prefork)."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker: Any, **_: Any) -> None:
        self.tref = None

    def start(self, worker: Any) -> None:
        self.tref = worker.timer.call_repeatedly(settings.reap_interval_seconds, maintain, priority=10)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()


_next_cleanup = 0.0  # monotonic time of the next look for finished jobs' workdirs


def maintain() -> None:
    """One reaper + sweeper pass, the webhook events that are due, and every
    ``cleanup_interval_seconds`` the removal of finished jobs' workdirs and of old webhook events;
    errors are logged and the next pass tries again."""
    global _next_cleanup
    from service import queue
    from worker import webhooks
    from worker.artifacts import cleanup

    try:
        with _session_factory()() as s:
            queue.reap(s)
            queue.sweep(s, older_than_s=settings.sweep_after_seconds)
            if time.monotonic() >= _next_cleanup:
                _next_cleanup = time.monotonic() + settings.cleanup_interval_seconds
                cleanup(s, settings)
        webhooks.deliver_due(_session_factory(), settings)
    except Exception as exc:  # e.g. the database is restarting: say so once per pass, briefly
        log.warning("maintenance pass failed: %s: %s", type(exc).__name__, str(exc).splitlines()[0][:300])


app.steps["worker"].add(Maintenance)
