"""A real ``qerl serve`` (embedded: SQLite + in-process worker) in a subprocess, and one job run
through the ``qerl`` CLI on the tiny model to completion, shared by the client test modules.

pytest gives a session fixture defined in two modules two instances; a module-level cache
makes both return the same server and job, so the engine runs once per test session.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import jsonl

QERL = [sys.executable, "-m", "qerl.cli"]
SERVER_START_S = 120.0
JOB_TIMEOUT_S = 600.0


@dataclass
class Served:
    url: str
    api_key: str
    env: dict[str, str]  # for CLI subprocesses: QERL_CONFIG points at the server's own config
    data_dir: Path
    proc: subprocess.Popen
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def qerl(self, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run the ``qerl`` CLI against this server; wide terminal so rich does not wrap lines."""
        return subprocess.run([*QERL, *args], env=env or self.env, capture_output=True, text=True, timeout=timeout)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path) -> Served:
    root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    # only this server's settings: nothing another fixture left in the environment (a database,
    # a broker, QERL_EMBEDDED_WORKER=0, ...) may leak in; QERL_MODELS names the tiny model
    env = {k: v for k, v in os.environ.items() if not k.startswith("QERL_")
           and k not in ("DATABASE_URL", "REDIS_URL", "ARTIFACT_DIR", "MAX_UPLOAD_BYTES")}
    if "QERL_MODELS" in os.environ:
        env["QERL_MODELS"] = os.environ["QERL_MODELS"]
    env.update(QERL_DATA_DIR=str(root / "data"), QERL_CONFIG=str(root / "config.json"), PYTHONUNBUFFERED="1",
               QERL_CACHE_DIR=str(root / "cache"), COLUMNS="200", TERM="dumb", NO_COLOR="1",
               OMP_NUM_THREADS="1", QERL_SSE_POLL_SECONDS="0.2")
    log = root / "server.log"
    proc = subprocess.Popen([*QERL, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"qerl serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200 and (root / "config.json").exists():
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"qerl serve not ready in {SERVER_START_S:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.3)
    config = json.loads((root / "config.json").read_text())
    assert config["base_url"].rstrip("/") == url, config
    return Served(url=url, api_key=config["api_key"], env=env, data_dir=root, proc=proc, log=log)


def stop_server(served: Served) -> None:
    if served.proc.poll() is None:
        served.proc.terminate()
        try:
            served.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            served.proc.wait()


_CACHE: dict[str, Any] = {}


@pytest.fixture(scope="session")
def qerl_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Served]:
    """The embedded server; QERL_MODELS (set by ``tiny_model_dir``) registers model ``tiny``."""
    if "server" not in _CACHE:
        _CACHE["server"] = start_server(tmp_path_factory.mktemp("qerl-serve"))
    yield _CACHE["server"]
    stop_server(_CACHE["server"])  # idempotent: the second module's instance finds it stopped


# The job: a JSONL file with a fuzzy-match grader against a long reference, so that even the
# random tiny model's samples get rewards that differ within a group (a non-zero policy
# gradient: the update, entropy and KL really run); two steps of two prompts x two samples.
TRAIN_ROWS = [{"messages": [{"role": "user", "content": f"Write sentence number {i}."}],
               "answer": "the quick brown fox jumps over the lazy dog"} for i in range(8)]
JOB_SPEC_YAML = """\
# a qerl job body in YAML; flags on the command line override it
model: tiny
suffix: cli
method:
  type: reinforcement
  reinforcement:
    grader:
      type: text_similarity
      name: similarity
      input: "{{sample.output_text}}"
      reference: "{{item.answer}}"
      evaluation_metric: fuzzy_match
qerl:
  steps: 5
  prompts_per_step: 2
  micro_batch_size: 4
  checkpoint_interval: 1
  device: cpu
  quantization: nvfp4
  lora: {r: 4}
  rollout: {num_generations: 2, max_new_tokens: 8}
  rl: {mask_truncated: false}  # the random model never stops within 8 tokens: train on them anyway
  data: {eval_size: 2}
"""
STEPS = 2


@dataclass
class CliJob:
    job_id: str
    file_id: str
    upload: subprocess.CompletedProcess
    create: subprocess.CompletedProcess
    watch: subprocess.CompletedProcess
    watch_seconds: float
    job: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="session")
def cli_job(qerl_server: Served, tmp_path_factory: pytest.TempPathFactory) -> CliJob:
    """Upload, create (YAML spec + flags), watch to the end, all through the ``qerl`` CLI."""
    if "job" in _CACHE:
        return _CACHE["job"]
    work = tmp_path_factory.mktemp("cli-job")
    (work / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    (work / "job.yaml").write_text(JOB_SPEC_YAML)
    upload = qerl_server.qerl("files", "upload", str(work / "train.jsonl"), "--json")
    assert upload.returncode == 0, upload.stderr
    file_id = json.loads(upload.stdout)["id"]
    create = qerl_server.qerl("jobs", "create", str(work / "job.yaml"), "--training-file", file_id,
                              "--steps", str(STEPS), "--seed", "3", "--metadata", "origin=test", "--json")
    assert create.returncode == 0, create.stderr
    job_id = json.loads(create.stdout)["id"]
    t0 = time.monotonic()
    try:
        watch = qerl_server.qerl("jobs", "watch", job_id, "--interval", "0.5", timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"job {job_id} did not finish in {JOB_TIMEOUT_S:.0f} s; server log:\n{qerl_server.log_tail()}")
    job = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}", headers=qerl_server.headers).json()
    _CACHE["job"] = CliJob(job_id, file_id, upload, create, watch, time.monotonic() - t0, job)
    return _CACHE["job"]
