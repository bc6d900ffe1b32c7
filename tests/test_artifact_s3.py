"""The artifact store behind an S3-compatible bucket (``ARTIFACT_URL``), each host's ARTIFACT_DIR
its cache: moto's standalone S3 server (a process of its own, spoken to over S3's HTTP API by
boto3, as MinIO or a cloud's bucket would be) holds the bucket. Hosts are directories that share
nothing but the bucket (and the database): what one writes, another reads, checked against the
sha256 recorded in the database; a job whose host is lost with its disk resumes on another from
the checkpoint in the bucket, and the API, on a host of its own, serves the files, adapters and
checkpoints the workers wrote."""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import boto3
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import select

from service.db import make_engine, make_sessionmaker
from service.models import Checkpoint, Job, JobMetric, utcnow
from service.settings import Settings
from service.storage import ArtifactStore, Corrupt, StoreUnavailable
from service.storage_s3 import S3Remote
from tests._worker_fixtures import make_job, tiny_spec
from tests.conftest import STRING_CHECK, jsonl, training_rows
from tests.test_faults_services import api, env_for, finished, free_port, fresh_db, key_in, tiny_job, wait_job  # noqa: F401
from worker.artifacts import pull_workdir, push_workdir, remove_finished_workdirs

JOB = "ftjob-s3test"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """moto's S3 server on a free port; the environment that points boto3 at it."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("s3") / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the S3 server did not start: {Path(log.name).read_text()[-2000:]}") from None
            time.sleep(0.2)
    yield {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "qerl-test",
           "AWS_SECRET_ACCESS_KEY": "qerl-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(10)
    log.close()


@pytest.fixture
def bucket(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket of this test: its ARTIFACT_URL (this process's boto3 pointed at the server)."""
    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    name = f"qerl-{secrets.token_hex(6)}"
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}/artifacts"


def keys(url: str) -> list[str]:
    """The bucket's objects under the store's prefix, relative to it."""
    remote = S3Remote(url)
    pages = remote.client.get_paginator("list_objects_v2").paginate(Bucket=remote.bucket, Prefix=remote.prefix)
    return sorted(o["Key"][len(remote.prefix):] for page in pages for o in page.get("Contents", ()))


def host(root: Path, url: str) -> ArtifactStore:
    return ArtifactStore(root, S3Remote(url))


def test_hosts_read_each_others_artifacts_checked_against_the_recorded_sha256(bucket, tmp_path):
    a, b = host(tmp_path / "a", bucket), host(tmp_path / "b", bucket)
    data = os.urandom(9 * 1024 * 1024 + 17)  # past boto3's 8 MiB threshold: a multipart upload and download
    blob = a.stage([data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)]).publish("adapters/x.tar.gz")
    assert blob.sha256 == hashlib.sha256(data).hexdigest() and keys(bucket) == ["adapters/x.tar.gz"]
    assert not (b.root / blob.path).exists()
    path = b.verified(blob.path, blob.sha256)  # fetched: b never wrote it
    assert path == b.root / blob.path and path.read_bytes() == data

    path.write_bytes(b"rot" + data[3:])  # this host's copy went bad: fetched again from the bucket
    assert b.verified(blob.path, blob.sha256).read_bytes() == data

    boto3.client("s3").put_object(Bucket=bucket[5:].split("/")[0], Key="artifacts/adapters/x.tar.gz",
                                  Body=data[:-1] + b"!")  # the bucket's bytes altered behind the database's back
    with pytest.raises(Corrupt):
        host(tmp_path / "c", bucket).verified(blob.path, blob.sha256)
    assert not list((tmp_path / "c" / "tmp").iterdir())  # no partial download left behind

    a.delete(blob.path)  # gone from the bucket; another host no longer finds it
    assert keys(bucket) == []
    with pytest.raises(FileNotFoundError):
        host(tmp_path / "d", bucket).verified(blob.path, blob.sha256)
    old = time.time() - 7200  # b's cached copy outlives the object: swept once old enough
    os.utime(path, (old, old))
    assert b.sweep_cache(3600) == 1 and not path.exists()
    kept = a.stage([b"kept\n"]).publish("files/kept.jsonl")  # a copy read again counts as fresh
    cached = host(tmp_path / "e", bucket)
    cached.cache_seconds = 3600.0
    copy = cached.verified(kept.path, kept.sha256)
    os.utime(copy, (old, old))
    assert cached.verified(kept.path, kept.sha256) == copy and copy.stat().st_mtime > old + 3600
    assert cached.sweep_cache(3600) == 0 and copy.read_bytes() == b"kept\n"
    assert ArtifactStore(tmp_path / "b").sweep_cache(0) == 0  # without a bucket the disk is the store: kept


def test_an_upload_that_fails_leaves_nothing(s3_server, monkeypatch, tmp_path):
    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    store = host(tmp_path, "s3://qerl-no-such-bucket/x")
    staged = store.stage([b"{}\n"])
    with pytest.raises(StoreUnavailable, match="qerl-no-such-bucket"):
        staged.publish("files/file-x.jsonl")
    staged.discard()
    assert not (tmp_path / "files" / "file-x.jsonl").exists() and not list((tmp_path / "tmp").iterdir())


def _step_dir(store: ArtifactStore, step: int, sub: str = "checkpoints", job: str = JOB) -> str:
    rel = f"jobs/{job}/{sub}/step-{step:06d}"
    d = store.root / rel
    (d / "adapter").mkdir(parents=True)
    (d / "adapter" / "adapter_model.safetensors").write_bytes(os.urandom(4096 + step))
    (d / "state.json").write_text(f'{{"step": {step}}}')
    return rel


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_jobs_checkpoints_follow_it_into_the_bucket_and_to_another_host(bucket, tmp_path):
    a, b, api_host = host(tmp_path / "a", bucket), host(tmp_path / "b", bucket), host(tmp_path / "api", bucket)
    rel2, best2 = _step_dir(a, 2), _step_dir(a, 2, "best-adapters")
    push_workdir(a, JOB, rel2)
    rel4 = _step_dir(a, 4)
    push_workdir(a, JOB, rel4)
    prefix = f"jobs/{JOB}/"
    assert keys(bucket) == [f"{best2}.tar", f"{rel2}.tar", f"{rel4}.tar"]
    shutil.rmtree(a.root / rel2)  # the engine keeps its newest checkpoints: step 2 pruned
    rel6 = _step_dir(a, 6)
    push_workdir(a, JOB, rel6)
    assert keys(bucket) == [f"{best2}.tar", f"{rel4}.tar", f"{rel6}.tar"] and all(k.startswith(prefix) for k in keys(bucket))
    (a.root / rel6 / "state.json").write_text('{"step": 6, "again": true}')  # a step saved again replaces the object
    push_workdir(a, JOB, rel6)

    pull_workdir(b, JOB)  # another host: the newest checkpoint (what a job resumes from) and the best steps
    assert sorted(p.name for p in (b.root / f"jobs/{JOB}/checkpoints").iterdir()) == ["step-000006"]
    assert _files(b.root / rel6) == _files(a.root / rel6) and _files(b.root / best2) == _files(a.root / best2)
    assert b.local_dir(rel4) == b.root / rel4 and _files(b.root / rel4) == _files(a.root / rel4)

    with api_host.checkpoint_dir(rel4) as d:  # read without a workdir: a temporary copy
        assert _files(d) == _files(a.root / rel4)
    assert not d.exists() and not (api_host.root / "jobs").exists()
    with pytest.raises(FileNotFoundError), api_host.checkpoint_dir(rel2):
        pass
    left = api_host.tmp_dir / "1-cut-short.d" / "adapter"  # a reader's temporary copy that a crash left behind
    left.mkdir(parents=True)
    (left / "x").write_bytes(b"x")
    fresh = api_host.stage([b"being written"])
    old = time.time() - 7200
    os.utime(left.parent, (old, old))
    assert api_host.sweep_tmp() == 1 and not left.parent.exists() and fresh.tmp.exists()
    fresh.discard()


def test_finished_jobs_leave_the_bucket_after_their_retention(bucket, tmp_path, pg_sessions):
    a = host(tmp_path / "a", bucket)
    with pg_sessions() as s:
        ended = make_job(s, tiny_spec("tiny"), status="succeeded", finished_at=utcnow() - timedelta(hours=2)).id
        running = make_job(s, tiny_spec("tiny"), status="running").id
    for job_id in (ended, running):
        rel = f"jobs/{job_id}/checkpoints/step-000001"
        (a.root / rel).mkdir(parents=True)
        (a.root / rel / "state.json").write_text("{}")
        push_workdir(a, job_id, rel)
    shutil.rmtree(a.root / "jobs")  # the workdirs were on hosts that are gone: the bucket's copies remain
    with pg_sessions() as s:
        remove_finished_workdirs(s, a, retention_s=7200 + 60)  # not yet
        assert keys(bucket) == sorted(f"jobs/{j}/checkpoints/step-000001.tar" for j in (ended, running))
        remove_finished_workdirs(s, a, retention_s=3600)
        assert keys(bucket) == [f"jobs/{running}/checkpoints/step-000001.tar"]
        s.execute(Job.__table__.update().where(Job.id == running).values(status="cancelled"))
        s.commit()


def test_a_fenced_out_attempt_does_not_touch_the_buckets_checkpoints(bucket, tmp_path, pg_sessions):
    """A worker whose job was reaped and claimed again (attempt 2) reports a checkpoint: it raises
    LeaseLost before uploading anything or pruning the new attempt's copies."""
    from service import queue
    from worker.reporter import DBReporter

    a = host(tmp_path / "a", bucket)
    with pg_sessions() as s:
        job_id = make_job(s, tiny_spec("tiny")).id
        first = queue.claim(s, job_id, "host-a", lease_seconds=60).attempt
    report = DBReporter(pg_sessions, job_id, first, store=a, total_steps=8, retry=lambda write, what: write())
    report.checkpoint(2, a.root / _step_dir(a, 2, job=job_id))
    assert keys(bucket) == [f"jobs/{job_id}/checkpoints/step-000002.tar"]
    with pg_sessions() as s:  # host a's lease ends; attempt 2 takes the job
        s.execute(Job.__table__.update().where(Job.id == job_id).values(status="queued", lease_owner=None))
        s.commit()
        second = queue.claim(s, job_id, "host-b", lease_seconds=60).attempt
    assert second == first + 1
    shutil.rmtree(a.root / f"jobs/{job_id}/checkpoints/step-000002")  # pruned on host a
    with pytest.raises(queue.LeaseLost):
        report.checkpoint(4, a.root / _step_dir(a, 4, job=job_id))
    assert keys(bucket) == [f"jobs/{job_id}/checkpoints/step-000002.tar"]  # nothing uploaded, nothing dropped
    with pg_sessions() as s:
        queue.finish(s, job_id, second, "cancelled")
        s.commit()


def test_a_bad_artifact_url_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValidationError, match=r"ARTIFACT_URL must look like s3://bucket"):
        Settings(data_dir=tmp_path, artifact_url="http://minio:9000/qerl")


def test_an_unreachable_bucket_is_a_503_naming_it_and_an_upload_leaves_nothing(s3_server, monkeypatch, tmp_path):
    from service.app import create_app

    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    settings = Settings(data_dir=tmp_path, artifact_url="s3://qerl-no-such-bucket", embedded_worker=False,
                        config_path=tmp_path / "client.json")
    with TestClient(create_app(settings)) as client:
        ready = client.get("/readyz")
        headers = {"Authorization": f"Bearer {json.loads((tmp_path / 'client.json').read_text())['api_key']}"}
        upload = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                             files={"file": ("train.jsonl", jsonl(training_rows(4)))})
        listed = client.get("/v1/files", headers=headers).json()["data"]
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "artifact_store_unavailable"
    assert "qerl-no-such-bucket" in ready.json()["error"]["message"]
    assert upload.status_code == 503 and upload.json()["error"]["code"] == "artifact_store_unavailable", upload.text
    assert "qerl-no-such-bucket" in upload.json()["error"]["message"]
    assert listed == [] and not any(p.is_file() for p in (tmp_path / "artifacts").rglob("*"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_moves_between_hosts_through_the_bucket(worker_queue_env, start_workers, fresh_db, tmp_path, bucket,
                                                      s3_server):
    """API on one host, the job's first worker on a second (killed with its disk mid-job), the job
    finished on a third: each host's ARTIFACT_DIR its own, the bucket shared."""
    hosts = {name: tmp_path / name for name in ("api", "a", "b")}
    env = env_for(worker_queue_env, DATABASE_URL=fresh_db, ARTIFACT_URL=bucket, **s3_server)

    def on(name: str) -> dict[str, str]:
        return {**{k: env[k] for k in ("DATABASE_URL", "QERL_CELERY_QUEUE", "ARTIFACT_URL", *s3_server)},
                "ARTIFACT_DIR": str(hosts[name])}

    key = key_in(fresh_db, "s3")
    engine = make_engine(fresh_db)
    sessions = make_sessionmaker(engine)
    with api({**env, "ARTIFACT_DIR": str(hosts["api"])}, tmp_path, artifact_url=bucket) as client:
        assert client.get("/readyz").json()["artifact_store"] == "ok"
        fid = client.post("/v1/files", headers=key.headers, data={"purpose": "fine-tune"},
                          files={"file": ("train.jsonl", jsonl(training_rows(16)))}).json()["id"]
        assert keys(bucket) == [f"files/{fid}.jsonl"]
        body = tiny_job(steps=12, checkpoint_interval=2)
        body["qerl"].pop("dataset")
        body.update(training_file=fid, method={"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}})
        [first] = start_workers(1, **on("a"))
        job_id = client.post("/v1/fine_tuning/jobs", headers=key.headers, json=body).json()["id"]

        def checkpointed(step: int) -> bool:
            with sessions() as s:
                return (s.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id)
                                 .order_by(Checkpoint.step.desc()).limit(1)) or 0) >= step
        deadline = time.monotonic() + 240
        while not (checkpointed(4) and any(k.startswith(f"jobs/{job_id}/checkpoints/") for k in keys(bucket))):
            assert time.monotonic() < deadline, first.log()[-3000:]
            time.sleep(0.2)
        first.kill(signal.SIGKILL)  # the host is lost, and its disk with it
        shutil.rmtree(hosts["a"])
        start_workers(1, **on("b"))
        job = wait_job(client, key, job_id, finished, timeout=300)
        assert job["status"] == "succeeded", job

        with sessions() as s:
            row = s.get(Job, job_id)
            resumed = s.get(Checkpoint, row.resume_checkpoint_id).step
            steps = list(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id, JobMetric.attempt == 2)
                                   .order_by(JobMetric.step)))
            newest = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                               .order_by(Checkpoint.step.desc())).first()
        assert row.attempt == 2 and resumed >= 4 and steps == list(range(resumed + 1, 13))  # not from step 0
        assert (hosts["b"] / "files" / f"{fid}.jsonl").is_file()  # the training file came from the bucket

        assert not (hosts["api"] / "adapters" / f"{row.adapter_id}.tar.gz").exists()
        got = client.get(f"/v1/adapters/{row.adapter_id}/content", headers=key.headers)
        assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == got.headers["x-checksum-sha256"]
        assert (hosts["api"] / "adapters" / f"{row.adapter_id}.tar.gz").is_file()  # fetched, now cached here
        results = client.get(f"/v1/files/{job['result_files'][0]}/content", headers=key.headers)
        assert results.status_code == 200 and results.text.startswith("step")

        ckpt = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{newest.id}/content", headers=key.headers)
        assert ckpt.status_code == 200, ckpt.text
        packed = ArtifactStore(hosts["b"]).pack(hosts["b"] / newest.path / "adapter")  # what host b holds
        assert hashlib.sha256(ckpt.content).hexdigest() == packed.sha256 == ckpt.headers["x-checksum-sha256"]
        packed.discard()
        assert not (hosts["api"] / "jobs" / job_id).exists()  # read from the bucket, not kept on the API's host

        gone = client.delete(f"/v1/models/{job['fine_tuned_model']}", headers=key.headers)
        assert gone.status_code == 200, gone.text
        assert not any(k.startswith("adapters/") for k in keys(bucket))
    engine.dispose()
