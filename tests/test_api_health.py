"""/healthz, /readyz (503 with a clear error when the database or the broker is down),
/metrics, the migration matching the ORM on both backends, and the service staying torch-free."""
from __future__ import annotations

import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from service.db import make_engine
from service.models import Base
from tests.test_api_files import assert_error


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
