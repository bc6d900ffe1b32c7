"""Keeps a claimed job's lease alive from a side thread and turns what it learns into flags.

The engine polls ``should_stop()`` often, so the flags are plain Events it can read without
touching the database: ``cancelled`` and ``pausing`` (the API asked), ``lost`` (reaped,
re-claimed, or the database unreachable for longer than the lease), ``orphaned`` (the Celery
parent process died, so nobody would collect this child's result).

``retry`` runs the worker's other database writes (progress, checkpoints, the outcome) through a
database restart: exponential back-off for as long as the lease lasts since its last renewal.
Past that the reaper may hand the job to another worker, so this one gives up: it sets ``lost``
and raises ``LeaseLost``, so the run ends as one whose lease was lost and records no outcome (an
outcome written once the database is back, before the reaper's next pass, would pass the fence).
A write that does get through is still fenced by the attempt (``queue.fence``), so a worker whose
job was taken over writes nothing.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from service import queue

log = logging.getLogger(__name__)
T = TypeVar("T")
TRANSIENT = (OperationalError, InterfaceError, PoolTimeout)  # the database restarting, a dropped connection
FIRST_RETRY_S, MAX_RETRY_S = 0.25, 5.0


class LeaseKeeper(threading.Thread):
    def __init__(self, sessions: Callable[[], Session], job_id: str, attempt: int, worker_id: str, *,
                 lease_seconds: float, interval_seconds: float, parent_pid: int | None = None) -> None:
        super().__init__(name=f"lease-{job_id}", daemon=True)
        self.sessions, self.job_id, self.attempt, self.worker_id = sessions, job_id, attempt, worker_id
        self.lease_seconds, self.interval = lease_seconds, interval_seconds
        self.parent_pid = parent_pid
        self.cancelled, self.lost, self.orphaned = threading.Event(), threading.Event(), threading.Event()
        self.pausing = threading.Event()
        self.renewed_at = time.monotonic()  # the claim just set the lease
        self._halt = threading.Event()

    def retry(self, write: Callable[[], T], what: str) -> T:
        """``write()``, retried on transient database errors with back-off (0.25 s doubling to 5 s)
        until the lease would run out; then the lease counts as lost (``lost`` set, LeaseLost
        raised from the database's error). LeaseLost and other errors are never retried."""
        delay = FIRST_RETRY_S
        while True:
            try:
                return write()
            except TRANSIENT as exc:
                left = self.renewed_at + self.lease_seconds - time.monotonic()
                if self.lost.is_set() or delay > left:
                    log.warning("job %s attempt %d: lease lost: giving up on %s: the database stayed unreachable "
                                "until the lease (%.0f s) would run out", self.job_id, self.attempt, what,
                                self.lease_seconds)
                    self.lost.set()
                    raise queue.LeaseLost(f"job {self.job_id} attempt {self.attempt}: the database was unreachable "
                                          f"for the rest of the lease while {what}") from exc
                log.warning("job %s: database unavailable while %s (%s); retrying in %.2f s (lease left %.0f s)",
                            self.job_id, what, type(exc.orig if getattr(exc, "orig", None) else exc).__name__,
                            delay, left)
                time.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_S)

    def saw(self, status: str) -> None:
        """The job's status as a write or a heartbeat found it: a cancel or a pause stops the run."""
        if status == "cancelling":
            self.cancelled.set()
        elif status == "pausing":
            self.pausing.set()

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self._halt.wait(self.interval):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("job %s: the worker's parent process is gone; stopping the run", self.job_id)
                self.orphaned.set()
            sent = time.monotonic()  # the new lease runs from (no earlier than) here
            try:
                with self.sessions() as s:
                    self.saw(queue.heartbeat(s, self.job_id, self.attempt, self.worker_id,
                                             lease_seconds=self.lease_seconds))
                if sent - last_ok > self.lease_seconds / 2:  # the lease nearly ran out: say why recovery may kick in
                    log.warning("job %s: heartbeat %.1f s after the previous one (lease %.0f s); the host is "
                                "overloaded or the database slow", self.job_id, sent - last_ok, self.lease_seconds)
                last_ok = self.renewed_at = sent
            except queue.LeaseLost:
                log.warning("job %s attempt %d: lease lost", self.job_id, self.attempt)
                self.lost.set()
                return
            except Exception as exc:  # transient: keep trying until the lease would have run out
                log.warning("job %s: heartbeat failed (%s: %s)", self.job_id, type(exc).__name__,
                            str(exc).splitlines()[0][:200] if str(exc) else "")
                if time.monotonic() - last_ok > self.lease_seconds:
                    log.warning("job %s attempt %d: lease lost: no heartbeat got through for %.0f s (lease %.0f s)",
                                self.job_id, self.attempt, time.monotonic() - last_ok, self.lease_seconds)
                    self.lost.set()
                    return

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self.interval + 30)
