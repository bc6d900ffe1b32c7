"""Prometheus metrics: request counts and latency by route template, jobs by status, the queue's
oldest job and the projects waiting.

Each app gets its own registry (several apps in one test process must not collide); job counts
are read from the database at scrape time, so every API replica reports the same truth.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import crud
from service.views import ACTIVE, TERMINAL, unix

log = logging.getLogger(__name__)


class JobsCollector(Collector):
    def __init__(self, make_session: sessionmaker[Session]) -> None:
        self.make_session = make_session

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("qerl_jobs", "Fine-tuning jobs by status", labels=["status"])
        try:
            with self.make_session() as session:
                counts = crud.count_jobs_by_status(session)
                oldest, projects = crud.queue_summary(session)
        except Exception:  # the scrape still reports request metrics when the database is down
            log.warning("could not count jobs for /metrics", exc_info=True)
            return
        for status in (*ACTIVE, *TERMINAL):
            family.add_metric([status], counts.get(status, 0))
        yield family
        age = 0.0 if oldest is None else max(0.0, time.time() - (unix(oldest) or 0))
        yield GaugeMetricFamily("qerl_queue_oldest_job_age_seconds", "Seconds since the oldest queued job was "
                                "created (0: nothing queued); alert when workers fall behind", value=age)
        yield GaugeMetricFamily("qerl_queue_projects", "Projects with jobs queued (they take turns for workers)",
                                value=projects)


class PoolStats(Collector):
    """The database pools as Prometheus sees them (the ORM's pool plus, on Postgres, the polled
    reads' pool of service.reads): connections checked out now, the peak since start, the
    configured capacity, and how many requests waited past the pool timeout (should stay 0)."""

    def __init__(self) -> None:
        self.checked_out = self.peak = self.timeouts = 0
        self.size = self.overflow = 0
        self._lock = threading.Lock()

    def attach(self, engine: Engine) -> None:
        pool = engine.pool
        self.size, self.overflow = getattr(pool, "size", lambda: 0)(), getattr(pool, "_max_overflow", 0)

        @event.listens_for(engine, "checkout")
        def _out(*_: Any) -> None:
            self.changed(+1)

        @event.listens_for(engine, "checkin")
        def _in(*_: Any) -> None:
            self.changed(-1)

    def add_capacity(self, n: int) -> None:
        self.size += n

    def changed(self, delta: int) -> None:
        with self._lock:
            self.checked_out += delta
            self.peak = max(self.peak, self.checked_out)

    def timed_out(self) -> None:
        with self._lock:
            self.timeouts += 1

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, doc, value in [("qerl_db_pool_checked_out", "Connections in use now", self.checked_out),
                                 ("qerl_db_pool_checked_out_peak", "Most connections in use at once", self.peak),
                                 ("qerl_db_pool_capacity", "pool_size + max_overflow", self.size + self.overflow),
                                 ("qerl_db_pool_timeouts", "Requests that found no free connection in time",
                                  self.timeouts)]:
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, make_session: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("qerl_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("qerl_http_request_duration_seconds", "HTTP request latency (to the first "
                                 "response byte)", ["method", "route"], registry=self.registry)
        self.registry.register(JobsCollector(make_session))
        self.pool = PoolStats()
        self.registry.register(self.pool)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI (streams pass through untouched); the route label is the path template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]
        observed = [False]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                self._observe(scope, status[0], time.perf_counter() - start)
                observed[0] = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if not observed[0]:
                self._observe(scope, status[0], time.perf_counter() - start)

    def _observe(self, scope: Scope, status: int, seconds: float) -> None:
        label = route_template(scope)
        self.metrics.requests.labels(scope["method"], label, str(status)).inc()
        self.metrics.latency.labels(scope["method"], label).observe(seconds)


def route_template(scope: Scope) -> str:
    """``/v1/fine_tuning/jobs/{job_id}`` for any job id (bounded label values); routes of an
    included router may carry only their own part of the path, so the prefix is taken from the URL."""
    route: Any = scope.get("route")
    template = getattr(route, "path", None)
    if not template:
        return "unmatched"
    head = template.split("{")[0]
    at = scope["path"].find(head) if head else -1
    return scope["path"][:at] + template if at > 0 else template
