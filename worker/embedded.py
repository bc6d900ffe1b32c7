"""The embedded worker: one in-process thread for ``qerl serve`` without a broker (SQLite).

It uses the same claim / lease / run code as the Celery task. Instead of messages it loops on
``claim_next`` and sleeps on an Event that ``queue.wake`` sets, so a wake-up can never be lost
(the sweeper's job is done by the loop itself). A second thread runs the reaper, so a job left
running by a killed server is resumed after its lease expires, the webhook deliveries and the
removal of finished jobs' workdirs, also while a job runs.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from service import queue
from service.db import make_engine, make_sessionmaker
from worker import webhooks
from worker.artifacts import cleanup
from worker.runner import WorkerContext, run_next

log = logging.getLogger(__name__)


class EmbeddedWorker:
    def __init__(self, settings: Any, *, poll_seconds: float | None = None) -> None:
        self.engine = make_engine(str(settings.database_url), idle_in_transaction_s=float(settings.lease_seconds))
        self.ctx = WorkerContext(settings=settings, sessions=make_sessionmaker(self.engine),
                                 worker_id=f"embedded:{socket.gethostname()}:{os.getpid()}",
                                 shutdown=threading.Event())
        self.poll_seconds = poll_seconds or float(settings.reap_interval_seconds)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qerl-embedded-worker", daemon=True)
        self._maintenance = threading.Thread(target=self._maintain, name="qerl-embedded-maintenance", daemon=True)

    def start(self) -> "EmbeddedWorker":
        queue.set_dispatcher(self.poke)
        self._maintenance.start()
        self._thread.start()
        return self

    def poke(self, job_id: str | None = None) -> None:
        self._wake.set()

    def stop(self, timeout: float | None = 120) -> None:
        """Stop taking jobs; a running job checkpoints and goes back to the queue (resumed on
        the next start), then the thread ends."""
        queue.set_dispatcher(None)
        self.ctx.shutdown.set()
        self._wake.set()
        self._thread.join(timeout)
        self._maintenance.join(timeout)
        if self._thread.is_alive() or self._maintenance.is_alive():
            log.warning("embedded worker did not stop within %s s", timeout)
        else:
            self.engine.dispose()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        """Run queued jobs, oldest first, one at a time; sleep until poked (or ``poll_seconds``)."""
        while not self.ctx.shutdown.is_set():
            try:
                self._wake.clear()
                if run_next(self.ctx) is not None:
                    continue
            except Exception:  # a database hiccup must not kill the thread
                log.exception("embedded worker loop error")
            self._wake.wait(self.poll_seconds)

    def _maintain(self) -> None:
        """Every ``poll_seconds``, also while a job runs: the reaper (a requeued job pokes the
        loop), webhook deliveries, and every ``cleanup_interval_seconds`` the cleanup."""
        settings, next_cleanup = self.ctx.settings, 0.0
        while not self.ctx.shutdown.is_set():
            try:
                with self.ctx.sessions() as s:
                    queue.reap(s)
                    if time.monotonic() >= next_cleanup:
                        next_cleanup = time.monotonic() + settings.cleanup_interval_seconds
                        cleanup(s, settings)
                webhooks.deliver_due(self.ctx.sessions, settings)
            except Exception:  # a database hiccup must not kill the thread
                log.exception("embedded worker maintenance error")
            self.ctx.shutdown.wait(self.poll_seconds)


def start_embedded_worker(settings: Any, **kw: Any) -> EmbeddedWorker:
    """Start the in-process worker; call ``.stop()`` on shutdown."""
    return EmbeddedWorker(settings, **kw).start()
