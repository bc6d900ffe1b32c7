"""Fixtures for queue and worker tests: databases of their own (Postgres after ``alembic upgrade
head``, and SQLite) because claim_next and the reaper act on every job in a database, real
Celery worker processes on a queue of their own, and helpers to make jobs and wait for them."""
from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service import queue
from service.db import make_engine, make_sessionmaker, upgrade_head
from service.models import Job, JobEvent
from tests.conftest import pg_database

__all__ = ["worker_pg_url", "worker_sqlite_url", "any_db_url", "sessions", "pg_sessions", "dispatched",
           "worker_queue_env", "celery_queue", "celery_sender", "start_workers", "WorkerProcess",
           "tiny_spec", "make_job", "events", "wait_for_status", "cancel_leftovers"]

REPO = Path(__file__).resolve().parent.parent
REDIS_BASE = os.environ.get("QERL_TEST_REDIS", "redis://127.0.0.1:6379")


# -- databases --------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def worker_pg_url() -> Iterator[str]:
    """A Postgres database of this test session, migrated to head, dropped at the end."""
    with pg_database("qerl_worker") as url:
        yield url


@pytest.fixture(scope="session")
def worker_sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'qerl.db'}"
    upgrade_head(url)
    return url


@pytest.fixture(params=["postgres", "sqlite"])
def any_db_url(request: pytest.FixtureRequest) -> str:
    """Run a test once on Postgres and once on SQLite (the embedded default)."""
    return request.getfixturevalue("worker_pg_url" if request.param == "postgres" else "worker_sqlite_url")


@pytest.fixture
def sessions(any_db_url: str) -> Iterator[Callable[[], Session]]:
    engine = make_engine(any_db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def pg_sessions(worker_pg_url: str) -> Iterator[Callable[[], Session]]:
    engine = make_engine(worker_pg_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def cancel_leftovers(sessions: Callable[[], Session]) -> None:
    """Tests share a database and claim_next/reap act on all of it: end what earlier tests left."""
    with sessions() as s:
        s.execute(update(Job).where(Job.status.in_(("queued", "running", "cancelling"))).values(status="cancelled"))
        s.commit()


@pytest.fixture
def dispatched() -> Iterator[list[str]]:
    """Capture wake-ups in-process (a unit-test double of the broker, for queue tests only)."""
    sent: list[str] = []
    queue.set_dispatcher(sent.append)
    yield sent
    queue.set_dispatcher(None)


# -- jobs -------------------------------------------------------------------------------------
def tiny_spec(model_dir: Path | str, **over: Any) -> dict[str, Any]:
    """A training job that takes a few seconds on CPU: 2 prompts x 2 samples x 8 tokens."""
    spec: dict[str, Any] = {
        "model": str(model_dir), "quantization": "nvfp4", "device": "cpu", "seed": 0,
        "steps": 3, "prompts_per_step": 2, "micro_batch_size": 4, "checkpoint_interval": 1,
        "gradient_checkpointing": False,
        "lora": {"r": 4},
        "rollout": {"num_generations": 2, "max_new_tokens": 8},
        "data": {"dataset": {"source": "reasoning_gym", "task": "products", "size": 16}, "eval_size": 0},
        "grader": {"type": "reasoning_gym", "name": "task"},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict):
            spec[k] = {**spec[k], **v}
        else:
            spec[k] = v
    return spec


def make_job(session: Session, spec: dict[str, Any], *, status: str = "queued", project: str = "proj-test",
             **fields: Any) -> Job:
    fields.setdefault("model", spec.get("model", "tiny"))
    job = Job(project=project, status=status, request={"model": fields["model"]}, spec=spec, **fields)
    session.add(job)
    session.commit()
    return job


def events(session: Session, job_id: str) -> list[JobEvent]:
    return list(session.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).scalars())


def wait_for_status(sessions: Callable[[], Session], job_id: str, statuses: str | tuple[str, ...], *,
                    timeout: float = 120, poll: float = 0.2) -> Job:
    """Poll until the job reaches one of ``statuses``; fail with its events on timeout."""
    wanted = (statuses,) if isinstance(statuses, str) else statuses
    deadline = time.monotonic() + timeout
    while True:
        with sessions() as s:
            job = s.get(Job, job_id)
            if job is not None and job.status in wanted:
                return job
            if time.monotonic() > deadline:
                log = "\n".join(f"  [{e.attempt}] {e.level}: {e.message}" for e in events(s, job_id))
                raise AssertionError(f"job {job_id} is {job.status if job else 'missing'} after {timeout:.0f} s, "
                                     f"wanted {wanted}; events:\n{log}")
        time.sleep(poll)


# -- real Celery workers ----------------------------------------------------------------------
class WorkerProcess:
    """One ``celery worker`` process group (main + its pool child)."""

    def __init__(self, name: str, env: dict[str, str], log_path: Path, *, via_cli: bool = False) -> None:
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "wb")
        if via_cli:  # what operators run
            cmd = [sys.executable, "-m", "qerl.cli", "worker", "-Q", env["QERL_CELERY_QUEUE"], "-n", f"{name}@%h"]
        else:
            cmd = [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "--concurrency", "1",
                   "--prefetch-multiplier", "1", "--max-tasks-per-child", "1", "-Q", env["QERL_CELERY_QUEUE"],
                   "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(r"\bready\.", self.log()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} not ready after {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.2)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (a crashed host/container loses main and child together)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self, timeout: float = 120) -> int:
        """Warm shutdown, as ``docker stop`` does: SIGTERM to the main process only."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def close(self) -> None:
        self.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        self._log.close()


@pytest.fixture(scope="session")
def worker_queue_env(worker_pg_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> dict[str, str]:
    """Environment for worker processes: this session's DB, a Redis database (each test adds a
    queue of its own, ``celery_queue``), a short lease so the reaper acts within seconds (long enough that a machine shared by many
    test runs does not miss it), and the ``tiny`` model registered."""
    artifacts = tmp_path_factory.mktemp("artifacts")
    env = {k: v for k, v in os.environ.items()
           if k == "QERL_MODELS" or not k.startswith(("QERL_", "DATABASE_URL", "REDIS_URL", "ARTIFACT_DIR"))}
    env.update({
        "DATABASE_URL": worker_pg_url,
        "REDIS_URL": f"{REDIS_BASE}/{int(secrets.token_hex(1), 16) % 15 + 1}",
        "ARTIFACT_DIR": str(artifacts),
        "QERL_DATA_DIR": str(artifacts.parent / "data"),
        "QERL_LEASE_SECONDS": "8",
        "QERL_HEARTBEAT_SECONDS": "0.5",
        "QERL_SWEEP_AFTER_SECONDS": "4",
        "QERL_REAP_INTERVAL_SECONDS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
    })
    return env


@pytest.fixture
def celery_queue(worker_queue_env: dict[str, str]) -> Iterator[str]:
    """A Redis queue of this test only: no message of an earlier test reaches its workers."""
    name = f"qerl-test-{secrets.token_hex(4)}"
    yield name
    import redis

    client = redis.Redis.from_url(worker_queue_env["REDIS_URL"])
    client.delete(name, f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}")
    client.close()


@pytest.fixture
def celery_sender(worker_queue_env: dict[str, str], celery_queue: str) -> Iterator[queue.CelerySender]:
    """queue.wake() in this process sends real Celery messages to the test's queue."""
    sender = queue.CelerySender(worker_queue_env["REDIS_URL"], celery_queue)
    queue.set_dispatcher(sender)
    yield sender
    queue.set_dispatcher(None)


@pytest.fixture
def start_workers(worker_queue_env: dict[str, str], celery_queue: str, celery_sender: queue.CelerySender,
                  tmp_path: Path) -> Iterator[Callable[..., list[WorkerProcess]]]:
    """``start_workers(n, **env)`` starts n real Celery workers on the test's queue and waits
    until they consume; queue.wake() in the test reaches them."""
    procs: list[WorkerProcess] = []

    def start(n: int = 1, *, via_cli: bool = False, **env_over: str) -> list[WorkerProcess]:
        env = {**worker_queue_env, "QERL_CELERY_QUEUE": celery_queue, **env_over}
        new = [WorkerProcess(f"w{len(procs) + i}-{secrets.token_hex(2)}", env, tmp_path / f"worker{len(procs) + i}.log",
                             via_cli=via_cli) for i in range(n)]
        procs.extend(new)
        for p in new:
            p.wait_ready()
        return new

    yield start
    for p in procs:
        p.close()
