"""The embedded default: SQLite and an in-process worker thread running the real engine on the
tiny model, with the same claim/lease/run code as the Celery workers."""
from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import pytest
from sqlalchemy import select

from service import queue
from service.db import make_engine, make_sessionmaker
from service.models import Adapter, File, Job, JobMetric, utcnow
from service.settings import Settings
from tests._worker_fixtures import cancel_leftovers, events, make_job, tiny_spec, wait_for_status
from tests.conftest import STRING_CHECK, jsonl
from worker.embedded import start_embedded_worker


@pytest.fixture
def lite(worker_sqlite_url):
    engine = make_engine(worker_sqlite_url)
    sessions = make_sessionmaker(engine)
    cancel_leftovers(sessions)
    yield sessions
    engine.dispose()


@pytest.fixture
def settings(worker_sqlite_url, tiny_model_dir, tmp_path) -> Settings:
    return Settings(database_url=worker_sqlite_url, redis_url=None, data_dir=tmp_path,
                    artifact_dir=tmp_path / "artifacts", lease_seconds=8, heartbeat_seconds=0.5,
                    reap_interval_seconds=0.5)


@pytest.fixture
def embedded(settings):
    started = []

    def start():
        started.append(start_embedded_worker(settings, poll_seconds=30))  # wake-ups, not polling, drive it
        return started[-1]

    yield start
    for w in started:
        w.stop(timeout=60)


def _steps(s, job_id: str, attempt: int) -> list[int]:
    return list(s.execute(select(JobMetric.step).where(JobMetric.job_id == job_id, JobMetric.attempt == attempt)
                          .order_by(JobMetric.step)).scalars())


def _wait_step(lite, job_id: str, step: int) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with lite() as s:
            got = s.get(Job, job_id).step
        if got >= step:
            return got
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached step {step}")


def test_a_woken_job_runs_to_an_adapter(lite, embedded, settings):
    worker = embedded()
    with lite() as s:
        jid = make_job(s, tiny_spec("tiny", steps=2)).id
        t0 = time.monotonic()
        queue.wake(jid, s)
    done = wait_for_status(lite, jid, ("succeeded", "failed"), timeout=120)
    assert done.status == "succeeded" and done.attempt == 1 and worker.alive
    assert (settings.artifact_dir / "adapters" / f"{done.adapter_id}.tar.gz").is_file()
    assert time.monotonic() - t0 < 60  # the wake-up, not the 30 s poll, started it


def test_a_finished_jobs_workdir_is_removed_and_its_adapter_stays(lite, settings):
    settings = settings.model_copy(update={"job_files_retention_seconds": 0.0, "cleanup_interval_seconds": 0.2})
    worker = start_embedded_worker(settings, poll_seconds=0.2)
    try:
        with lite() as s:
            jid = make_job(s, tiny_spec("tiny", steps=2, checkpoint_interval=1)).id
            queue.wake(jid, s)
        done = wait_for_status(lite, jid, ("succeeded", "failed"), timeout=120)
        assert done.status == "succeeded"
        jobs = settings.artifact_dir / "jobs"
        deadline = time.monotonic() + 30
        while left := list(jobs.iterdir()):  # the workdir, then its renamed copy while it is being deleted
            assert time.monotonic() < deadline, f"still there: {left}"
            time.sleep(0.1)
        assert (settings.artifact_dir / "adapters" / f"{done.adapter_id}.tar.gz").is_file()
    finally:
        worker.stop(timeout=60)


def test_cancel_queued_and_running(lite, embedded):
    embedded()
    with lite() as s:
        running = make_job(s, tiny_spec("tiny", steps=500, checkpoint_interval=0)).id
        queue.wake(running, s)
    seen = _wait_step(lite, running, 2)
    with lite() as s:
        waiting = make_job(s, tiny_spec("tiny", steps=2))
        queue.wake(waiting.id, s)
        queue.cancel(s, waiting)
        queue.cancel(s, s.get(Job, running))
        s.commit()
        assert waiting.status == "cancelled"
    done = wait_for_status(lite, running, ("cancelled", "succeeded", "failed"), timeout=30)
    assert done.status == "cancelled"
    with lite() as s:
        assert max(_steps(s, running, 1)) <= seen + 3
        assert s.get(Job, waiting.id).attempt == 0


def test_stop_hands_the_job_back_and_the_next_start_resumes(lite, embedded):
    first = embedded()
    with lite() as s:
        jid = make_job(s, tiny_spec("tiny", steps=10, checkpoint_interval=2)).id
        queue.wake(jid, s)
    _wait_step(lite, jid, 3)
    first.stop(timeout=60)
    assert not first.alive
    with lite() as s:
        job = s.get(Job, jid)
        assert job.status == "queued" and job.attempt == 1
        stopped_at = job.step
    embedded()  # the server starts again: the queued job is picked up without a new wake-up
    done = wait_for_status(lite, jid, ("succeeded", "failed"), timeout=120)
    assert done.status == "succeeded" and done.attempt == 2
    with lite() as s:
        assert _steps(s, jid, 2) == list(range(stopped_at + 1, 11))
        assert f"Resuming from checkpoint step {stopped_at} (attempt 2)" in [e.message for e in events(s, jid)]


def test_a_job_left_running_by_a_dead_server_is_reaped_and_rerun(lite, embedded):
    with lite() as s:  # a server killed mid-job: running, lease long expired, nobody heartbeating
        jid = make_job(s, tiny_spec("tiny", steps=2), status="running", attempt=1, lease_owner="embedded:gone:1",
                       lease_expires_at=utcnow() - timedelta(seconds=5)).id
    embedded()
    done = wait_for_status(lite, jid, ("succeeded", "failed"), timeout=120)
    assert done.status == "succeeded" and done.attempt == 2
    with lite() as s:
        msgs = [e.message for e in events(s, jid)]
        assert "Worker lost; resuming from step 0 (no checkpoint yet) (attempt 2)" in msgs


def test_a_job_committed_without_a_wakeup_is_still_picked_up(lite, embedded):
    with lite() as s:
        jid = make_job(s, tiny_spec("tiny", steps=2)).id  # no wake(): e.g. the process died right after commit
    embedded()
    assert wait_for_status(lite, jid, ("succeeded", "failed"), timeout=120).status == "succeeded"


def test_maintenance_runs_while_a_job_does(lite, settings):
    """Reaper, cleanup and webhooks have a thread of their own: a job cancelled while it waits
    behind a running one gets its webhook before the running one ends."""
    from tests.test_webhooks import SECRET, Receiver, _settle_earlier_events

    receiver = Receiver()
    _settle_earlier_events(lite)
    settings = settings.model_copy(update={"webhook_url": receiver.url, "webhook_secret": SECRET})
    worker = start_embedded_worker(settings, poll_seconds=0.3)
    try:
        with lite() as s:
            long = make_job(s, tiny_spec("tiny", steps=500, checkpoint_interval=0)).id
            waiting = make_job(s, tiny_spec("tiny", steps=2)).id
            queue.wake(long, s)
        _wait_step(lite, long, 1)
        with lite() as s:
            assert s.get(Job, waiting).status == "queued"
            queue.cancel(s, s.get(Job, waiting))
            s.commit()
        deadline = time.monotonic() + 30
        while not receiver.events_for(waiting):
            assert time.monotonic() < deadline, "no webhook for the cancelled job while the other one runs"
            time.sleep(0.1)
        with lite() as s:
            assert s.get(Job, long).status == "running"
            queue.cancel(s, s.get(Job, long))
            s.commit()
        assert wait_for_status(lite, long, ("cancelled",), timeout=60).status == "cancelled"
    finally:
        worker.stop(timeout=60)
        receiver.server.shutdown()


def test_an_evaluation_the_worker_cannot_run_fails_with_the_reason(lite, embedded, settings):
    """An evaluation whose rows lack a field its grader reads (a file uploaded before fields were
    counted: the worker checks it) fails ``invalid_file`` naming the line, before any model loads;
    one whose adapter archive is gone fails ``model_not_found``; neither leaves a results file."""
    embedded()
    with lite() as s:
        jid = make_job(s, tiny_spec("tiny", steps=1)).id
        queue.wake(jid, s)
    trained = wait_for_status(lite, jid, "succeeded", timeout=120)
    data = jsonl([{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "What is 3 + 3?"}])
    (settings.artifact_dir / "files").mkdir(parents=True, exist_ok=True)
    (settings.artifact_dir / "files" / "test.jsonl").write_bytes(data)
    with lite() as s:
        f = File(project="proj-test", filename="test.jsonl", purpose="fine-tune", bytes=len(data),
                 sha256=hashlib.sha256(data).hexdigest(), path="files/test.jsonl", rows=2)  # fields: not counted
        s.add(f)
        s.commit()
        adapter = s.get(Adapter, trained.adapter_id)
        spec = {"model": "tiny", "init_adapter": adapter.path, "grader": STRING_CHECK, "compare_base": True}
        lacking = make_job(s, spec, kind="eval", model=adapter.name, validation_file=f.id).id
        gone = make_job(s, {**spec, "init_adapter": "adapters/no-such.tar.gz"}, kind="eval", model=adapter.name,
                        validation_file=f.id).id
        queue.wake(lacking, s)
        queue.wake(gone, s)
    for eid, code, said in ((lacking, "invalid_file", "line 2"), (gone, "model_not_found", "that this evaluation scores")):
        done = wait_for_status(lite, eid, ("succeeded", "failed"), timeout=120)
        assert (done.status, done.error_code) == ("failed", code), (done.error_code, done.error_message)
        assert said in done.error_message and done.result_file_id is None and done.outcome is None, done.error_message
