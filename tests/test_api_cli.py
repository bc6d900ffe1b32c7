"""``qerl keys`` and ``qerl migrate`` on an embedded SQLite file, and ``qerl serve``'s first
start: it migrates, creates a key, prints it and saves it for the CLI, serves, and stops on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from qerl.cli import app

ENV_KEYS = ("DATABASE_URL", "REDIS_URL", "ARTIFACT_DIR", "QERL_DATA_DIR", "QERL_CONFIG")


@pytest.fixture
def embedded_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name in ENV_KEYS:
        monkeypatch.delenv(name, raising=False)
    env = {"QERL_DATA_DIR": str(tmp_path / "data"), "QERL_CONFIG": str(tmp_path / "config.json")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def test_keys_and_migrate(embedded_env):
    runner = CliRunner()
    assert runner.invoke(app, ["migrate"]).exit_code == 0
    assert (Path(embedded_env["QERL_DATA_DIR"]) / "qerl.db").exists()
    created = runner.invoke(app, ["keys", "create", "--project", "research", "--name", "ci", "--save"])
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip().splitlines()[0]
    assert secret.startswith("sk-qerl-")
    config = json.loads(Path(embedded_env["QERL_CONFIG"]).read_text())
    assert config == {"base_url": "http://127.0.0.1:8000", "api_key": secret}
    assert oct(Path(embedded_env["QERL_CONFIG"]).stat().st_mode & 0o777) == "0o600"
    listed = runner.invoke(app, ["keys", "list"]).stdout
    key_id, project, prefix, state, name = listed.strip().split("\t")
    assert (project, state, name) == ("research", "active", "ci") and secret.startswith(prefix.rstrip("*"))
    assert secret not in listed
    assert runner.invoke(app, ["keys", "revoke", key_id]).exit_code == 0
    assert "revoked" in runner.invoke(app, ["keys", "list"]).stdout
    assert runner.invoke(app, ["keys", "revoke", key_id]).exit_code == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(env: dict[str, str], port: int, check) -> str:  # type: ignore[no-untyped-def]
    """Start ``qerl serve``, wait for /healthz, run ``check(url)``, SIGTERM it; return its output."""
    proc = subprocess.Popen([sys.executable, "-m", "qerl.cli", "serve"], env={**env, "QERL_PORT": str(port)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "qerl serve did not come up"
            time.sleep(0.2)
        check(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), out  # uvicorn re-raises the signal after a clean exit
    assert "Application shutdown complete" in out, out
    return out


def test_serve_first_start_creates_and_saves_a_key(embedded_env):
    env, port = {**os.environ, **embedded_env}, free_port()
    config_path = Path(embedded_env["QERL_CONFIG"])

    def check(url: str) -> None:
        config = json.loads(config_path.read_text())
        assert config["base_url"] == url
        assert httpx.get(f"{url}/readyz").json()["broker"] == "embedded"
        jobs = httpx.get(f"{url}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {config['api_key']}"})
        assert jobs.status_code == 200 and jobs.json()["data"] == []

    out = run_serve(env, port, check)
    secret = json.loads(config_path.read_text())["api_key"]
    assert f"created API key {secret}" in out  # printed once, on the first start
    out = run_serve(env, free_port(), check)  # the second start (another port) keeps the key, prints none,
    assert "created API key" not in out and json.loads(config_path.read_text())["api_key"] == secret  # new URL


def test_queue_shows_the_running_jobs_and_the_queue_in_take_order(embedded_env):
    from service import queue
    from service.db import make_engine, make_sessionmaker
    from tests._worker_fixtures import make_job

    runner = CliRunner()
    assert runner.invoke(app, ["migrate"]).exit_code == 0
    engine = make_engine(f"sqlite:///{Path(embedded_env['QERL_DATA_DIR']) / 'qerl.db'}")
    try:
        with make_sessionmaker(engine)() as s:
            a1, a2 = (make_job(s, {"model": "tiny", "steps": 3}, project="team-a").id for _ in range(2))
            b1 = make_job(s, {"model": "tiny", "steps": 3}, project="team-b").id
            queue.claim(s, a1, "gpu0@host:4242", lease_seconds=60)
    finally:
        engine.dispose()
    got = runner.invoke(app, ["queue", "--json"])
    assert got.exit_code == 0, got.output
    view = json.loads(got.stdout)
    assert [(j["id"], j["project"], j["worker"], j["attempt"]) for j in view["running"]] == \
        [(a1, "team-a", "gpu0@host:4242", 1)]
    assert [(j["position"], j["id"]) for j in view["queued"]] == [(1, b1), (2, a2)]  # team-b's turn first
    text = runner.invoke(app, ["queue"]).stdout
    assert "running (1):" in text and "gpu0@host:4242" in text
    assert f"queued (2), in the order workers take them:\n  1\t{b1}\tteam-b\n  2\t{a2}\tteam-a\n" in text
