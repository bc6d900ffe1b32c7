"""Auth: a missing, unknown or revoked key answers 401 in OpenAI's shape; another project's
objects answer 404; the per-key rate limit answers 429 with Retry-After."""
from __future__ import annotations

import time

from sqlalchemy import select

from service.auth import hash_secret, revoke_key
from service.models import ApiKey
from tests.conftest import jsonl, training_rows
from tests.test_api_files import assert_error, upload
from tests.test_api_jobs import body

PROTECTED = [("GET", "/v1/files"), ("POST", "/v1/fine_tuning/jobs"), ("GET", "/v1/fine_tuning/jobs"),
             ("GET", "/v1/adapters"), ("GET", "/v1/models")]


def test_missing_wrong_and_revoked_keys_are_401(client, key_a, db_sessions):
    for method, path in PROTECTED:
        err = assert_error(client.request(method, path), 401, code="invalid_api_key")
        assert "Authorization: Bearer" in err["message"]
        assert_error(client.request(method, path, headers={"Authorization": "Bearer sk-qerl-nope"}), 401,
                     code="invalid_api_key")
        assert_error(client.request(method, path, headers={"Authorization": "Basic abc"}), 401)
    assert client.get("/v1/files", headers=key_a.headers).status_code == 200
    with db_sessions() as s:
        key = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(key_a.secret)))
        assert key.key_hash != key_a.secret and key_a.secret.startswith(key.prefix)  # only the hash is stored
        assert revoke_key(s, key.id)
    err = assert_error(client.get("/v1/files", headers=key_a.headers), 401, code="invalid_api_key")
    assert "revoked" in err["message"]


def test_other_projects_objects_are_404(client, key_a, key_b):
    fid = upload(client, key_a, jsonl(training_rows(40))).json()["id"]
    job_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(fid)).json()["id"]
    for method, path in [("GET", f"/v1/files/{fid}"), ("GET", f"/v1/files/{fid}/content"),
                         ("DELETE", f"/v1/files/{fid}"), ("GET", f"/v1/fine_tuning/jobs/{job_id}"),
                         ("POST", f"/v1/fine_tuning/jobs/{job_id}/cancel"),
                         ("POST", f"/v1/fine_tuning/jobs/{job_id}/pause"),
                         ("POST", f"/v1/fine_tuning/jobs/{job_id}/resume"),
                         ("GET", f"/v1/fine_tuning/jobs/{job_id}/events"),
                         ("GET", f"/v1/fine_tuning/jobs/{job_id}/metrics"),
                         ("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints"),
                         ("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints/ftckpt-x/content")]:
        assert_error(client.request(method, path, headers=key_b.headers), 404, code="not_found")
    assert client.get("/v1/files", headers=key_b.headers).json()["data"] == []
    assert client.get("/v1/fine_tuning/jobs", headers=key_b.headers).json()["data"] == []
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key_a.headers).json()["status"] == "queued"


def test_rate_limit_429(make_client, key_a, key_b):
    limited = make_client(rate_limit_per_minute=3)
    assert [limited.get("/v1/files", headers=key_a.headers).status_code for _ in range(3)] == [200] * 3
    resp = limited.get("/v1/files", headers=key_a.headers)
    assert_error(resp, 429, code="rate_limit_exceeded")
    assert int(resp.headers["retry-after"]) >= 1 and "x-should-retry" not in resp.headers
    assert limited.get("/v1/files", headers=key_b.headers).status_code == 200  # per key


def test_a_key_revoked_by_another_process_stops_working_within_the_cache_time(make_client, key_a, db_sessions):
    """The API caches a verified key for QERL_AUTH_CACHE_SECONDS; a revocation it cannot see (an
    UPDATE from another process, as `qerl keys revoke` run elsewhere makes) holds after that long."""
    from datetime import datetime, timezone

    from sqlalchemy import update

    client = make_client(auth_cache_seconds=3.0)
    assert client.get("/v1/files", headers=key_a.headers).status_code == 200
    cached_at = time.monotonic()
    with db_sessions() as s:
        s.execute(update(ApiKey).where(ApiKey.key_hash == hash_secret(key_a.secret))
                  .values(revoked_at=datetime.now(timezone.utc)))
        s.commit()
    assert client.get("/v1/files", headers=key_a.headers).status_code == 200  # the cached key, no query
    assert time.monotonic() - cached_at < 3.0
    time.sleep(3.0 - (time.monotonic() - cached_at) + 0.1)
    err = assert_error(client.get("/v1/files", headers=key_a.headers), 401, code="invalid_api_key")
    assert "revoked" in err["message"]
