"""Real Celery worker processes, real Redis and Postgres, the real engine on the tiny model:
exclusive claims under duplicate messages, SIGKILL recovery from a checkpoint, cancel, pause and
resume, fencing of a frozen worker, the sweeper, and warm shutdown."""
from __future__ import annotations

import hashlib
import json
import signal
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from service import queue
from service.models import Adapter, Checkpoint, File, Job, JobEvent, JobMetric, new_id
from tests._worker_fixtures import cancel_leftovers, events, make_job, tiny_spec, wait_for_status
from tests.conftest import STRING_CHECK, jsonl

pytestmark = pytest.mark.slow
# Tests that need no reaper run with a lease a loaded machine cannot miss; the others with the
# session's 8 s lease (heartbeat every 0.5 s), so recovery takes seconds.
CALM = {"QERL_LEASE_SECONDS": "30", "QERL_HEARTBEAT_SECONDS": "1"}


@pytest.fixture(autouse=True)
def _clean(pg_sessions):
    cancel_leftovers(pg_sessions)


def _metric_steps(s, job_id: str, attempt: int) -> list[int]:
    return list(s.execute(select(JobMetric.step).where(JobMetric.job_id == job_id, JobMetric.attempt == attempt)
                          .order_by(JobMetric.step)).scalars())


def _wait(pred, timeout: float = 120, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _running_at(pg_sessions, job_id: str, step: int, timeout: float = 120) -> Job:
    """Wait until the job is running with a checkpoint at or past ``step``."""
    def check():
        with pg_sessions() as s:
            job = s.get(Job, job_id)
            ck = queue.latest_checkpoint(s, job_id)
            return job if job.status == "running" and ck is not None and ck.step >= step else None
    return _wait(check, timeout, f"job {job_id} to checkpoint step {step}")


def _wake(pg_sessions, *ids: str) -> None:
    with pg_sessions() as s:
        for jid in ids:
            queue.wake(jid, s)


def _owner(workers, job: Job):
    return next(w for w in workers if job.lease_owner.startswith(w.name + "@"))


def test_each_job_runs_exactly_once_on_four_workers(start_workers, pg_sessions, celery_sender):
    workers = start_workers(4, **CALM)
    with pg_sessions() as s:
        ids = [make_job(s, tiny_spec("tiny", steps=2)).id for _ in range(40)]
    t0 = time.monotonic()
    for jid in ids:  # every message twice: a duplicate delivery must not run a job twice
        _wake(pg_sessions, jid)
        celery_sender(jid)
    for jid in ids:
        wait_for_status(pg_sessions, jid, ("succeeded", "failed", "cancelled"), timeout=600)
    elapsed = time.monotonic() - t0
    _wait(lambda: celery_sender.pending() == 0, 120, "the duplicates to be consumed")
    time.sleep(3)  # the last ones claim nothing
    with pg_sessions() as s:
        jobs = [s.get(Job, jid) for jid in ids]
        assert {j.status for j in jobs} == {"succeeded"}, [(j.id, j.error_message) for j in jobs if j.error_message]
        assert {j.attempt for j in jobs} == {1}
        for jid in ids:
            starts = [e for e in events(s, jid) if e.message.startswith(("Job started", "Resuming"))]
            assert len(starts) == 1
            assert _metric_steps(s, jid, 1) == [1, 2]
        owners = {j.lease_owner for j in jobs}
        assert owners == {None}  # leases released at the end
        ran_on = {e.data["worker"].split("@")[0] for jid in ids for e in events(s, jid)
                  if e.data and "worker" in e.data}
    assert len(ran_on) >= 2, ran_on  # the work was spread
    print(f"40 jobs on 4 workers: {elapsed:.0f} s")


def test_one_worker_serves_two_projects_in_turn(start_workers, pg_sessions):
    """Project A queues three jobs, then project B one: the only worker runs A, B, A, A (the
    wake-ups arrive in the jobs' order; each claims the job whose turn it is)."""
    run = uuid.uuid4().hex[:8]
    with pg_sessions() as s:
        jobs = [make_job(s, tiny_spec("tiny", steps=1), project=f"turns-{run}-{p}").id for p in "aaab"]
    start_workers(1, **CALM)
    _wake(pg_sessions, *jobs)
    for jid in jobs:
        wait_for_status(pg_sessions, jid, ("succeeded", "failed", "cancelled"), timeout=300)
    with pg_sessions() as s:
        done = [s.get(Job, jid) for jid in jobs]
        assert {(j.status, j.attempt) for j in done} == {("succeeded", 1)}, [j.error_message for j in done]
        by_start = [jobs.index(j.id) for j in sorted(done, key=lambda j: j.started_at)]
    assert by_start == [0, 3, 1, 2]


def test_sigkill_mid_job_resumes_from_the_checkpoint_on_another_worker(start_workers, pg_sessions):
    workers = start_workers(2)
    with pg_sessions() as s:
        jid = make_job(s, tiny_spec("tiny", steps=14, checkpoint_interval=2)).id
    _wake(pg_sessions, jid)
    job = _running_at(pg_sessions, jid, 4)
    victim = _owner(workers, job)
    victim.kill(signal.SIGKILL)  # main process and its child, as when a host dies
    done = wait_for_status(pg_sessions, jid, ("succeeded", "failed"), timeout=180)
    assert done.status == "succeeded" and done.attempt == 2, done.error_message
    with pg_sessions() as s:
        lost = next(e for e in events(s, jid) if e.message.startswith("Worker lost"))
        resumed_from = s.get(Checkpoint, done.resume_checkpoint_id).step
        assert lost.message == f"Worker lost; resuming from checkpoint step {resumed_from} (attempt 2)"
        assert resumed_from >= 4
        assert _metric_steps(s, jid, 2) == list(range(resumed_from + 1, 15))  # no restart from step 0
        assert f"Resuming from checkpoint step {resumed_from} (attempt 2)" in [e.message for e in events(s, jid)]
        assert not s.get(Job, jid).lease_owner


def test_cancel_a_queued_and_a_running_job(start_workers, pg_sessions):
    start_workers(1, **CALM)
    with pg_sessions() as s:
        running = make_job(s, tiny_spec("tiny", steps=500, checkpoint_interval=0)).id
        waiting = make_job(s, tiny_spec("tiny", steps=2)).id
    _wake(pg_sessions, running, waiting)  # the second waits behind the running one: the only worker is busy
    with pg_sessions() as s:
        _wait(lambda: (s.get(Job, running, populate_existing=True).step >= 2), 120, "two steps")
        assert s.get(Job, waiting).status == "queued"
        queue.cancel(s, s.get(Job, waiting))
        s.commit()
        assert s.get(Job, waiting).status == "cancelled"
        seen = s.get(Job, running, populate_existing=True).step
        queue.cancel(s, s.get(Job, running))
        s.commit()
    t0 = time.monotonic()
    done = wait_for_status(pg_sessions, running, ("cancelled", "succeeded", "failed"), timeout=60)
    assert done.status == "cancelled" and time.monotonic() - t0 < 20
    with pg_sessions() as s:
        assert max(_metric_steps(s, running, 1)) <= seen + 2
        assert s.get(Job, waiting).attempt == 0  # its late message found nothing to do


def test_pausing_a_running_job_frees_the_worker_and_resume_continues_from_its_checkpoint(start_workers, pg_sessions):
    start_workers(1, **CALM)
    with pg_sessions() as s:
        long = make_job(s, tiny_spec("tiny", steps=12, checkpoint_interval=0)).id
        short = make_job(s, tiny_spec("tiny", steps=2)).id
    _wake(pg_sessions, long, short)  # the second waits behind the first: the only worker is busy
    with pg_sessions() as s:
        _wait(lambda: (s.get(Job, long, populate_existing=True).step >= 2), 120, "two steps")
        assert s.get(Job, short).status == "queued"
        queue.pause(s, s.get(Job, long))
        s.commit()
    paused = wait_for_status(pg_sessions, long, ("paused", "succeeded", "failed", "cancelled"), timeout=60)
    assert paused.status == "paused" and 2 <= paused.step < 12
    done = wait_for_status(pg_sessions, short, ("succeeded", "failed", "cancelled"), timeout=120)
    assert done.status == "succeeded"  # the worker took the waiting job while the first one is paused
    with pg_sessions() as s:
        assert s.get(Job, long).status == "paused"
        queue.resume(s, s.get(Job, long))
        s.commit()
    _wake(pg_sessions, long)
    done = wait_for_status(pg_sessions, long, ("succeeded", "failed", "cancelled"), timeout=180)
    assert done.status == "succeeded" and done.attempt == 2 and done.adapter_id is not None
    with pg_sessions() as s:
        assert _metric_steps(s, long, 1)[-1] == paused.step  # the first run stopped at the checkpoint it saved
        assert _metric_steps(s, long, 2) == list(range(paused.step + 1, 13))
        msgs = [e.message for e in events(s, long)]
        assert f"Resuming from checkpoint step {paused.step} (attempt 2)" in msgs
        assert not any(m.startswith(("Worker lost", "Worker shutting down")) for m in msgs)


def test_a_frozen_worker_cannot_write_after_it_was_reaped(start_workers, pg_sessions):
    workers = start_workers(2)
    with pg_sessions() as s:
        jid = make_job(s, tiny_spec("tiny", steps=16, checkpoint_interval=2)).id
    _wake(pg_sessions, jid)
    stale = _owner(workers, _running_at(pg_sessions, jid, 2))
    stale.kill(signal.SIGSTOP)  # a stalled host: no heartbeats, but the process lives on
    try:
        def taken_over():
            with pg_sessions() as s:
                job = s.get(Job, jid)
                return job.attempt == 2 and job.status == "running"
        _wait(taken_over, 120, "the job to be re-claimed")
    finally:
        stale.kill(signal.SIGCONT)
    done = wait_for_status(pg_sessions, jid, ("succeeded", "failed"), timeout=180)
    assert done.status == "succeeded" and done.attempt == 2
    _wait(lambda: "lease lost" in stale.log(), 30, "the stale worker to notice")
    with pg_sessions() as s:
        reap_id = next(e.id for e in events(s, jid) if e.message.startswith("Worker lost"))
        late = s.execute(select(JobEvent).where(JobEvent.job_id == jid, JobEvent.attempt == 1,
                                                JobEvent.id > reap_id)).scalars().all()
        assert late == []
        steps_2 = _metric_steps(s, jid, 2)
        assert steps_2 and steps_2[-1] == 16


def test_a_worker_frozen_inside_a_transaction_does_not_keep_the_reaper_out(worker_pg_url, pg_sessions):
    """The race the test above can hit: a worker stopped between its fence and its commit holds
    the job's row lock, and the reaper skips locked rows. With the workers' engine setting
    (``idle_in_transaction_s``: their lease) the server ends the stalled session after that long,
    the lock goes, and a reaper pass requeues the job; the frozen worker's commit then fails and
    writes nothing."""
    from sqlalchemy import update
    from sqlalchemy.exc import DBAPIError

    from service.db import make_engine, make_sessionmaker
    from service.models import utcnow

    frozen = make_engine(worker_pg_url, idle_in_transaction_s=2.0)
    try:
        with pg_sessions() as s:
            jid = make_job(s, tiny_spec("tiny", steps=4)).id
            queue.claim(s, jid, "frozen-worker", lease_seconds=30)
            s.execute(update(Job).where(Job.id == jid).values(lease_expires_at=utcnow()))  # the lease ran out
            s.commit()
        stalled = make_sessionmaker(frozen)()
        assert queue.fence(stalled, jid, 1) == "running"  # the row is locked until this transaction ends
        t0 = time.monotonic()
        with pg_sessions() as s:
            assert queue.reap(s) == []  # locked: skipped
            while not (requeued := queue.reap(s)) and time.monotonic() - t0 < 60:
                time.sleep(0.2)
        assert requeued == [jid] and time.monotonic() - t0 < 20  # about the 2 s timeout
        with pytest.raises(DBAPIError):
            queue.add_event(stalled, jid, 1, "written after the reap")
            stalled.commit()
        stalled.close()
        with pg_sessions() as s:
            assert s.get(Job, jid).status in ("queued", "running")  # requeued (a worker may take it)
            assert all(e.message != "written after the reap" for e in events(s, jid))
    finally:
        frozen.dispose()


def test_sweeper_resends_a_lost_wakeup(start_workers, pg_sessions, worker_queue_env):
    start_workers(1, via_cli=True, **CALM)  # `qerl worker`, as operators start it
    with pg_sessions() as s:
        jid = make_job(s, tiny_spec("tiny", steps=2)).id  # committed, but no message was ever sent
    sweep_after = float(worker_queue_env["QERL_SWEEP_AFTER_SECONDS"])
    done = wait_for_status(pg_sessions, jid, ("succeeded", "failed"), timeout=60 + sweep_after)
    assert done.status == "succeeded" and done.wakeup_sent_at is not None and done.attempt == 1


def test_warm_shutdown_requeues_and_another_worker_resumes(start_workers, pg_sessions):
    workers = start_workers(2, **CALM)
    with pg_sessions() as s:
        jid = make_job(s, tiny_spec("tiny", steps=14, checkpoint_interval=4)).id
    _wake(pg_sessions, jid)
    leaving = _owner(workers, _running_at(pg_sessions, jid, 4))
    t0 = time.monotonic()
    assert leaving.terminate(timeout=60) == 0  # SIGTERM to the main process, as docker stop does
    assert time.monotonic() - t0 < 30
    done = wait_for_status(pg_sessions, jid, ("succeeded", "failed"), timeout=180)
    assert done.status == "succeeded" and done.attempt == 2
    with pg_sessions() as s:
        msgs = [e.message for e in events(s, jid)]
        handback = next(m for m in msgs if m.startswith("Worker shutting down; job requeued"))
        step = int(handback.rsplit(" ", 1)[1])
        assert step >= 4 and _metric_steps(s, jid, 2) == list(range(step + 1, 15))
        assert not any(m.startswith("Worker lost") for m in msgs)  # handed back, not reaped


def test_an_evaluation_runs_on_a_worker_and_a_killed_one_is_run_again(start_workers, pg_sessions, worker_queue_env):
    """An evaluation (a job row of kind eval) of a trained job's adapter runs on a Celery worker to
    its scores and rows file; SIGKILLed mid-run, it is reaped and run again (attempt 2), to the
    same scores as an evaluation of the same rows that nothing interrupted."""
    workers = start_workers(2)
    with pg_sessions() as s:
        jid = make_job(s, tiny_spec("tiny", steps=1)).id
    _wake(pg_sessions, jid)
    trained = wait_for_status(pg_sessions, jid, "succeeded", timeout=180)
    data = jsonl([{"prompt": f"What is {i} times {i + 1}?", "answer": str(i * (i + 1))} for i in range(96)])
    file_id = new_id("file")
    rel = f"files/{file_id}.jsonl"
    (Path(worker_queue_env["ARTIFACT_DIR"]) / rel).parent.mkdir(parents=True, exist_ok=True)
    (Path(worker_queue_env["ARTIFACT_DIR"]) / rel).write_bytes(data)
    with pg_sessions() as s:
        s.add(File(id=file_id, project="proj-test", filename="test.jsonl", purpose="fine-tune", bytes=len(data),
                   sha256=hashlib.sha256(data).hexdigest(), path=rel, rows=96))
        adapter = s.get(Adapter, trained.adapter_id)
        spec = {"model": "tiny", "init_adapter": adapter.path, "grader": STRING_CHECK, "max_new_tokens": 32,
                "compare_base": True}
        ids = [make_job(s, spec, kind="eval", model=adapter.name, validation_file=file_id).id for _ in range(2)]
    _wake(pg_sessions, ids[0])
    whole = wait_for_status(pg_sessions, ids[0], ("succeeded", "failed"), timeout=180)
    assert whole.status == "succeeded" and whole.attempt == 1, whole.error_message
    _wake(pg_sessions, ids[1])

    def scoring():
        with pg_sessions() as s:
            job = s.get(Job, ids[1])
            said = [e.message for e in events(s, ids[1])]
            return job if job.status == "running" and any(m.startswith("Scoring 96 rows") for m in said) else None

    _owner(workers, _wait(scoring, 120, "the evaluation to start scoring")).kill(signal.SIGKILL)
    done = wait_for_status(pg_sessions, ids[1], ("succeeded", "failed"), timeout=180)
    assert done.status == "succeeded" and done.attempt == 2, done.error_message
    with pg_sessions() as s:
        said = [e.message for e in events(s, ids[1])]
        assert any(m.startswith("Worker lost") for m in said), said
        assert sum(m.startswith(f"Scoring 96 rows of {file_id} with {adapter.name}") for m in said) == 2, said
        assert done.outcome == whole.outcome and done.outcome["rows"] == 96 and done.outcome["device"] == "cpu"
        assert set(done.outcome["fine_tuned"]) == set(done.outcome["base"]) >= {"accuracy", "reward_mean"}
        rows = s.get(File, done.result_file_id)
        assert rows.rows == 96 and rows.filename == "evaluation_rows.jsonl"
        lines = (Path(worker_queue_env["ARTIFACT_DIR"]) / rows.path).read_text().splitlines()
        assert [json.loads(line)["index"] for line in lines] == list(range(96))
        assert not s.get(Job, ids[1]).lease_owner
