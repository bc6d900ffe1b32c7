"""The FastAPI application factory.

Embedded mode (no REDIS_URL): on startup the app migrates the database, creates a first API key
(printed and saved for the CLI) and starts the in-process worker thread. With a broker, the app
only serves HTTP; migrations are ``qerl migrate`` and workers are ``qerl worker`` processes.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.exc import OperationalError

from service import errors
from service.auth import KeyCache, ensure_default_key
from service.db import make_engine, make_sessionmaker, upgrade_head
from service.middleware import BodyLimitMiddleware
from service.observability import Metrics, MetricsMiddleware
from service.ratelimit import RateLimiter
from service.reads import make_reads
from service.routes import api_router, health
from service.settings import Settings, get_settings
from service.storage import open_store

log = logging.getLogger(__name__)


def _start(app: FastAPI, settings: Settings) -> None:
    app.state.store.ensure()
    app.state.store.sweep_tmp()
    if settings.should_migrate:
        upgrade_head(str(settings.database_url))
    if settings.embedded:
        try:
            ensure_default_key(app.state.sessionmaker, settings.base_url, settings.client_config_path)
        except OperationalError as exc:  # serve anyway: /readyz says what is wrong until the DB is back
            log.error("database unreachable at startup, no default API key ensured: %s", exc)
    else:
        from service import queue

        configure = getattr(queue, "configure", None)
        if configure is not None:
            configure(settings)
    if settings.embedded and settings.embedded_worker:
        from worker.embedded import start_embedded_worker

        app.state.worker = start_embedded_worker(settings)
        log.info("embedded worker started")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    await run_in_threadpool(_start, app, settings)
    metrics: Metrics = app.state.metrics
    app.state.reads = make_reads(settings, app.state.read_sessionmaker, on_change=metrics.pool.changed,
                                 on_timeout=metrics.pool.timed_out)
    await app.state.reads.open()
    # What exists now (modules, the app, SQLAlchemy's and pydantic's caches) lives as long as the
    # process: out of the collector's sight, a full collection under load takes microseconds, not
    # the ~70 ms pause that scanning these ~100k objects costs on every one.
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        await app.state.reads.close()
        worker: Any = getattr(app.state, "worker", None)
        if worker is not None:
            await run_in_threadpool(worker.stop)
        app.state.engine.dispose()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(title="qerl", version="0.1.0", lifespan=lifespan,
                  description="RL fine-tuning (NVFP4 base, LoRA, GRPO/DAPO, AQN) behind OpenAI's fine-tuning API")
    app.state.settings = settings
    pool = {} if settings.is_sqlite else dict(pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow,
                                             pool_timeout=settings.db_pool_timeout)
    app.state.engine = make_engine(str(settings.database_url), **pool)
    app.state.sessionmaker = make_sessionmaker(app.state.engine)
    app.state.read_sessionmaker = (app.state.sessionmaker if settings.is_sqlite else  # see deps.get_read_session
                                   make_sessionmaker(app.state.engine.execution_options(isolation_level="AUTOCOMMIT")))
    app.state.store = open_store(settings)
    app.state.rate_limiter = RateLimiter(settings.rate_limit_per_minute)
    app.state.key_cache = KeyCache(settings.auth_cache_seconds)
    app.state.metrics = metrics = Metrics(app.state.sessionmaker)
    metrics.pool.attach(app.state.engine)
    if not settings.is_sqlite:
        metrics.pool.add_capacity(settings.db_read_pool_size)
    app.state.reads = None  # set at startup (service.reads: its pool lives on the server's event loop)
    app.state.worker = None

    errors.install(app)
    app.include_router(health.router)
    app.include_router(api_router)
    try:
        from service.dashboard import router as dashboard_router
    except ImportError:
        log.info("dashboard not installed")
    else:
        app.include_router(dashboard_router)

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.add_middleware(BodyLimitMiddleware, max_upload_bytes=settings.max_upload_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
