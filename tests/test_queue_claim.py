"""Claiming, leases, fencing, cancel and finish against the real databases (Postgres and SQLite)."""
from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from service import queue
from service.models import Adapter, Checkpoint, Job, utcnow
from tests._worker_fixtures import cancel_leftovers, events, make_job

SPEC = {"model": "tiny", "steps": 3}


@pytest.fixture(autouse=True)
def empty_queue(sessions):
    cancel_leftovers(sessions)


def test_claim_next_is_exclusive_across_threads(sessions):
    with sessions() as s:
        ids = {make_job(s, SPEC).id for _ in range(24)}
    claimed: list[tuple[str, str, int]] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        while True:
            with sessions() as s:
                job = queue.claim_next(s, name, lease_seconds=30)
            if job is None:
                return
            with lock:
                claimed.append((job.id, name, job.attempt))

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counts = Counter(jid for jid, _, _ in claimed)
    assert set(counts) == ids and set(counts.values()) == {1}
    assert {a for _, _, a in claimed} == {1}
    with sessions() as s:
        for jid, name, _ in claimed:
            job = s.get(Job, jid)
            assert (job.status, job.attempt, job.lease_owner) == ("running", 1, name)
            starts = [e for e in events(s, jid) if e.message.startswith("Job started")]
            assert len(starts) == 1 and starts[0].data == {"worker": name}


def test_claim_one_job_from_many_threads_has_one_winner(sessions):
    with sessions() as s:
        jid = make_job(s, SPEC).id
    barrier, wins = threading.Barrier(6), []

    def worker(i: int) -> None:
        with sessions() as s:
            barrier.wait()
            if queue.claim(s, jid, f"w{i}") is not None:
                wins.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(wins) == 1
    with sessions() as s:
        job = s.get(Job, jid)
        assert job.attempt == 1 and job.lease_owner == f"w{wins[0]}"


def test_claim_sets_lease_and_keeps_first_start_time(sessions):
    with sessions() as s:
        jid = make_job(s, SPEC).id
        before = utcnow()
        job = queue.claim(s, jid, "w1", lease_seconds=30)
        started = job.started_at
        assert job.status == "running" and job.attempt == 1 and job.heartbeat_at is not None
        assert _aware(job.lease_expires_at) - before >= timedelta(seconds=29)
        assert queue.claim(s, jid, "w2") is None  # already running: a duplicate message does nothing
        s.execute(update(Job).where(Job.id == jid).values(status="queued"))  # as the reaper would
        s.commit()
        again = queue.claim(s, jid, "w2")
        assert again.attempt == 2 and again.lease_owner == "w2" and again.started_at == started
    for status in ("validating_files", "succeeded", "cancelled"):
        with sessions() as s:
            assert queue.claim(s, make_job(s, SPEC, status=status).id, "w1") is None


def test_heartbeat_extends_the_lease_and_reports_cancel_and_pause(sessions):
    with sessions() as s:
        jid = make_job(s, SPEC).id
        job = queue.claim(s, jid, "w1", lease_seconds=5)
        first = _aware(job.lease_expires_at)
        assert queue.heartbeat(s, jid, 1, "w1", lease_seconds=60) == "running"
        assert _aware(s.get(Job, jid, populate_existing=True).lease_expires_at) > first + timedelta(seconds=50)
        with pytest.raises(queue.LeaseLost):
            queue.heartbeat(s, jid, 1, "someone-else")
        with pytest.raises(queue.LeaseLost):
            queue.heartbeat(s, jid, 2, "w1")
        queue.pause(s, s.get(Job, jid))
        s.commit()
        assert queue.heartbeat(s, jid, 1, "w1") == "pausing"  # the runner stops, saving a checkpoint
        queue.cancel(s, s.get(Job, jid))  # a cancel overrides a pause in flight
        s.commit()
        assert queue.heartbeat(s, jid, 1, "w1") == "cancelling"  # the runner stops


def test_cancel_moves_each_state_the_right_way(sessions):
    with sessions() as s:
        queued = make_job(s, SPEC)
        queue.cancel(s, queued)
        s.commit()
        assert queued.status == "cancelled" and queued.finished_at is not None
        assert events(s, queued.id)[-1].message == "The job was cancelled"

        running = make_job(s, SPEC)
        queue.claim(s, running.id, "w1")
        queue.cancel(s, running)
        s.commit()
        assert running.status == "cancelling" and running.cancel_requested
        queue.cancel(s, running)  # again: idempotent
        s.commit()
        assert running.status == "cancelling"
        assert sum("Cancellation requested" in e.message for e in events(s, running.id)) == 1

        for status in ("succeeded", "failed", "cancelled"):
            done = make_job(s, SPEC, status=status)
            with pytest.raises(queue.JobConflict, match="only queued, running or paused jobs can be cancelled"):
                queue.cancel(s, done)
            s.rollback()

        paused = make_job(s, SPEC, status="paused")
        queue.cancel(s, paused)
        s.commit()
        assert paused.status == "cancelled" and paused.finished_at is not None


def test_pause_and_resume_move_each_state_the_right_way(sessions, dispatched):
    with sessions() as s:
        queued = make_job(s, SPEC)
        queue.pause(s, queued)
        s.commit()
        assert queued.status == "paused" and queued.finished_at is None
        assert queue.claim(s, queued.id, "w1") is None  # a late wake-up claims nothing
        queue.pause(s, queued)  # again: idempotent
        s.commit()
        assert sum("paused" in e.message for e in events(s, queued.id)) == 1
        queue.resume(s, queued)
        s.commit()
        assert queued.status == "queued"
        assert events(s, queued.id)[-1].message == ("The job was resumed; it is queued and will resume from step 0 "
                                                    "(no checkpoint yet)")
        queue.resume(s, queued)  # already queued: nothing to resume, no event
        s.commit()
        assert queued.status == "queued" and "resumed" in events(s, queued.id)[-1].message
        assert sum("resumed" in e.message for e in events(s, queued.id)) == 1

        running = make_job(s, SPEC)
        queue.claim(s, running.id, "w1")
        queue.pause(s, running)
        s.commit()
        assert running.status == "pausing" and not running.cancel_requested
        queue.pause(s, running)
        s.commit()
        assert sum("Pause requested" in e.message for e in events(s, running.id)) == 1
        with pytest.raises(queue.JobConflict, match="still pausing.*once its status is paused"):
            queue.resume(s, running)
        s.rollback()
        s.add(Checkpoint(job_id=running.id, attempt=1, step=3, path="x"))
        s.commit()
        assert queue.requeue(s, running.id, 1, "Worker shutting down") == "paused"  # the engine stopped
        got = s.get(Job, running.id, populate_existing=True)
        ckpt = s.get(Checkpoint, got.resume_checkpoint_id)
        assert (got.status, got.lease_owner, got.step, ckpt.step, got.max_attempts) == ("paused", None, 3, 3, 4)
        assert events(s, running.id)[-1].message == ("The job was paused; it will resume from checkpoint step 3 "
                                                     "when resumed")
        assert running.id not in dispatched  # a paused job is nobody's to claim
        queue.resume(s, got)
        s.commit()
        again = queue.claim(s, running.id, "w2")
        assert (again.attempt, again.resume_checkpoint_id) == (2, ckpt.id)
        assert events(s, running.id)[-1].message == "Resuming from checkpoint step 3 (attempt 2)"

        queue.cancel(s, again)
        s.commit()
        with pytest.raises(queue.JobConflict, match="being cancelled; it cannot be paused"):
            queue.pause(s, again)
        s.rollback()
        with pytest.raises(queue.JobConflict, match="being cancelled; it cannot be resumed"):
            queue.resume(s, again)
        s.rollback()
        for status in ("succeeded", "failed", "cancelled"):
            done = make_job(s, SPEC, status=status)
            with pytest.raises(queue.JobConflict, match="only queued or running jobs can be paused"):
                queue.pause(s, done)
            s.rollback()
            with pytest.raises(queue.JobConflict, match="only paused jobs can be resumed"):
                queue.resume(s, done)
            s.rollback()
            assert s.get(Job, done.id, populate_existing=True).status == status


def test_finish_writes_outcomes_and_only_once(sessions):
    with sessions() as s:
        ok = make_job(s, SPEC, suffix="demo")
        queue.claim(s, ok.id, "w1")
        adapter = Adapter(project=ok.project, job_id=ok.id, name=f"ft:tiny:demo:{ok.id}", base_model="tiny",
                          path="adapters/x.tar.gz", bytes=10, sha256="0" * 64, manifest={"steps": 3})
        assert queue.finish(s, ok.id, 1, "succeeded", adapter=adapter) == "succeeded"
        job = s.get(Job, ok.id, populate_existing=True)
        assert (job.status, job.adapter_id, job.fine_tuned_model) == ("succeeded", adapter.id, adapter.name)
        assert job.lease_owner is None and job.finished_at is not None
        with pytest.raises(queue.LeaseLost):  # finished: nothing more from this attempt
            queue.finish(s, ok.id, 1, "failed", error_code="internal_error", error_message="late")

        bad = make_job(s, SPEC)
        queue.claim(s, bad.id, "w1")
        queue.finish(s, bad.id, 1, "failed", error_code="invalid_dataset", error_message="line 3: no prompt")
        job = s.get(Job, bad.id, populate_existing=True)
        assert (job.status, job.error_code, job.error_message) == ("failed", "invalid_dataset", "line 3: no prompt")
        assert events(s, bad.id)[-1].level == "error"

        late = make_job(s, SPEC)  # cancel arrived after the last heartbeat: cancel wins
        queue.claim(s, late.id, "w1")
        queue.cancel(s, late)
        s.commit()
        adapter2 = Adapter(project=late.project, job_id=late.id, name="x", base_model="tiny", path="p", bytes=1,
                           sha256="0" * 64, manifest={})
        assert queue.finish(s, late.id, 1, "succeeded", adapter=adapter2) == "cancelled"
        assert s.execute(select(Adapter).where(Adapter.job_id == late.id)).first() is None


def test_a_stale_attempt_cannot_write_after_a_reap(sessions):
    with sessions() as s:
        jid = make_job(s, SPEC).id
        queue.claim(s, jid, "old", lease_seconds=30)
        _expire(s, jid)
        assert queue.reap(s) == [jid]
        queue.claim(s, jid, "new", lease_seconds=30)
        n_events = len(events(s, jid))
    for write in (lambda s: queue.fence(s, jid, 1),
                  lambda s: queue.heartbeat(s, jid, 1, "old"),
                  lambda s: queue.finish(s, jid, 1, "failed", error_code="x", error_message="stale"),
                  lambda s: queue.requeue(s, jid, 1, "Worker shutting down")):
        with sessions() as s, pytest.raises(queue.LeaseLost):
            write(s)
    with sessions() as s:
        job = s.get(Job, jid)
        assert (job.status, job.attempt, job.lease_owner) == ("running", 2, "new")
        assert len(events(s, jid)) == n_events
        assert queue.fence(s, jid, 2) == "running"  # the new owner can


def _expire(s, jid: str) -> None:
    s.execute(update(Job).where(Job.id == jid).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    s.commit()


def _aware(dt):
    from datetime import timezone

    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)  # SQLite reads back naive UTC



def _projects(n: int) -> list[str]:
    run = uuid.uuid4().hex[:8]  # projects no earlier test started a job in
    return [f"fair-{run}-{i}" for i in range(n)]


def test_claim_next_lets_projects_take_turns(sessions):
    """One worker, finishing each job before the next claim: a project that queued three jobs
    first does not hold the worker until all three are done; the projects take turns."""
    a, b, c = _projects(3)
    with sessions() as s:
        names = {make_job(s, SPEC, project=p).id: f"{p[-1]}{i}" for p, n in ((a, 3), (b, 2), (c, 1)) for i in range(n)}
    order = []
    for _ in range(6):
        with sessions() as s:
            job = queue.claim_next(s, "w1", lease_seconds=30)
            order.append(names[job.id])
            queue.finish(s, job.id, job.attempt, "failed", error_code="test", error_message="ended")
    with sessions() as s:
        assert queue.claim_next(s, "w1") is None
    # never started first (oldest job first among them), then the project whose latest start is oldest
    assert order == ["00", "10", "20", "01", "11", "02"]


def test_claim_next_prefers_projects_with_fewer_running_jobs(sessions):
    """Three workers at once, no job finishing: each takes a job of a project that has none
    running; the fourth claim goes to the project whose latest start is oldest."""
    a, b, c = _projects(3)
    with sessions() as s:
        a_jobs = [make_job(s, SPEC, project=a).id for _ in range(3)]
        b_job = make_job(s, SPEC, project=b).id
        c_job = make_job(s, SPEC, project=c).id
    got = []
    for i in range(5):
        with sessions() as s:
            got.append(queue.claim_next(s, f"w{i}", lease_seconds=30).id)
    assert got == [a_jobs[0], b_job, c_job, a_jobs[1], a_jobs[2]]


def test_a_single_project_is_first_come_first_served(sessions):
    [p] = _projects(1)
    with sessions() as s:
        ids = [make_job(s, SPEC, project=p).id for _ in range(4)]
        # a requeued job (a lost worker's) keeps its place: before the jobs created after it
        queue.claim(s, ids[1], "w0", lease_seconds=30)
        s.execute(update(Job).where(Job.id == ids[1]).values(status="queued", lease_owner=None))
        s.commit()
    got = []
    for i in range(4):
        with sessions() as s:
            got.append(queue.claim_next(s, f"w{i}", lease_seconds=30).id)
    assert got == ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_queue_positions_are_the_order_workers_take_the_jobs(sessions, seed):
    """Fresh random queues over several projects, some with jobs running and some with earlier
    starts: the positions computed up front are the order of the claims that follow (each taken
    job keeps running)."""
    rng = random.Random(seed)
    projects = _projects(5)
    with sessions() as s:
        for p in projects:
            for _ in range(rng.randint(0, 2)):  # earlier jobs: some still running, some ended
                job = make_job(s, SPEC, project=p)
                queue.claim(s, job.id, "w-old", lease_seconds=300)
                if rng.random() < 0.5:
                    queue.finish(s, job.id, 1, "failed", error_code="test", error_message="ended")
        queued = [make_job(s, SPEC, project=rng.choice(projects)).id for _ in range(rng.randint(6, 14))]
        positions = queue.positions_of(s, queued + ["ftjob-unknown"])
    assert sorted(positions.values()) == list(range(1, len(queued) + 1)) and set(positions) == set(queued)
    taken = []
    for i in range(len(queued)):
        with sessions() as s:
            taken.append(queue.claim_next(s, f"w{i}", lease_seconds=300).id)
    assert taken == sorted(queued, key=positions.get)
