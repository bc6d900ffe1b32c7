"""Keeps a claimed job's lease alive from a side thread and turns what it learns into flags.

The engine polls ``should_stop()`` often, so the flags are plain Events it can read without
touching the database: ``cancelled`` (the API asked), ``lost`` (reaped, re-claimed, or the
database unreachable for longer than the lease), ``orphaned`` (the Celery parent process died,
so nobody would collect this child's result).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from service import queue

log = logging.getLogger(__name__)


class LeaseKeeper(threading.Thread):
    def __init__(self, sessions: Callable[[], Session], job_id: str, attempt: int, worker_id: str, *,
                 lease_seconds: float, interval_seconds: float, parent_pid: int | None = None) -> None:
        super().__init__(name=f"lease-{job_id}", daemon=True)
        self.sessions, self.job_id, self.attempt, self.worker_id = sessions, job_id, attempt, worker_id
        self.lease_seconds, self.interval = lease_seconds, interval_seconds
        self.parent_pid = parent_pid
        self.cancelled, self.lost, self.orphaned = threading.Event(), threading.Event(), threading.Event()
        self._halt = threading.Event()

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self._halt.wait(self.interval):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("job %s: the worker's parent process is gone; stopping the run", self.job_id)
                self.orphaned.set()
            try:
                with self.sessions() as s:
                    if queue.heartbeat(s, self.job_id, self.attempt, self.worker_id, lease_seconds=self.lease_seconds):
                        self.cancelled.set()
                now = time.monotonic()
                if now - last_ok > self.lease_seconds / 2:  # the lease nearly ran out: say why recovery may kick in
                    log.warning("job %s: heartbeat %.1f s after the previous one (lease %.0f s); the host is "
                                "overloaded or the database slow", self.job_id, now - last_ok, self.lease_seconds)
                last_ok = now
            except queue.LeaseLost:
                log.warning("job %s attempt %d: lease lost", self.job_id, self.attempt)
                self.lost.set()
                return
            except Exception:  # transient: keep trying until the lease would have run out
                log.warning("job %s: heartbeat failed", self.job_id, exc_info=True)
                if time.monotonic() - last_ok > self.lease_seconds:
                    self.lost.set()
                    return

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self.interval + 30)
