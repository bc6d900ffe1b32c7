"""/healthz, /readyz (503 with a clear error when the database or the broker is down),
/metrics, an exhausted read pool answering 503, the migration matching the ORM on both backends,
and the service staying torch-free."""
from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select, update

from service.db import make_engine
from service.models import Base, Job, utcnow
from tests.test_api_files import assert_error
from tests.test_hostile_api import RG_JOB


def test_healthz_and_readyz(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready", "database": "ok", "broker": "embedded"}


def test_readyz_503_when_the_database_is_unreachable(make_client):
    down = make_client(database_url="postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    err = assert_error(down.get("/readyz"), 503, code="database_unavailable")
    assert "DATABASE_URL" in err["message"]
    assert down.get("/healthz").status_code == 200


def test_readyz_checks_the_broker(make_client):
    # a live broker (the test Redis) and a dead one; nothing is sent, only PING
    assert make_client(redis_url="redis://127.0.0.1:6379/0").get("/readyz").json()["broker"] == "ok"
    err = assert_error(make_client(redis_url="redis://127.0.0.1:1/0").get("/readyz"), 503, code="broker_unavailable")
    assert "REDIS_URL" in err["message"]


def test_prometheus_metrics(client, key_a):
    client.get("/v1/fine_tuning/jobs", headers=key_a.headers)
    text = client.get("/metrics").text
    assert 'qerl_http_requests_total{method="GET",route="/v1/fine_tuning/jobs",status="200"}' in text
    assert "qerl_http_request_duration_seconds_bucket" in text
    assert 'qerl_jobs{status="queued"}' in text


def _gauge(text: str, name: str) -> float:
    [line] = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def test_prometheus_reports_the_queues_oldest_job_and_its_projects(client, key_a, key_b, db_sessions):
    ids = [client.post("/v1/fine_tuning/jobs", headers=key.headers,
                       json={"model": "smollm2-135m-instruct",
                             "qerl": {"dataset": {"source": "reasoning_gym", "task": "products", "size": 40}}}).json()["id"]
           for key in (key_a, key_a, key_b)]
    before = client.get("/metrics").text
    with db_sessions() as s:  # the first job has waited two hours
        s.execute(update(Job).where(Job.id == ids[0]).values(created_at=utcnow() - timedelta(hours=2)))
        s.commit()
    after = client.get("/metrics").text
    assert _gauge(after, "qerl_queue_oldest_job_age_seconds") >= 7200 > _gauge(before, "qerl_queue_oldest_job_age_seconds")
    with db_sessions() as s:
        projects = s.scalar(select(func.count(Job.project.distinct())).where(Job.status == "queued"))
    assert _gauge(after, "qerl_queue_projects") == projects >= 2
    for jid, key in zip(ids, (key_a, key_a, key_b)):
        client.post(f"/v1/fine_tuning/jobs/{jid}/cancel", headers=key.headers)
    assert _gauge(client.get("/metrics").text, "qerl_queue_oldest_job_age_seconds") < 7200


def test_migration_matches_the_models(db_url):
    engine = make_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []


def test_the_service_does_not_import_torch():
    code = ("import sys; import service.app, service.routes, qerl.cli_service; "
            "service.app.create_app; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_exhausted_read_pool_answers_503_then_recovers(make_client, key_a, backend):
    """The polled reads' own pool (service.reads, Postgres) with its one connection held: a GET job
    waits db_pool_timeout, answers 503 database_unavailable with Retry-After (never hangs, never a
    500), /metrics counts the timeout, and once the connection is back the same request answers 200."""
    if backend != "postgres":
        pytest.skip("on SQLite the polled reads share the ORM's pool (no pool of their own)")
    client = make_client(db_read_pool_size=1, db_pool_timeout=0.5)
    job_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=RG_JOB).json()["id"]
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key_a.headers).status_code == 200
    pool = client.app.state.reads.pool
    held = client.portal.call(pool.acquire)  # on the server's event loop, as a request would hold it
    try:
        start = time.monotonic()
        resp = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key_a.headers)
        took = time.monotonic() - start
        err = assert_error(resp, 503, code="database_unavailable")
        assert "retry" in err["message"] and int(resp.headers["retry-after"]) > 0
        assert 0.5 <= took < 5, took
        assert "qerl_db_pool_timeouts 1.0" in client.get("/metrics").text
    finally:
        client.portal.call(pool.release, held)
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key_a.headers).status_code == 200
