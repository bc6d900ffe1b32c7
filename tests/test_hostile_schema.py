"""Schemathesis against the app's own OpenAPI schema, on a live uvicorn over the test Postgres.

The fuzzer sends schema-valid and schema-invalid requests (coverage, fuzzing and stateful
phases) with a valid key of a project that holds a file and a queued job, so list and
retrieve answers carry real objects. Every answer must be a documented status (no 500),
match its documented body schema, content type and headers, reject invalid data with a 4xx,
and a 405 must list the path's real methods in ``Allow``.

Left out: ``positive_data_acceptance``. A schema-valid body can still be refused with 422
for reasons a schema cannot state: a file id that is not in this project, a model name
outside the deployment's registry, training_file XOR qerl.dataset.

Bounded: ``--max-time`` (QERL_SCHEMATHESIS_SECONDS, default 60) and ``--max-examples``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.db import make_engine, make_sessionmaker
from service.settings import Settings
from tests.conftest import STRING_CHECK, Key, LiveServer, _key, jsonl, training_rows

SECONDS = int(os.environ.get("QERL_SCHEMATHESIS_SECONDS", "60"))
SEED = os.environ.get("QERL_SCHEMATHESIS_SEED", "20261130")


def _st() -> str:
    exe = Path(sys.executable).with_name("st")
    return str(exe) if exe.exists() else (shutil.which("st") or "")


@pytest.fixture(scope="module")
def pg_server(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("schemathesis")
    settings = Settings(data_dir=root, database_url=pg_url, redis_url=None, artifact_dir=root / "artifacts",
                        embedded_worker=False, auto_migrate=False, rate_limit_per_minute=0,
                        config_path=root / "client.json", sse_poll_seconds=0.05, max_upload_bytes=256 * 1024)
    with LiveServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def seeded_key(pg_url: str, pg_server: LiveServer) -> Key:
    """A project holding one file and one queued job (no worker: it stays queued)."""
    import httpx

    engine = make_engine(pg_url)
    key = _key(make_sessionmaker(engine), "schemathesis")
    engine.dispose()
    with httpx.Client(base_url=pg_server.url, headers=key.headers, timeout=30) as http:
        r = http.post("/v1/files", files={"file": ("train.jsonl", jsonl(training_rows(40)))},
                      data={"purpose": "fine-tune"})
        assert r.status_code == 200, r.text
        body = {"model": "smollm2-135m-instruct", "training_file": r.json()["id"],
                "method": {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}}
        r = http.post("/v1/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
    return key


def test_schemathesis_finds_no_500_and_no_schema_violation(pg_server: LiveServer, seeded_key: Key,
                                                           tmp_path: Path) -> None:
    st = _st()
    if not st:
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'")
    cmd = [st, "run", f"{pg_server.url}/openapi.json", "-H", f"Authorization: Bearer {seeded_key.secret}",
           "--phases", "coverage,fuzzing,stateful", "--max-examples", "15", "--max-time", str(SECONDS),
           "--workers", "1", "--seed", SEED, "--checks", "all", "--exclude-checks", "positive_data_acceptance",
           "--request-timeout", "10", "--no-color"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SECONDS + 120, cwd=tmp_path,
                          env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"schemathesis found failures (exit {proc.returncode}):\n{out[-6000:]}"
    assert "Tested: 19" in out or "Tested:" in out, out[-2000:]
