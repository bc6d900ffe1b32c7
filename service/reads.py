"""The reads clients poll, behind one async interface: a job (and a queued job's place in the
queue), a page of its events, the events an SSE stream has not sent yet with the job's status,
and an API key on a cache miss.

A status poll is the request a deployment serves most (the CLI polls every second, every open
dashboard every few). Through the ORM in a worker thread it cost ~3.4 ms of CPU on two cores,
most of it the thread hop and SQLAlchemy's per-statement work, and 200 pollers saturated the API
process. ``PostgresReads`` runs each read on the event loop through psycopg's async driver: one
round trip on an autocommit connection from its own small pool, SQL compiled once from the
tables in ``service.models``, rows named like the ORM attributes so the same views render them.
``SessionReads`` does the same reads through the ORM in a worker thread: SQLite (the embedded
server) and anything else.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import bindparam, make_url
from sqlalchemy import select as sql_select
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from service import crud, queue
from service.db import input_pending
from service.models import ApiKey, Job, JobEvent

EVENTS_PER_POLL = 500


def _columns(model: Any) -> list[Any]:
    """Every mapped column, labelled with its attribute name (``metadata`` -> ``user_metadata``)."""
    return [attr.columns[0].label(attr.key) for attr in model.__mapper__.column_attrs]


def _sql(stmt: Any) -> str:
    return str(stmt.compile(dialect=postgresql.psycopg.dialect()))


_JOB = _sql(sql_select(*_columns(Job)).where(Job.id == bindparam("job_id"), Job.project == bindparam("project"),
                                             Job.kind == bindparam("kind")))
_JOB_STATUS = _sql(sql_select(Job.status).where(Job.id == bindparam("job_id")))
_EVENTS_DESC = _sql(sql_select(*_columns(JobEvent)).where(JobEvent.job_id == bindparam("job_id"))
                    .order_by(JobEvent.id.desc()).limit(bindparam("n")))
_EVENTS_DESC_BEFORE = _sql(sql_select(*_columns(JobEvent))
                           .where(JobEvent.job_id == bindparam("job_id"), JobEvent.id < bindparam("before"))
                           .order_by(JobEvent.id.desc()).limit(bindparam("n")))
_EVENTS_SINCE = _sql(sql_select(*_columns(JobEvent))
                     .where(JobEvent.job_id == bindparam("job_id"), JobEvent.id > bindparam("after"))
                     .order_by(JobEvent.id.asc()).limit(bindparam("n")))
_QUEUED = queue.queued_with_turns().compile(dialect=postgresql.psycopg.dialect(),
                                            compile_kwargs={"render_postcompile": True})
_KEY = _sql(sql_select(ApiKey.id, ApiKey.project, ApiKey.prefix, ApiKey.revoked_at)
            .where(ApiKey.key_hash == bindparam("digest")))


class PoolTimeout(Exception):
    """No connection for a polled read within ``db_pool_timeout`` (the API answers 503)."""


class _Pool:
    """Connections for the event loop, as SQLAlchemy's pool hands them to threads: an idle one the
    server has not closed, else a new one (so a database that is down fails the request at once,
    never after a wait), else the next one returned, waited for up to ``timeout`` seconds."""

    def __init__(self, conninfo: str, *, max_size: int, timeout: float) -> None:
        self.conninfo, self.max_size, self.timeout = conninfo, max_size, timeout
        self.idle: list[Any] = []
        self.size = 0  # open connections, idle or lent
        self.returned = asyncio.Condition()

    async def acquire(self) -> Any:
        import psycopg
        from psycopg.rows import namedtuple_row

        deadline = time.monotonic() + self.timeout
        while True:
            while self.idle:
                conn = self.idle.pop()
                if not conn.closed and not input_pending(conn.pgconn.socket):
                    return conn
                self.size -= 1  # closed by the server (a restart): replace it
                await conn.close()
            if self.size < self.max_size:
                self.size += 1
                try:
                    return await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True, connect_timeout=5,
                                                                 row_factory=namedtuple_row)
                except BaseException:
                    self.size -= 1
                    raise
            async with self.returned:
                try:
                    await asyncio.wait_for(self.returned.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise PoolTimeout(f"no database connection for a read within {self.timeout:g} s "
                                      f"({self.max_size} in use)") from None

    async def release(self, conn: Any) -> None:
        from psycopg import pq

        if conn.closed or conn.broken or conn.info.transaction_status != pq.TransactionStatus.IDLE:
            self.size -= 1
            await conn.close()
        else:
            self.idle.append(conn)
        async with self.returned:
            self.returned.notify()

    async def close(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            self.size -= 1
            await conn.close()


class PostgresReads:
    """The polled reads on the event loop (psycopg async, a pool of its own of ``max_size``)."""

    def __init__(self, database_url: str, *, max_size: int, timeout: float, on_change: Callable[[int], None],
                 on_timeout: Callable[[], None]) -> None:
        conninfo = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.pool = _Pool(conninfo, max_size=max_size, timeout=timeout)
        self._on_change, self._on_timeout = on_change, on_timeout

    async def open(self) -> None:
        return None  # connections open on first use: a database still down is /readyz's news

    async def close(self) -> None:
        await self.pool.close()

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[Any]:
        try:
            conn = await self.pool.acquire()
        except PoolTimeout:
            self._on_timeout()
            raise
        self._on_change(+1)
        try:
            yield conn
        finally:
            self._on_change(-1)
            await self.pool.release(conn)

    async def _all(self, sql: str, params: dict[str, Any]) -> list[Any]:
        async with self._connection() as conn:
            cur = await conn.execute(sql, params)
            return await cur.fetchall()

    async def job(self, project: str, job_id: str, kind: str = "fine_tune") -> Any | None:
        rows = await self._all(_JOB, {"job_id": job_id, "project": project, "kind": kind})
        return rows[0] if rows else None

    async def queue_position(self, job_id: str) -> int | None:
        return queue.rank(await self._all(str(_QUEUED), dict(_QUEUED.params))).get(job_id)

    async def events_desc(self, job_id: str, *, before: int | None, limit: int) -> tuple[list[Any], bool]:
        params: dict[str, Any] = {"job_id": job_id, "n": limit + 1}  # one more: are there more?
        if before is not None:
            params["before"] = before
        rows = await self._all(_EVENTS_DESC if before is None else _EVENTS_DESC_BEFORE, params)
        return rows[:limit], len(rows) > limit

    async def status_and_events_since(self, job_id: str, after: int) -> tuple[str | None, list[Any]]:
        """Status first: the worker commits its last event with the terminal status, so a terminal
        status read here means the events read after it include every event."""
        async with self._connection() as conn:
            status = await (await conn.execute(_JOB_STATUS, {"job_id": job_id})).fetchone()
            cur = await conn.execute(_EVENTS_SINCE, {"job_id": job_id, "after": after, "n": EVENTS_PER_POLL})
            return (status[0] if status else None), await cur.fetchall()

    async def key(self, digest: str) -> Any | None:
        rows = await self._all(_KEY, {"digest": digest})
        return rows[0] if rows else None


class SessionReads:
    """The same reads through the ORM, each in a worker thread (SQLite: the embedded server)."""

    def __init__(self, make_session: Callable[[], Session]) -> None:
        self.make_session = make_session

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def read() -> Any:
            with self.make_session() as session:
                result = fn(session, *args, **kwargs)
                session.expunge_all()  # plain values for the event loop: nothing loads lazily later
                session.rollback()
                return result

        return await run_in_threadpool(read)

    async def job(self, project: str, job_id: str, kind: str = "fine_tune") -> Any | None:
        return await self._run(crud.get_job, project, job_id, kind=kind)

    async def queue_position(self, job_id: str) -> int | None:
        return (await self._run(queue.positions_of, [job_id])).get(job_id)

    async def events_desc(self, job_id: str, *, before: int | None, limit: int) -> tuple[list[Any], bool]:
        return await self._run(crud.list_events_desc, job_id, before=before, limit=limit)

    async def status_and_events_since(self, job_id: str, after: int) -> tuple[str | None, list[Any]]:
        def read(session: Session) -> tuple[str | None, list[Any]]:
            status = session.scalar(sql_select(Job.status).where(Job.id == job_id))  # first: see PostgresReads
            return status, crud.events_since(session, job_id, after, EVENTS_PER_POLL)

        return await self._run(read)

    async def key(self, digest: str) -> Any | None:
        def read(session: Session) -> Any | None:
            return session.execute(sql_select(ApiKey.id, ApiKey.project, ApiKey.prefix, ApiKey.revoked_at)
                                   .where(ApiKey.key_hash == digest)).first()

        return await self._run(read)


def make_reads(settings: Any, read_sessionmaker: Callable[[], Session], *, on_change: Callable[[int], None],
               on_timeout: Callable[[], None]) -> PostgresReads | SessionReads:
    if settings.is_sqlite:
        return SessionReads(read_sessionmaker)
    return PostgresReads(str(settings.database_url), max_size=settings.db_read_pool_size,
                         timeout=settings.db_pool_timeout, on_change=on_change, on_timeout=on_timeout)

