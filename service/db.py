"""Engine and sessions for Postgres (psycopg 3) or SQLite, and Alembic run from code.

SQLite: WAL (readers never block the writer), a busy timeout, foreign keys on, and every
transaction opened with ``BEGIN IMMEDIATE`` so that two writers queue on the lock instead of one
failing with ``database is locked`` when it upgrades a read snapshot that went stale.

Postgres: a pooled connection is checked before use without a round trip (``_check_on_checkout``):
one the server closed (a restart sends each client a FATAL message, then EOF) has input pending on
its idle socket and is replaced; one idle for over ``IDLE_PING_SECONDS`` is pinged. SQLAlchemy's
``pool_pre_ping`` would add a round trip to every request, which under load costs more CPU than
the query it guards.
"""
from __future__ import annotations

import select
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, make_url, text
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
IDLE_PING_SECONDS = 10.0


def make_engine(url: str, *, idle_in_transaction_s: float | None = None, **kwargs: Any) -> Engine:
    """An engine with the per-backend settings above; ``kwargs`` go to ``create_engine``.

    ``idle_in_transaction_s`` (Postgres): the server ends a session whose transaction waits that
    long on its client, releasing its row locks. Workers pass their lease: a worker frozen inside
    a transaction (a stopped host, a process stalled mid-write) would otherwise hold its job's row
    lock for as long as its connection lives, and the reaper, which skips locked rows, could never
    hand the job to another worker."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False,
                                                  "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)
        _configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() != "postgresql":
        return create_engine(url, pool_pre_ping=True, **kwargs)
    connect: dict[str, Any] = {"connect_timeout": 5}
    if idle_in_transaction_s is not None:
        connect["options"] = f"-c idle_in_transaction_session_timeout={max(1, round(idle_in_transaction_s * 1000))}"
    engine = create_engine(url, connect_args=connect, **kwargs)
    _check_on_checkout(engine)
    return engine


def _check_on_checkout(engine: Engine) -> None:
    """Replace a pooled connection the server closed, or that sat idle too long and fails a ping
    (raising DisconnectionError makes the pool retry with a fresh connection)."""

    @event.listens_for(engine, "connect")
    @event.listens_for(engine, "checkin")
    def _idle_from_now(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _check(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if dbapi_conn.closed or input_pending(dbapi_conn.pgconn.socket):
            raise DisconnectionError("the database server closed this connection")
        if time.monotonic() - record.info.get("idle_since", 0.0) > IDLE_PING_SECONDS:
            try:
                engine.dialect.do_ping(dbapi_conn)
            except Exception as exc:
                raise DisconnectionError(f"the database connection failed a ping: {exc}") from exc


def input_pending(fd: int) -> bool:
    """An idle connection has nothing to read; data or EOF there means the server hung up."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def ping(engine: Engine) -> None:
    """Raise when the database cannot answer ``SELECT 1``."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def alembic_config(url: str) -> Any:
    """Alembic's Config built in code, so migrations run from an installed package too."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_head(url: str) -> None:
    """``alembic upgrade head`` against ``url`` (the app and the tests never call create_all)."""
    from alembic import command

    make_url(url)  # fail early on a malformed URL
    if url.startswith("sqlite"):
        make_engine(url).dispose()  # creates the parent directory
    command.upgrade(alembic_config(url), "head")
