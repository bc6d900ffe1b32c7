"""Shared fixtures: a fresh Postgres database per test session (``alembic upgrade head``,
dropped at the end) and a SQLite one, the app on each (``backend`` param), API keys of two
projects, a live uvicorn server for SDK and concurrency tests, and the tiny model."""
from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from service.auth import create_key
from service.db import make_engine, make_sessionmaker, upgrade_head
from service.settings import Settings

PG_ADMIN = os.environ.get("QERL_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


# -- databases --------------------------------------------------------------------------------
@contextmanager
def pg_database(prefix: str) -> Iterator[str]:
    """A new database on the shared Postgres (``prefix`` + a random suffix), migrated to head,
    dropped at the end (its connections cut)."""
    name = f"{prefix}_{secrets.token_hex(6)}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
        try:
            upgrade_head(url)
            yield url
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A Postgres database of this session, migrated to head, dropped at the end."""
    with pg_database("qerl_test") as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'qerl.db'}"
    upgrade_head(url)
    return url


@pytest.fixture(scope="session")
def database_url(pg_url: str) -> str:
    """The session's Postgres URL (migrated); for tests that need one database."""
    return pg_url


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session", params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    """Parametrizes the API suite: the real Postgres, then the embedded SQLite."""
    return request.param


@pytest.fixture(scope="session")
def db_url(backend: str, request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("pg_url" if backend == "postgres" else "sqlite_url")


@pytest.fixture(scope="session")
def db_sessions(db_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


# -- the app ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def api_settings(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings for the API under test: the backend's database, no broker, no worker thread (job
    execution is tested by the worker's suites), no rate limit, files under a tmp dir."""
    root = tmp_path_factory.mktemp("qerl")
    return Settings(data_dir=root, database_url=db_url, redis_url=None, artifact_dir=root / "artifacts",
                    embedded_worker=False, auto_migrate=False, rate_limit_per_minute=0,
                    config_path=root / "client.json", sse_poll_seconds=0.05)


@pytest.fixture(scope="session")
def client(api_settings: Settings) -> Iterator[TestClient]:
    from service.app import create_app

    with TestClient(create_app(api_settings)) as c:
        yield c


@pytest.fixture
def make_client(api_settings: Settings) -> Iterator[Callable[..., TestClient]]:
    """A client of an app built with some settings changed, e.g. ``make_client(max_upload_bytes=10)``."""
    from service.app import create_app

    opened: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        settings = api_settings.model_copy(update=overrides)
        c = TestClient(create_app(settings))
        c.__enter__()
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.__exit__(None, None, None)


@dataclass
class Key:
    project: str
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


def _key(db_sessions: sessionmaker[Session], label: str) -> Key:
    project = f"proj-{label}-{secrets.token_hex(4)}"
    with db_sessions() as session:
        return Key(project, create_key(session, project, f"test {label}"))


@pytest.fixture
def key_a(db_sessions: sessionmaker[Session]) -> Key:
    """A key of a fresh project (so every test starts with empty lists)."""
    return _key(db_sessions, "a")


@pytest.fixture
def key_b(db_sessions: sessionmaker[Session]) -> Key:
    return _key(db_sessions, "b")


class LiveServer:
    """The app served by uvicorn on a free port, in a thread of this process."""

    def __init__(self, settings: Settings) -> None:
        import uvicorn

        from service.app import create_app

        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="session")
def live_server(api_settings: Settings) -> Iterator[LiveServer]:
    with LiveServer(api_settings) as server:
        yield server


# -- data -------------------------------------------------------------------------------------
STRING_CHECK = {"type": "string_check", "name": "answer", "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}", "operation": "eq"}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def training_rows(n: int = 4) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)}
            for i in range(n)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A random tiny HF checkpoint, registered as model ``tiny`` through QERL_MODELS."""
    from engine.model.tiny import make_tiny_model

    path = Path(make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny"))
    before = os.environ.get("QERL_MODELS")
    table = json.loads(before) if before else {}
    table["tiny"] = str(path)
    os.environ["QERL_MODELS"] = json.dumps(table)
    yield path
    if before is None:
        os.environ.pop("QERL_MODELS", None)
    else:
        os.environ["QERL_MODELS"] = before


from tests._worker_fixtures import *  # noqa: E402,F401,F403
