"""Faults injected for real while jobs run, on private instances (the shared Postgres on 5432 and
Redis on 6379 are never stopped): Redis stopped and restarted under the API and a Celery worker,
Postgres restarted under both (within the lease, and down for longer than it), a job over its
max_runtime, a job over the worker's memory (a real RLIMIT_AS on the worker's processes), a worker
process SIGKILLed on every attempt (what the kernel's out-of-memory killer does), and the disk
filling up while a checkpoint is written. Each test asserts the end state: job statuses, attempts,
row counts and the event stream. Real ``celery worker`` processes (tests/_worker_fixtures.py) run
the real engine on the tiny model."""
from __future__ import annotations

import glob
import json
import os
import resource
import signal
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select, text

from service import queue
from service.db import make_engine, make_sessionmaker, upgrade_head
from service.models import Adapter, Checkpoint, Job, JobEvent, JobMetric
from service.settings import Settings
from tests.conftest import Key, _key, pg_database

pytestmark = pytest.mark.timeout(600)
PG_OUTAGE_S, PG_JOB_STEPS = 18.0, 12  # far longer than the ~3.5 s the worker used to retry a write
PG_LEASE_S, PG_LONG_OUTAGE_S, PG_LONG_JOB_STEPS = 6.0, 15.0, 16  # an outage of 2.5 leases: the run is given up
WIDE_MODEL_HIDDEN = 1536  # 4 layers: ~160M parameters, ~640 MB of fp32 weights
MEMORY_HEADROOM_MB = 700  # over what an idle worker maps: a tiny job needs ~400 MB of it, the wide model ~1.4 GB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- private service instances -------------------------------------------------------------------
class PrivateRedis:
    """``redis-server`` on a free port, no persistence: a restart loses every queued message."""

    def __init__(self, log: Path) -> None:
        if not shutil.which("redis-server"):
            pytest.skip("redis-server is not installed")
        self.port, self.log, self.proc = free_port(), log, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--daemonize", "no"],
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class PrivatePostgres:
    """A throwaway cluster (initdb) on a free port; as root it runs as the ``postgres`` OS user."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        initdb = bins[-1] if bins else shutil.which("initdb")
        if not initdb:
            pytest.skip("initdb is not installed")
        self.bin = Path(initdb).parent
        self.root = Path(tempfile.mkdtemp(prefix="qerl-pg-"))  # directly under /tmp: the postgres user can reach it
        self.data, self.port = self.root / "data", free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.admin = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.as_user, str(self.bin / tool), *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "-t", "60", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def create_db(self) -> str:
        engine = create_engine(self.admin, isolation_level="AUTOCOMMIT")
        with engine.connect() as c:
            c.execute(text('CREATE DATABASE "qerl"'))
        engine.dispose()
        url = self.admin.rsplit("/", 1)[0] + "/qerl"
        upgrade_head(url)
        return url

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def fresh_db() -> Iterator[str]:
    """A database of this test alone on the shared Postgres (workers claim any queued job in theirs)."""
    with pg_database("qerl_fault") as url:
        yield url


# -- the API and jobs ----------------------------------------------------------------------------
@contextmanager
def api(env: dict[str, str], tmp_path: Path, **over: Any) -> Iterator[TestClient]:
    """The app configured like the workers (their database, broker, queue and artifact store);
    ``over``: other settings."""
    from service.app import create_app

    settings = Settings(data_dir=tmp_path / "api", database_url=env["DATABASE_URL"], redis_url=env["REDIS_URL"],
                        celery_queue=env["QERL_CELERY_QUEUE"], artifact_dir=Path(env["ARTIFACT_DIR"]),
                        embedded_worker=False, auto_migrate=False, rate_limit_per_minute=0,
                        config_path=tmp_path / "client.json", lease_seconds=float(env["QERL_LEASE_SECONDS"]),
                        heartbeat_seconds=float(env["QERL_HEARTBEAT_SECONDS"]),
                        max_attempts=int(env.get("QERL_MAX_ATTEMPTS", 3)), **over)
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            yield client
    finally:
        queue.set_dispatcher(None)  # create_app pointed this process's wake-ups at the test broker


def tiny_job(steps: int = 1, **qerl: Any) -> dict[str, Any]:
    """A job on the tiny model that takes seconds on CPU (2 prompts x 2 samples x 8 tokens a step)."""
    return {"model": "tiny", "seed": 0, "method": {"type": "reinforcement", "reinforcement": {
        "grader": {"type": "reasoning_gym", "name": "task"}}},
        "qerl": {"dataset": {"source": "reasoning_gym", "task": "products", "size": 16}, "quantization": "nvfp4",
                 "device": "cpu", "steps": steps, "prompts_per_step": 2, "micro_batch_size": 4,
                 "checkpoint_interval": 1, "gradient_checkpointing": False, "lora": {"r": 4},
                 "rollout": {"num_generations": 2, "max_new_tokens": 8}, "data": {"eval_size": 0}, **qerl}}


def key_in(url: str, label: str) -> Key:
    engine = make_engine(url)
    try:
        return _key(make_sessionmaker(engine), label)
    finally:
        engine.dispose()


def wait_job(client: TestClient, key: Key, job_id: str, done: Callable[[dict[str, Any]], bool],
             timeout: float = 240) -> dict[str, Any]:
    """Poll GET /v1/fine_tuning/jobs/{id} (503s while a dependency is down are tolerated)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        resp = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key.headers)
        if resp.status_code == 200:
            last = resp.json()
            if done(last):
                return last
        time.sleep(0.3)
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers=key.headers).text
    raise AssertionError(f"job {job_id} did not get there in {timeout:.0f} s: {last}\nevents: {events[-3000:]}")


def finished(job: dict[str, Any]) -> bool:
    return job["status"] in ("succeeded", "failed", "cancelled")


def env_for(worker_queue_env: dict[str, str], **over: str) -> dict[str, str]:
    return {**worker_queue_env, "QERL_CELERY_QUEUE": f"qerl-fault-{secrets.token_hex(4)}", **over}


# -- the faults ----------------------------------------------------------------------------------
@contextmanager
def worker_on_private_postgres(worker_queue_env: dict[str, str], start_workers: Any, label: str,
                               **settings: str) -> Iterator[tuple[PrivatePostgres, dict[str, str], Any, Key]]:
    """A private Postgres (stopped and started by the test), the env pointing at it with the given
    worker settings, one Celery worker started with them and an API key there; destroyed after."""
    if os.geteuid() == 0 and not shutil.which("runuser"):
        pytest.skip("runuser is needed to start Postgres as the postgres user")
    pg = PrivatePostgres()
    try:
        pg.start()
        url = pg.create_db()
        env = env_for(worker_queue_env, DATABASE_URL=url, **settings)
        [worker] = start_workers(1, **{k: env[k] for k in ("DATABASE_URL", "QERL_CELERY_QUEUE", *settings)})
        yield pg, env, worker, key_in(url, label)
    finally:
        pg.destroy()


def test_redis_stopped_and_restarted_loses_no_job(worker_queue_env, start_workers, fresh_db, tmp_path):
    redis = PrivateRedis(tmp_path / "redis.log")
    redis.start()
    env = env_for(worker_queue_env, REDIS_URL=redis.url, DATABASE_URL=fresh_db, QERL_SWEEP_AFTER_SECONDS="2")
    try:
        start_workers(1, **{k: env[k] for k in ("REDIS_URL", "DATABASE_URL", "QERL_CELERY_QUEUE",
                                                "QERL_SWEEP_AFTER_SECONDS")})
        key = key_in(fresh_db, "redis")
        with api(env, tmp_path) as client:
            first = client.post("/v1/fine_tuning/jobs", headers=key.headers, json=tiny_job()).json()["id"]
            redis.stop()
            ready = client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "broker_unavailable"
            during, took = [], []
            for _ in range(3):  # the API keeps accepting jobs: the row is the truth, the wake-up can wait
                start = time.monotonic()
                resp = client.post("/v1/fine_tuning/jobs", headers=key.headers, json=tiny_job())
                took.append(time.monotonic() - start)
                assert resp.status_code == 200, resp.text
                assert resp.json()["status"] == "queued"
                during.append(resp.json()["id"])
            assert client.get(f"/v1/fine_tuning/jobs/{during[0]}", headers=key.headers).status_code == 200
            time.sleep(1)
            redis.start()  # empty: the wake-ups sent before the stop and the ones never sent are gone
            ids = [first, *during]
            jobs = [wait_job(client, key, jid, finished) for jid in ids]
        assert [j["status"] for j in jobs] == ["succeeded"] * 4, jobs
        assert max(took) < 30, took
        engine = make_engine(fresh_db)
        with make_sessionmaker(engine)() as s:
            assert s.scalar(select(func.count()).select_from(Job)) == 4  # none lost, none duplicated
            assert s.scalar(select(func.count()).select_from(Adapter)) == 4
            for jid in ids:
                done = s.scalars(select(JobEvent.message).where(JobEvent.job_id == jid,
                                                                JobEvent.message.like("%successfully completed%")))
                assert len(list(done)) == 1
        engine.dispose()
    finally:
        redis.stop()


def test_postgres_restart_answers_503_and_the_worker_finishes(worker_queue_env, start_workers, tmp_path):
    """An 18 s outage (the lease is 30 s): every API request answers 503, the running job's worker
    retries its writes with back-off and finishes on attempt 1 with every step's metrics."""
    with worker_on_private_postgres(worker_queue_env, start_workers, "pg", QERL_LEASE_SECONDS="30",
                                    QERL_HEARTBEAT_SECONDS="1") as (pg, env, worker, key):
        url = env["DATABASE_URL"]
        with api(env, tmp_path) as client:
            job_id = client.post("/v1/fine_tuning/jobs", headers=key.headers,
                                 json=tiny_job(steps=PG_JOB_STEPS)).json()["id"]
            wait_job(client, key, job_id, lambda j: j["status"] == "running" and j["qerl"]["progress"]["step"] >= 1)
            pg.stop()
            down = time.monotonic()
            for method, path, body in [("GET", f"/v1/fine_tuning/jobs/{job_id}", None),
                                       ("GET", "/v1/fine_tuning/jobs", None),
                                       ("POST", "/v1/fine_tuning/jobs", tiny_job()),
                                       ("GET", f"/v1/fine_tuning/jobs/{job_id}/events", None)]:
                resp = client.request(method, path, headers=key.headers, json=body)
                assert resp.status_code == 503, (path, resp.status_code, resp.text)
                err = resp.json()["error"]
                assert err["code"] == "database_unavailable" and "retry" in err["message"]
                assert int(resp.headers["retry-after"]) > 0
            ready = client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "database_unavailable"
            time.sleep(max(0.0, PG_OUTAGE_S - (time.monotonic() - down)))  # far past the old ~3.5 s of write retries
            pg.start()
            outage = time.monotonic() - down
            job = wait_job(client, key, job_id, finished)
            assert client.get("/readyz").status_code == 200
        assert outage >= PG_OUTAGE_S
        assert job["status"] == "succeeded", job
        assert job["qerl"]["attempt"] == 1, f"the worker should ride out a {outage:.1f} s outage without a requeue"
        # the outage hit one of the run's writes (metrics, an event or a checkpoint record, whichever
        # came first), which waited it out
        assert "database unavailable while " in worker.log()
        engine = make_engine(url)
        with make_sessionmaker(engine)() as s:
            assert s.scalar(select(func.count()).select_from(Job)) == 1  # the POST during the outage made nothing
            steps = sorted(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id, JobMetric.step > 0)))
            assert steps == list(range(1, PG_JOB_STEPS + 1)), steps  # no step's metrics lost to the outage
            assert s.scalar(select(func.count()).select_from(JobEvent).where(  # no requeue, no second start
                JobEvent.job_id == job_id, JobEvent.message.like("%attempt 2%"))) == 0
        engine.dispose()


def test_postgres_down_longer_than_the_lease_requeues_once_and_resumes_from_the_checkpoint(
        worker_queue_env, start_workers, tmp_path):
    """Postgres stopped for 2.5 leases (6 s lease, 15 s outage) while a job runs, after its first
    checkpoint is recorded: the worker retries its writes while the lease lasts, then gives its run
    up (lease lost) without recording an outcome; once the database is back the reaper requeues the
    job once and the same worker resumes it from the latest recorded checkpoint on attempt 2. Every
    step's metrics are there, steps up to that checkpoint were not run again, and attempt 1 wrote
    nothing after the reap."""
    with worker_on_private_postgres(worker_queue_env, start_workers, "pg-long", QERL_LEASE_SECONDS=str(PG_LEASE_S),
                                    QERL_HEARTBEAT_SECONDS="1",
                                    QERL_REAP_INTERVAL_SECONDS="1") as (pg, env, worker, key):
        url = env["DATABASE_URL"]
        with api(env, tmp_path) as client:
            job_id = client.post("/v1/fine_tuning/jobs", headers=key.headers,
                                 json=tiny_job(steps=PG_LONG_JOB_STEPS)).json()["id"]
            deadline = time.monotonic() + 240
            while not client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=key.headers).json()["data"]:
                assert time.monotonic() < deadline, "no checkpoint was recorded"
                time.sleep(0.1)
            before = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key.headers).json()
            assert before["status"] == "running" and before["qerl"]["attempt"] == 1, before
            pg.stop()
            down = time.monotonic()
            time.sleep(max(0.0, PG_LONG_OUTAGE_S - (time.monotonic() - down)))  # the deliberate outage
            pg.start()
            outage = time.monotonic() - down
            job = wait_job(client, key, job_id, finished)
            shown = client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics?limit=1000", headers=key.headers).json()["data"]
        assert outage >= PG_LONG_OUTAGE_S >= 2 * PG_LEASE_S
        assert before["qerl"]["progress"]["step"] < PG_LONG_JOB_STEPS  # the outage began mid-run
        assert job["status"] == "succeeded", job
        assert job["qerl"]["attempt"] == 2, job  # one requeue, no third attempt
        log = worker.log()
        assert "database unavailable while " in log  # it retried while the lease lasted
        assert f"job {job_id} attempt 1: lease lost: " in log  # then counted the lease as lost (worker.lease)
        assert f"job {job_id} attempt 1: lease lost; this worker's run is discarded" in log  # and ended the run
        assert "internal error" not in log  # not a failure of the job: nothing recorded an outcome
        engine = make_engine(url)
        with make_sessionmaker(engine)() as s:
            evs = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))
            messages = [e.message for e in evs]
            [reaped] = [e for e in evs if e.message.startswith("Worker lost")]  # exactly one requeue
            resumed = int(reaped.message.split("from checkpoint step ")[1].split(" ")[0])
            assert resumed >= 1 and reaped.message.endswith("(attempt 2)"), reaped.message
            assert sum(m == "Job started (attempt 1)" for m in messages) == 1, messages
            assert sum(m.startswith("Resuming") for m in messages) == 1, messages
            assert f"Resuming from checkpoint step {resumed} (attempt 2)" in messages, messages
            assert any(e.attempt == 2 and e.message == f"Resumed from checkpoint step {resumed}" for e in evs)
            assert not any("attempt 3" in m or m.startswith("The job failed") for m in messages), messages
            assert sum("successfully completed" in m for m in messages) == 1, messages
            rows = s.execute(select(JobMetric.step, JobMetric.attempt, JobMetric.created_at)
                             .where(JobMetric.job_id == job_id, JobMetric.step > 0)).all()
            by_attempt = {a: sorted(r.step for r in rows if r.attempt == a) for a in (1, 2)}
            assert {r.attempt for r in rows} == {1, 2}
            # attempt 2 started after the checkpoint: nothing up to it was run again
            assert by_attempt[2] == list(range(resumed + 1, PG_LONG_JOB_STEPS + 1)), by_attempt
            # attempt 1 reached at most the step whose checkpoint record the outage cut off
            assert by_attempt[1] == list(range(1, len(by_attempt[1]) + 1)), by_attempt
            assert resumed <= len(by_attempt[1]) <= resumed + 1, by_attempt
            # the fence: attempt 1 wrote nothing once the reaper had taken the job from it
            late = [(r.step, r.created_at) for r in rows if r.attempt == 1 and r.created_at >= reaped.created_at]
            late += [(e.message, e.created_at) for e in evs if e.attempt == 1 and e.id > reaped.id]
            late += list(s.execute(select(Checkpoint.step, Checkpoint.created_at).where(
                Checkpoint.job_id == job_id, Checkpoint.attempt == 1, Checkpoint.created_at >= reaped.created_at)))
            assert late == [], late
        engine.dispose()
        # what the API shows: every step once, from the attempt that counts (the latest)
        assert [(m["step"], m["attempt"]) for m in shown if m["step"] > 0] == \
            [(n, 1 if n <= resumed else 2) for n in range(1, PG_LONG_JOB_STEPS + 1)], shown


def test_a_job_over_its_max_runtime_fails_once_with_a_clear_code(worker_queue_env, start_workers, fresh_db,
                                                                   tmp_path):
    env = env_for(worker_queue_env, DATABASE_URL=fresh_db)
    start_workers(1, DATABASE_URL=fresh_db, QERL_CELERY_QUEUE=env["QERL_CELERY_QUEUE"])
    key = key_in(fresh_db, "runtime")
    with api(env, tmp_path) as client:
        job_id = client.post("/v1/fine_tuning/jobs", headers=key.headers,
                             json=tiny_job(steps=200, max_runtime_s=2)).json()["id"]
        job = wait_job(client, key, job_id, finished)
        assert job["status"] == "failed" and job["error"]["code"] == "max_runtime_exceeded", job
        assert "max_runtime_s" in job["error"]["message"]
        again, _ = _still_failed_once(client, key, job_id, env)
    assert again["qerl"]["progress"]["step"] < 200  # stopped early, not run to the end


def _after_reaper_passes(client: TestClient, key: Key, job_id: str, env: dict[str, str]) -> tuple[dict, list[str]]:
    """The job and its event messages once three reaper passes and a lease have gone by."""
    time.sleep(3 * float(env["QERL_REAP_INTERVAL_SECONDS"]) + float(env["QERL_LEASE_SECONDS"]))
    again = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key.headers).json()
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=1000", headers=key.headers).json()["data"]
    return again, [e["message"] for e in events]


def _still_failed_once(client: TestClient, key: Key, job_id: str, env: dict[str, str]) -> tuple[dict, list[str]]:
    """A failed job, after later reaper passes: still failed on attempt 1 (no requeue loop), one
    failure event, no resume. Returns the job and its event messages."""
    again, messages = _after_reaper_passes(client, key, job_id, env)
    assert again["status"] == "failed" and again["qerl"]["attempt"] == 1
    assert not any("requeued" in m or "Resuming" in m for m in messages), messages
    assert sum("The job failed" in m for m in messages) == 1
    return again, messages


def _vm_size_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmSize for pid {pid}")


def _pool_processes(worker: Any) -> list[int]:
    """The Celery main process and its pool children."""
    main = worker.proc.pid
    return [main, *(int(c) for c in Path(f"/proc/{main}/task/{main}/children").read_text().split())]


def test_a_job_over_the_worker_memory_fails_once_with_out_of_memory(worker_queue_env, start_workers, fresh_db,
                                                                     tmp_path, monkeypatch):
    """A real cap (RLIMIT_AS, as `prlimit --as` or `ulimit -v` sets it) on a real worker: a small job
    still fits, a job on a model too big for it fails ``out_of_memory`` on attempt 1 and stays
    failed through later reaper passes (no requeue loop), with one failure event."""
    from engine.model.tiny import make_tiny_model

    wide = make_tiny_model(tmp_path / "wide", hidden=WIDE_MODEL_HIDDEN, layers=4)
    models = json.dumps({**json.loads(worker_queue_env.get("QERL_MODELS") or "{}"), "wide": str(wide)})
    monkeypatch.setenv("QERL_MODELS", models)  # the API checks model names too
    env = env_for(worker_queue_env, DATABASE_URL=fresh_db, QERL_MODELS=models)
    [worker] = start_workers(1, DATABASE_URL=fresh_db, QERL_CELERY_QUEUE=env["QERL_CELERY_QUEUE"], QERL_MODELS=models)
    limit_mb = _vm_size_mb(worker.proc.pid) + MEMORY_HEADROOM_MB
    for pid in _pool_processes(worker):  # the running pool process, and the main one later ones fork from
        resource.prlimit(pid, resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    key = key_in(fresh_db, "memory")
    with api(env, tmp_path) as client:
        small = client.post("/v1/fine_tuning/jobs", headers=key.headers, json=tiny_job(steps=1)).json()["id"]
        assert wait_job(client, key, small, finished)["status"] == "succeeded"  # the cap leaves room for real work
        big = client.post("/v1/fine_tuning/jobs", headers=key.headers,
                          json={**tiny_job(steps=1), "model": "wide"}).json()["id"]
        job = wait_job(client, key, big, finished)
        assert job["status"] == "failed" and job["error"]["code"] == "out_of_memory", job
        assert "smaller model" in job["error"]["message"]
        _, messages = _still_failed_once(client, key, big, env)
    assert worker.proc.poll() is None  # the worker survived its job's failure
    assert not any("Worker lost" in m for m in messages), messages
    assert sum(m.startswith("Job started") for m in messages) == 1


def test_a_worker_killed_on_every_attempt_fails_the_job_after_max_attempts(worker_queue_env, start_workers,
                                                                            fresh_db, tmp_path):
    """The pool process running the job is SIGKILLed on each attempt (what the kernel's out-of-memory
    killer does to the biggest process): the worker's main process reports the signal and ends the
    lease, the reaper requeues once, then fails the job ``worker_lost`` naming SIGKILL and memory;
    nothing runs a third time, and the worker goes on to run the next job."""
    env = env_for(worker_queue_env, DATABASE_URL=fresh_db, QERL_MAX_ATTEMPTS="2")
    [worker] = start_workers(1, DATABASE_URL=fresh_db, QERL_CELERY_QUEUE=env["QERL_CELERY_QUEUE"])
    key = key_in(fresh_db, "killed")
    engine = make_engine(fresh_db)
    sessions = make_sessionmaker(engine)
    try:
        with api(env, tmp_path) as client:
            job_id = client.post("/v1/fine_tuning/jobs", headers=key.headers, json=tiny_job(steps=400)).json()["id"]
            killed = []
            for attempt in (1, 2):
                wait_job(client, key, job_id, lambda j, n=attempt: j["status"] == "running" and  # type: ignore[misc]
                         j["qerl"]["attempt"] == n and j["qerl"]["progress"]["step"] >= 1)
                with sessions() as s:
                    owner = s.get(Job, job_id).lease_owner  # "<node>:<pid of the pool process>"
                pid = int(owner.rsplit(":", 1)[1])
                assert pid in _pool_processes(worker)[1:]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            job = wait_job(client, key, job_id, finished, timeout=120)
            again, messages = _after_reaper_passes(client, key, job_id, env)
            assert worker.proc.poll() is None  # the main process lives on and takes the next job
            after = client.post("/v1/fine_tuning/jobs", headers=key.headers, json=tiny_job(steps=1)).json()["id"]
            assert wait_job(client, key, after, finished)["status"] == "succeeded"
    finally:
        engine.dispose()
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job
    assert "attempt 2 of 2" in job["error"]["message"] and "SIGKILL" in job["error"]["message"]
    assert "out-of-memory killer" in job["error"]["message"]
    assert again["status"] == "failed" and again["qerl"]["attempt"] == 2  # no third attempt, ever
    assert sum(m.startswith(("Job started", "Resuming")) for m in messages) == 2, messages
    assert sum(m.startswith("The worker process running attempt") and "died: signal 9 (SIGKILL)" in m
               for m in messages) == 2, messages
    assert sum(m.startswith("Worker lost; resuming") for m in messages) == 1, messages
    assert sum(m.startswith("Worker lost on attempt 2 of 2") for m in messages) == 1, messages  # the one failure
    assert len(set(killed)) == 2


@contextmanager
def small_filesystem(path: Path, size_mb: int) -> Iterator[str]:
    """A size-limited tmpfs at ``path`` (real ENOSPC), or RLIMIT_FSIZE when mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "qerl-disk-full", str(path)],
                             capture_output=True).returncode == 0 if shutil.which("mount") else False
    try:
        yield "tmpfs" if mounted else "rlimit"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_disk_full_while_saving_a_checkpoint_keeps_the_previous_one(worker_queue_env, start_workers, fresh_db,
                                                                     tmp_path):
    from engine.checkpoint import list_checkpoints, load_checkpoint

    artifacts = tmp_path / "artifacts"
    env = env_for(worker_queue_env, DATABASE_URL=fresh_db, ARTIFACT_DIR=str(artifacts))
    with small_filesystem(artifacts / "jobs", 64) as how:
        if how != "tmpfs":
            pytest.skip("mounting a size-limited tmpfs is not allowed here")
        start_workers(1, DATABASE_URL=fresh_db, QERL_CELERY_QUEUE=env["QERL_CELERY_QUEUE"], ARTIFACT_DIR=str(artifacts))
        key = key_in(fresh_db, "disk")
        with api(env, tmp_path) as client:
            job_id = client.post("/v1/fine_tuning/jobs", headers=key.headers,
                                 json=tiny_job(steps=40, checkpoint_interval=2)).json()["id"]
            ckpts = artifacts / "jobs" / job_id / "checkpoints"
            deadline = time.monotonic() + 240
            while not list_checkpoints(ckpts):
                assert time.monotonic() < deadline, "no checkpoint was written"
                time.sleep(0.05)
            kept = list_checkpoints(ckpts)[-1]
            filler = artifacts / "jobs" / "filler"
            with open(filler, "wb") as fh:  # take every byte that is left
                try:
                    while True:
                        fh.write(b"\0" * (1 << 20))
                except OSError:
                    pass
            job = wait_job(client, key, job_id, finished)
            events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=1000", headers=key.headers).json()
        assert job["status"] == "failed", job
        assert job["error"]["code"] == "disk_full", job["error"]
        message = job["error"]["message"]
        assert "No space left on device" in message and str(artifacts / "jobs" / job_id) in message
        assert "Free space" in message
        assert job["qerl"]["attempt"] == 1
        # the previous checkpoint is intact and loads; no half-written step directory is visible
        saved = list_checkpoints(ckpts)
        assert kept in saved
        ckpt = load_checkpoint(saved[-1])
        assert ckpt.step >= 2 and ckpt.adapter and all(v.isfinite().all() for v in ckpt.adapter.values())
        assert all(p.name.startswith("step-") for p in saved)
        assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp-")]  # the partial copy was removed
        engine = make_engine(fresh_db)
        with make_sessionmaker(engine)() as s:
            rows = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
            assert rows and all((artifacts / r.path).is_dir() for r in rows)  # every recorded checkpoint exists
        engine.dispose()
        assert any(e["level"] == "error" for e in events["data"])
