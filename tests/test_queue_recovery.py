"""Reaper, sweeper, wake-ups and graceful requeue against the real databases (Postgres and SQLite)."""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
from sqlalchemy import update

from service import queue
from service.models import Checkpoint, Job, utcnow
from service.storage import ArtifactStore
from tests._worker_fixtures import cancel_leftovers, events, make_job

SPEC = {"model": "tiny", "steps": 10}


@pytest.fixture(autouse=True)
def empty_queue(sessions):
    cancel_leftovers(sessions)


def _running(s, *, attempt_to: int = 1, **fields) -> Job:
    job = make_job(s, SPEC, **fields)
    for i in range(attempt_to):
        if i:
            s.execute(update(Job).where(Job.id == job.id).values(status="queued"))
            s.commit()
        queue.claim(s, job.id, f"w{i}", lease_seconds=30)
    return s.get(Job, job.id, populate_existing=True)


def _expire(s, jid: str, ago: float = 1.0) -> None:
    s.execute(update(Job).where(Job.id == jid).values(lease_expires_at=utcnow() - timedelta(seconds=ago)))
    s.commit()


def test_reap_requeues_from_the_latest_checkpoint_and_wakes(sessions, dispatched):
    with sessions() as s:
        job = _running(s)
        live = _running(s)  # lease still valid: untouched
        for step in (2, 4):
            s.add(Checkpoint(job_id=job.id, attempt=1, step=step, path=f"jobs/{job.id}/checkpoints/step-{step:06d}"))
        s.execute(update(Job).where(Job.id == job.id).values(step=5))
        s.commit()
        _expire(s, job.id)
        assert queue.reap(s) == [job.id]
        assert queue.reap(s) == []  # idempotent
        got = s.get(Job, job.id, populate_existing=True)
        ckpt = s.get(Checkpoint, got.resume_checkpoint_id)
        assert (got.status, got.attempt, got.lease_owner, ckpt.step, got.step) == ("queued", 1, None, 4, 4)
        last = events(s, job.id)[-1]
        assert last.message == "Worker lost; resuming from checkpoint step 4 (attempt 2)" and last.level == "warn"
        assert dispatched == [job.id]
        assert s.get(Job, live.id, populate_existing=True).status == "running"
        again = queue.claim(s, job.id, "w9")
        assert again.attempt == 2
        assert events(s, job.id)[-1].message == "Resuming from checkpoint step 4 (attempt 2)"


def test_reap_without_checkpoint_says_step_zero(sessions, dispatched):
    with sessions() as s:
        job = _running(s)
        _expire(s, job.id)
        queue.reap(s)
        assert events(s, job.id)[-1].message == "Worker lost; resuming from step 0 (no checkpoint yet) (attempt 2)"


def test_reap_fails_the_job_after_max_attempts(sessions, dispatched):
    with sessions() as s:
        job = _running(s, attempt_to=2, max_attempts=2)
        _expire(s, job.id)
        assert queue.reap(s) == []
        got = s.get(Job, job.id, populate_existing=True)
        assert (got.status, got.error_code) == ("failed", "worker_lost")
        assert "attempt 2 of 2" in got.error_message and got.finished_at is not None
        assert dispatched == []


def test_reap_finishes_an_abandoned_cancel(sessions, dispatched):
    with sessions() as s:
        job = _running(s)
        queue.cancel(s, job)
        s.commit()
        _expire(s, job.id)
        queue.reap(s)
        assert s.get(Job, job.id, populate_existing=True).status == "cancelled"


def test_reap_pauses_a_job_whose_worker_died_while_pausing(sessions, dispatched):
    with sessions() as s:
        job = _running(s)
        s.add(Checkpoint(job_id=job.id, attempt=1, step=2, path="x"))
        queue.pause(s, job)
        s.commit()
        _expire(s, job.id)
        assert queue.reap(s) == []  # not requeued: the user asked for a pause
        got = s.get(Job, job.id, populate_existing=True)
        assert (got.status, got.lease_owner, got.step, got.finished_at) == ("paused", None, 2, None)
        assert events(s, job.id)[-1].message == ("Worker lost while pausing; the job was paused and will resume "
                                                 "from checkpoint step 2 when resumed")
        assert dispatched == []


def test_concurrent_reapers_requeue_once(sessions, dispatched):
    with sessions() as s:
        ids = [_running(s).id for _ in range(5)]
        for jid in ids:
            _expire(s, jid)
    results: list[list[str]] = []
    barrier = threading.Barrier(3)

    def reaper() -> None:
        with sessions() as s:
            barrier.wait()
            results.append(queue.reap(s))

    threads = [threading.Thread(target=reaper) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(j for r in results for j in r) == sorted(ids)
    with sessions() as s:
        for jid in ids:
            assert sum(e.message.startswith("Worker lost") for e in events(s, jid)) == 1


def test_wake_stamps_and_sends_only_queued_jobs(sessions, dispatched):
    with sessions() as s:
        job = make_job(s, SPEC)
        assert queue.wake(job.id, s) is True
        assert s.get(Job, job.id, populate_existing=True).wakeup_sent_at is not None
        done = make_job(s, SPEC, status="succeeded")
        assert queue.wake(done.id, s) is False
    assert dispatched == [job.id]


def test_wake_send_failure_leaves_the_job_for_the_sweeper(sessions):
    def broken(job_id: str) -> None:
        raise ConnectionError("broker down")

    queue.set_dispatcher(broken)
    try:
        with sessions() as s:
            job = make_job(s, SPEC)
            with pytest.raises(ConnectionError):
                queue.wake(job.id, s)
            assert s.get(Job, job.id, populate_existing=True).status == "queued"
    finally:
        queue.set_dispatcher(None)


def test_sweep_resends_lost_wakeups_once(sessions, dispatched):
    old = utcnow() - timedelta(seconds=120)
    with sessions() as s:
        never = make_job(s, SPEC, created_at=old)  # committed, but its wake-up never went out
        stale = make_job(s, SPEC, created_at=old, wakeup_sent_at=old)
        fresh = make_job(s, SPEC, created_at=old, wakeup_sent_at=utcnow())
        young = make_job(s, SPEC)  # just created: the API's own wake-up is on its way
    woken: list[list[str]] = []
    barrier = threading.Barrier(3)

    def sweeper() -> None:
        with sessions() as s:
            barrier.wait()
            woken.append(queue.sweep(s, older_than_s=60))

    threads = [threading.Thread(target=sweeper) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(dispatched) == sorted([never.id, stale.id])
    assert sorted(j for w in woken for j in w) == sorted(dispatched)
    assert fresh.id not in dispatched and young.id not in dispatched


def test_requeue_on_shutdown_keeps_the_attempt_budget(sessions, dispatched):
    with sessions() as s:
        job = _running(s, max_attempts=3)
        s.add(Checkpoint(job_id=job.id, attempt=1, step=3, path="x"))
        s.commit()
        assert queue.requeue(s, job.id, 1, "Worker shutting down") == "queued"
        got = s.get(Job, job.id, populate_existing=True)
        assert (got.status, got.max_attempts, got.step, got.lease_owner) == ("queued", 4, 3, None)
        assert events(s, job.id)[-1].message == ("Worker shutting down; job requeued, will resume from "
                                                 "checkpoint step 3")
        assert dispatched == [job.id]

        cancelling = _running(s)
        queue.cancel(s, cancelling)
        s.commit()
        assert queue.requeue(s, cancelling.id, 1, "Worker shutting down") == "cancelled"
        assert s.get(Job, cancelling.id, populate_existing=True).status == "cancelled"


def test_sweep_waits_while_messages_are_still_queued_in_the_broker(sessions):
    class Broker:  # the broker's side of CelerySender: pending() and send
        def __init__(self) -> None:
            self.waiting, self.sent = 3, []

        def pending(self) -> int:
            return self.waiting

        def __call__(self, job_id: str) -> None:
            self.sent.append(job_id)

    broker = Broker()
    queue.set_dispatcher(broker)
    try:
        old = utcnow() - timedelta(seconds=120)
        with sessions() as s:
            job = make_job(s, SPEC, created_at=old, wakeup_sent_at=old)
            assert queue.sweep(s, older_than_s=60) == [] and broker.sent == []  # a backlog: no duplicates
            broker.waiting = 0  # drained, and the job is still queued: its message was lost
            assert queue.sweep(s, older_than_s=60) == [job.id] and broker.sent == [job.id]
    finally:
        queue.set_dispatcher(None)


def test_workdirs_of_finished_jobs_are_removed_after_the_retention(sessions, tmp_path):
    from worker.artifacts import job_workdir, remove_finished_workdirs

    now = utcnow()
    with sessions() as s:
        jobs = {name: make_job(s, SPEC, status=status, finished_at=now - timedelta(seconds=ago) if ago else None).id
                for name, status, ago in [
                    ("succeeded_old", "succeeded", 7200), ("failed_old", "failed", 7200),
                    ("cancelled_old", "cancelled", 7200), ("succeeded_new", "succeeded", 60),
                    ("queued", "queued", None), ("running", "running", None), ("paused", "paused", None),
                    ("pausing", "pausing", None)]}
    for jid in jobs.values():
        ckpt = job_workdir(tmp_path, jid) / "checkpoints" / "step-000002"
        ckpt.mkdir(parents=True)
        (ckpt / "optimizer.pt").write_bytes(b"x" * 1000)
    unknown = job_workdir(tmp_path, "ftjob-not-in-the-database")
    unknown.mkdir()
    cut_short = tmp_path / "jobs" / ".ftjob-gone.removing" / "checkpoints"
    cut_short.mkdir(parents=True)
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "adapter-x.tar.gz").write_bytes(b"tarball")

    with sessions() as s:
        removed = remove_finished_workdirs(s, ArtifactStore(tmp_path), retention_s=3600)
    assert sorted(removed) == sorted([jobs["succeeded_old"], jobs["failed_old"], jobs["cancelled_old"]])
    left = sorted(p.name for p in (tmp_path / "jobs").iterdir())
    assert left == sorted([jobs[n] for n in ("succeeded_new", "queued", "running", "paused", "pausing")]
                          + [unknown.name])  # the cut-short removal finished too
    assert (tmp_path / "adapters" / "adapter-x.tar.gz").read_bytes() == b"tarball"
    with sessions() as s:
        assert remove_finished_workdirs(s, ArtifactStore(tmp_path), retention_s=3600) == []  # idempotent
        assert remove_finished_workdirs(s, ArtifactStore(tmp_path), retention_s=0) == [jobs["succeeded_new"]]
        assert (job_workdir(tmp_path, jobs["paused"]) / "checkpoints" / "step-000002").is_dir()
    assert remove_finished_workdirs(None, ArtifactStore(tmp_path / "elsewhere"), retention_s=0) == []  # no jobs/ yet


def test_worker_exited_ends_only_the_leases_of_that_nodes_dead_processes(sessions):
    """The Celery worker's main process reports a dead pool process; the job it ran is found by
    its lease owner (``node:pid``), whichever job the task's message named."""
    with sessions() as s:
        dead, alive, other = (make_job(s, SPEC).id for _ in range(3))
        for jid, owner in ((dead, "n1@h:101"), (alive, "n1@h:102"), (other, "n1@h2:101")):
            queue.claim(s, jid, owner, lease_seconds=300)
        touched = queue.worker_exited(s, "n1@h", "signal 9 (SIGKILL)", alive=lambda pid: pid == 102)
        assert touched == [dead]
        now = utcnow()
        leases = {j: s.get(Job, j, populate_existing=True).lease_expires_at for j in (dead, alive, other)}
        assert leases[dead].replace(tzinfo=None) <= now.replace(tzinfo=None)
        assert all(leases[j].replace(tzinfo=None) > now.replace(tzinfo=None) + timedelta(seconds=200)
                   for j in (alive, other))
        [note] = [e for e in events(s, dead) if e.level == "error"]
        assert note.message.startswith("The worker process running attempt 1 (n1@h:101) died: signal 9 (SIGKILL); ")
        assert "out-of-memory killer" in note.message and note.data == {"worker_exit": "signal 9 (SIGKILL)"}
        assert not [e for e in events(s, alive) + events(s, other) if e.level == "error"]
        assert queue.worker_exited(s, "n1@h", "signal 9 (SIGKILL)", alive=lambda pid: pid == 102) == []  # once


def test_pid_alive_tells_a_reaped_child_from_a_live_process():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert queue.pid_alive(os.getpid()) and not queue.pid_alive(child.pid)
