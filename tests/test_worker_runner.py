"""The job runner in this process with the real engine on the tiny model (Postgres and SQLite):
success with a downloadable adapter, failures with codes, cancel, shutdown-and-resume, lease loss."""
from __future__ import annotations

import csv
import hashlib
import io
import tarfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from service import queue
from service.models import Adapter, Checkpoint, File, Job, JobMetric, JobSample, utcnow
from service.settings import Settings
from service.storage import ArtifactStore
from tests._worker_fixtures import cancel_leftovers, events, make_job, tiny_spec, wait_for_status
from worker.runner import WorkerContext, execute


@pytest.fixture
def ctx(sessions, any_db_url, tiny_model_dir, tmp_path, dispatched):
    cancel_leftovers(sessions)
    settings = Settings(database_url=any_db_url, redis_url=None, artifact_dir=tmp_path / "artifacts",
                        data_dir=tmp_path, lease_seconds=10, heartbeat_seconds=0.3)
    return WorkerContext(settings=settings, sessions=sessions, worker_id="test-worker", shutdown=threading.Event())


def run_job(ctx: WorkerContext, job_id: str) -> str:
    """Claim ``job_id`` and run it as a worker would; "skipped" if it cannot be claimed."""
    with ctx.sessions() as s:
        job = queue.claim(s, job_id, ctx.worker_id, lease_seconds=ctx.settings.lease_seconds)
    return "skipped" if job is None else execute(ctx, job)


def _metrics(s, job_id: str) -> list[JobMetric]:
    return list(s.execute(select(JobMetric).where(JobMetric.job_id == job_id)
                          .order_by(JobMetric.attempt, JobMetric.step)).scalars())


def _run_in_thread(ctx: WorkerContext, job_id: str) -> tuple[threading.Thread, list[str]]:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(run_job(ctx, job_id)))
    t.start()
    return t, out


def _wait_step(sessions, job_id: str, step: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sessions() as s:
            got = s.get(Job, job_id).step
        if got >= step:
            return got
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not reach step {step}")


def test_success_packs_a_peft_adapter_and_records_progress(ctx, sessions):
    with sessions() as s:
        job = make_job(s, tiny_spec("tiny", eval_interval=2, data={"eval_size": 2}), suffix="demo")
    assert run_job(ctx, job.id) == "succeeded"
    assert run_job(ctx, job.id) == "skipped"  # a duplicate message is harmless
    art = Path(ctx.settings.artifact_dir)
    with sessions() as s:
        got = s.get(Job, job.id)
        adapter = s.get(Adapter, got.adapter_id)
        assert (got.status, got.step, got.total_steps, got.attempt) == ("succeeded", 3, 3, 1)
        assert got.fine_tuned_model == adapter.name == f"ft:tiny:proj-test:demo:{job.id.removeprefix('ftjob-')}"
        tar_path = art / adapter.path
        assert adapter.path == f"adapters/{adapter.id}.tar.gz"
        assert adapter.sha256 == hashlib.sha256(tar_path.read_bytes()).hexdigest()
        assert adapter.bytes == tar_path.stat().st_size and adapter.manifest["steps"] == 3
        with tarfile.open(tar_path) as tar:
            assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors",
                                              "qerl_manifest.json"]
        assert [m.step for m in _metrics(s, job.id)] == [0, 1, 2, 3]  # 0: the evaluation before training
        msgs = [e.message for e in events(s, job.id)]
        assert msgs[0] == "Job started (attempt 1)" and msgs[-1] == "The job has successfully completed"
        assert sum(m.startswith("Step ") for m in msgs) == 3 and any(m.startswith("Step 2/3: reward") for m in msgs)
        ckpts = s.execute(select(Checkpoint).where(Checkpoint.job_id == job.id)).scalars().all()
        assert sorted(c.step for c in ckpts) == [1, 2, 3]
        # evaluated at step 2 (eval_interval) and at the end: those checkpoints carry the held-out scores too
        by_step = {c.step: c.metrics for c in ckpts}
        evals = {m.step: m.values for m in _metrics(s, job.id)}
        for step in (2, 3):
            assert "reward_mean" in by_step[step] and by_step[step]["eval/reward_mean"] == evals[step]["eval/reward_mean"]
        assert not any(k.startswith("eval/") for k in by_step[1])
        final_evals = [e for e in events(s, job.id) if e.message.startswith("Evaluation at step 3")]
        assert len(final_evals) == 1  # the end's evaluation ran once, before the last checkpoint
        assert adapter.manifest["metrics"]["eval/reward_mean"] == evals[3]["eval/reward_mean"]
        assert all(not Path(c.path).is_absolute() and c.path.startswith(f"jobs/{job.id}/checkpoints/") for c in ckpts)
        # the results file (OpenAI's result_files): every step's metrics as CSV, a file of the job's project
        results = s.get(File, got.result_file_id)
        assert (results.project, results.filename, results.purpose, results.rows) == (
            got.project, "step_metrics.csv", "fine-tune-results", 4)
        data = (art / results.path).read_bytes()
        assert results.sha256 == hashlib.sha256(data).hexdigest() and results.bytes == len(data)
        table = list(csv.DictReader(io.StringIO(data.decode())))
        assert [int(r["step"]) for r in table] == [0, 1, 2, 3]
        for row, m in zip(table, _metrics(s, job.id)):
            assert {k: float(v) for k, v in row.items() if v and k != "step"} == pytest.approx(m.values, rel=0, abs=0)
        assert [bool(r["eval/reward_mean"]) for r in table] == [True, False, True, True]
        # the reported samples (log_samples 4 = every one of a step's 2 prompts x 2 samples; 2 eval prompts):
        # their rewards are the ones the step's metrics averaged
        samples = s.scalars(select(JobSample).where(JobSample.job_id == job.id)
                            .order_by(JobSample.step, JobSample.kind, JobSample.index)).all()
        by = {}
        for x in samples:
            by.setdefault((x.step, x.kind), []).append(x)
        assert sorted(by) == [(0, "eval"), (1, "train"), (2, "eval"), (2, "train"), (3, "eval"), (3, "train")]
        for (step, kind), xs in by.items():
            assert [x.index for x in xs] == list(range(4 if kind == "train" else 2))
            key = "reward_mean" if kind == "train" else "eval/reward_mean"
            assert sum(x.reward for x in xs) / len(xs) == pytest.approx(evals[step][key], abs=1e-9)
            assert all(x.prompt.endswith("assistant\n") and x.finish_reason in ("stop", "length") for x in xs)
            assert all(x.tokens > 0 and x.scores == {"task": x.reward} for x in xs)


def test_a_job_cancelled_as_it_succeeds_leaves_neither_adapter_nor_results_file(ctx, sessions, monkeypatch):
    """The cancel lands between packing the adapter and recording success: the job ends cancelled,
    and the adapter archive and results file written for it are removed, with no rows."""
    import worker.runner as runner

    packed_real = runner.pack_adapter

    def pack_then_cancel(*args, **kw):  # type: ignore[no-untyped-def]
        packed = packed_real(*args, **kw)
        with sessions() as s:  # the API's cancel
            queue.cancel(s, s.get(Job, job.id))
            s.commit()
        return packed

    monkeypatch.setattr(runner, "pack_adapter", pack_then_cancel)
    with sessions() as s:
        job = make_job(s, tiny_spec("tiny", steps=1))
    assert run_job(ctx, job.id) == "cancelled"
    art = Path(ctx.settings.artifact_dir)
    with sessions() as s:
        got = s.get(Job, job.id)
        assert (got.status, got.adapter_id, got.result_file_id) == ("cancelled", None, None)
        assert s.scalars(select(File).where(File.purpose == "fine-tune-results", File.created_at >= got.created_at)
                         ).all() == []
    assert list((art / "adapters").iterdir()) == [] and list((art / "files").iterdir()) == []


def test_a_job_graded_by_a_judge_model_trains_and_pauses_while_the_judge_is_down(ctx, sessions, monkeypatch):
    """A judge that stops answering mid-step pauses the job at its last step boundary (a checkpoint);
    resumed once the judge is back, it finishes with every step graded by the judge."""
    from engine.rewards import model_grader
    from tests._judge import KEY, start_judge

    judge, server = start_judge()
    monkeypatch.setenv("QERL_GRADER_BASE_URL", judge.url)
    monkeypatch.setenv("QERL_GRADER_API_KEY", KEY)
    monkeypatch.setattr(model_grader, "BACKOFF_S", (0.01, 0.02, 0.04))
    grader = {"type": "label_model", "name": "verdict", "model": "judge-7b", "labels": ["correct", "incorrect"],
              "passing_labels": ["correct"], "input": [
                  {"role": "user", "content": "reference: {{item.answer}}\nsample: {{sample.output_text}}"}]}
    judge.delay_s = 0.05
    try:
        with sessions() as s:
            job = make_job(s, tiny_spec("tiny", steps=2, grader=grader))
        assert run_job(ctx, job.id) == "succeeded"
        assert len(judge.requests) == 2 * 2 * 2  # steps x prompts x samples, each graded by the judge
        with sessions() as s:
            rewards = [m.values["reward/verdict"] for m in _metrics(s, job.id)]
            assert all(m.values["grade_s"] >= judge.delay_s for m in _metrics(s, job.id))  # the judge's time
            used = [sum(len(x["content"].split()) for x in r["body"]["messages"]) + 5 for r in judge.requests]
            assert [m.values["judge_tokens"] for m in _metrics(s, job.id)] == [sum(used[:4]), sum(used[4:])]
        expected = [sum(judge.verdict(r["body"])[0] == "correct" for r in judge.requests[k:k + 4]) / 4 for k in (0, 4)]
        assert rewards == expected

        judge.requests.clear()
        judge.down_after = 4  # answers step 1's four samples, then 503 (retried, then given up)
        with sessions() as s:
            held = make_job(s, tiny_spec("tiny", steps=3, grader=grader))
        assert run_job(ctx, held.id) == "paused"
        with sessions() as s:
            got = s.get(Job, held.id)
            assert (got.status, got.step, got.error_code) == ("paused", 1, None)
            warn = [e for e in events(s, held.id) if e.level == "warn"][-1].message
            assert "HTTP 503" in warn and judge.url in warn and "resume from checkpoint step 1" in warn, warn
            assert [m.step for m in _metrics(s, held.id)] == [1]
            ckpts = s.scalars(select(Checkpoint).where(Checkpoint.job_id == held.id)).all()
            assert [c.step for c in ckpts] == [1] and got.resume_checkpoint_id == ckpts[0].id  # not saved twice
        judge.down_after = None
        with sessions() as s:
            queue.resume(s, s.get(Job, held.id))
            s.commit()
        assert run_job(ctx, held.id) == "succeeded"
        with sessions() as s:
            got = s.get(Job, held.id)
            assert (got.status, got.step, got.attempt) == ("succeeded", 3, 2)
            assert [m.step for m in _metrics(s, held.id)] == [1, 2, 3]
    finally:
        server.shutdown()


def test_a_job_training_a_model_further_fails_clearly_when_its_start_is_gone_or_corrupt(ctx, sessions):
    with sessions() as s:
        parent_job = make_job(s, tiny_spec("tiny", steps=1))
    assert run_job(ctx, parent_job.id) == "succeeded"
    art = Path(ctx.settings.artifact_dir)
    with sessions() as s:
        parent = s.get(Adapter, s.get(Job, parent_job.id).adapter_id)
        name, rel = parent.name, parent.path
        child = make_job(s, tiny_spec("tiny", steps=1, init_adapter=rel), model=name)
    archive = art / rel
    good = archive.read_bytes()
    archive.write_bytes(good[:-10] + bytes(10))  # flipped bytes: the sha256 no longer matches
    assert run_job(ctx, child.id) == "failed"
    with sessions() as s:
        got = s.get(Job, child.id)
        assert got.error_code == "model_not_found" and name in got.error_message, got.error_message
        assert "sha256" in got.error_message
        archive.write_bytes(good)  # intact again: a new job from it succeeds and its start is the parent
        again = make_job(s, tiny_spec("tiny", steps=1, init_adapter=rel), model=name)
    assert run_job(ctx, again.id) == "succeeded"
    with sessions() as s:
        assert any(e.message.startswith("Starting from the LoRA in init-adapter/") for e in events(s, again.id))
        assert s.get(Adapter, s.get(Job, again.id).adapter_id).base_model == "tiny"


def test_failures_end_with_a_code_the_user_can_act_on(ctx, sessions):
    art = Path(ctx.settings.artifact_dir)
    with sessions() as s:
        bad_spec = make_job(s, {**tiny_spec("tiny"), "steps": 0})
        unknown = make_job(s, tiny_spec("no-such-model"))
        f = File(project="proj-test", filename="t.jsonl", purpose="fine-tune", bytes=1, sha256="0" * 64,
                 path="files/gone.jsonl")
        s.add(f)
        s.commit()
        spec = tiny_spec("tiny")
        spec["data"] = {"train_file": f.id, "eval_size": 0}
        gone = make_job(s, spec, training_file=f.id)
    assert not (art / "files/gone.jsonl").exists()
    for job, code, text in ((bad_spec, "invalid_spec", "steps must be in"),
                            (unknown, "unknown_model", "no-such-model"),
                            (gone, "invalid_file", f"training_file {f.id} is no longer available")):
        assert run_job(ctx, job.id) == "failed"
        with sessions() as s:
            got = s.get(Job, job.id)
            assert got.error_code == code and text in got.error_message, got.error_message
            assert "Traceback" not in got.error_message


def test_cancel_stops_a_running_job_within_a_step(ctx, sessions):
    with sessions() as s:
        job = make_job(s, tiny_spec("tiny", steps=500, checkpoint_interval=0))
    t, out = _run_in_thread(ctx, job.id)
    seen = _wait_step(sessions, job.id, 2)
    with sessions() as s:
        queue.cancel(s, s.get(Job, job.id))
        s.commit()
    t0 = time.monotonic()
    t.join(60)
    assert out == ["cancelled"] and time.monotonic() - t0 < 10
    with sessions() as s:
        got = s.get(Job, job.id)
        assert got.status == "cancelled" and got.adapter_id is None
        assert max(m.step for m in _metrics(s, job.id)) <= seen + 2  # the step in flight, at most one more


def test_shutdown_requeues_and_the_next_run_resumes(ctx, sessions):
    with sessions() as s:
        job = make_job(s, tiny_spec("tiny", steps=8, checkpoint_interval=2))
    t, out = _run_in_thread(ctx, job.id)
    _wait_step(sessions, job.id, 3)
    ctx.shutdown.set()
    t.join(60)
    assert out == ["requeued"]
    with sessions() as s:
        got = s.get(Job, job.id)
        stopped_at = max(m.step for m in _metrics(s, job.id))
        assert got.status == "queued" and got.attempt == 1 and got.max_attempts == 4
        ckpt = s.get(Checkpoint, got.resume_checkpoint_id)
        assert ckpt.step == stopped_at == got.step  # the engine saved the step boundary it stopped at
    ctx.shutdown.clear()
    assert run_job(ctx, job.id) == "succeeded"
    with sessions() as s:
        got = s.get(Job, job.id)
        second = [m.step for m in _metrics(s, job.id) if m.attempt == 2]
        assert got.attempt == 2 and second == list(range(stopped_at + 1, 9))
        msgs = [e.message for e in events(s, job.id)]
        assert f"Resuming from checkpoint step {stopped_at} (attempt 2)" in msgs
        assert any(m.startswith("Worker shutting down; job requeued") for m in msgs)


def test_pause_stops_at_a_checkpoint_and_resume_continues_from_it(ctx, sessions, dispatched):
    with sessions() as s:
        job = make_job(s, tiny_spec("tiny", steps=8, checkpoint_interval=0))  # no periodic checkpoints
    t, out = _run_in_thread(ctx, job.id)
    _wait_step(sessions, job.id, 2)
    with sessions() as s:
        queue.pause(s, s.get(Job, job.id))
        s.commit()
    t0 = time.monotonic()
    t.join(60)
    assert out == ["paused"] and time.monotonic() - t0 < 10
    with sessions() as s:
        got = s.get(Job, job.id)
        stopped_at = max(m.step for m in _metrics(s, job.id))
        ckpt = s.get(Checkpoint, got.resume_checkpoint_id)
        assert (got.status, got.attempt, got.max_attempts, got.adapter_id) == ("paused", 1, 4, None)
        assert ckpt.step == stopped_at == got.step < 8  # the engine saved the step it stopped at
    assert job.id not in dispatched and run_job(ctx, job.id) == "skipped"  # nobody runs a paused job
    with sessions() as s:
        queue.resume(s, s.get(Job, job.id))
        s.commit()
    assert run_job(ctx, job.id) == "succeeded"
    with sessions() as s:
        got = s.get(Job, job.id)
        second = [m.step for m in _metrics(s, job.id) if m.attempt == 2]
        assert got.attempt == 2 and second == list(range(stopped_at + 1, 9)) and got.adapter_id is not None
        msgs = [e.message for e in events(s, job.id)]
        assert msgs.index("Pause requested; the job saves a checkpoint after the current step") < msgs.index(
            f"The job was paused; it will resume from checkpoint step {stopped_at} when resumed") < msgs.index(
            f"Resuming from checkpoint step {stopped_at} (attempt 2)")


def test_a_reaped_run_writes_nothing_more(ctx, sessions):
    with sessions() as s:
        job = make_job(s, tiny_spec("tiny", steps=500, checkpoint_interval=0))
    t, out = _run_in_thread(ctx, job.id)
    _wait_step(sessions, job.id, 1)
    with sessions() as s:  # as if this worker had stalled past its lease: reaped, then re-claimed
        # expired and reaped in one transaction: the row lock keeps the running worker's heartbeat from
        # renewing the lease in between (a stalled worker would not have renewed it)
        s.execute(update(Job).where(Job.id == job.id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        assert queue.reap(s) == [job.id]
        assert queue.claim(s, job.id, "other-worker", lease_seconds=600).attempt == 2
        reaped_at = max(e.id for e in events(s, job.id))
    t.join(60)
    assert out == ["lease_lost"]
    with sessions() as s:
        got = s.get(Job, job.id)
        assert (got.status, got.attempt, got.lease_owner) == ("running", 2, "other-worker")
        assert [e.message for e in events(s, job.id) if e.id > reaped_at and e.attempt == 1] == []
        queue.finish(s, job.id, 2, "cancelled")
    wait_for_status(sessions, job.id, "cancelled", timeout=1)


def test_a_kept_checkpoint_lora_is_archived_with_its_row_or_not_at_all(ctx, sessions, tmp_path):
    """keep_checkpoint_adapters: the reporter archives the step's LoRA, then records it with the row;
    a fenced-out attempt (reaped and re-claimed) records nothing and leaves no archive behind."""
    from worker.reporter import DBReporter

    with sessions() as s:
        job = make_job(s, tiny_spec("tiny"))
        queue.claim(s, job.id, "test-worker", lease_seconds=600)
    artifacts = ctx.settings.artifact_dir
    reporter = DBReporter(sessions, job.id, 1, store=ArtifactStore(artifacts), total_steps=3, retry=lambda fn, what: fn(),
                          keep_checkpoint_adapters=True)
    ckpt = artifacts / "jobs" / job.id / "checkpoints" / "step-000001"
    (ckpt / "adapter").mkdir(parents=True)
    for name in ("adapter_config.json", "qerl_manifest.json"):
        (ckpt / "adapter" / name).write_text('{"step": 1}')
    reporter.checkpoint(1, ckpt, {"reward_mean": 0.5})
    with sessions() as s:
        row = s.execute(select(Checkpoint).where(Checkpoint.job_id == job.id)).scalar_one()
        assert row.adapter_path == f"checkpoints/{job.id}/{row.id}.tar.gz" and row.metrics == {"reward_mean": 0.5}
        archive = artifacts / row.adapter_path
        assert hashlib.sha256(archive.read_bytes()).hexdigest() == row.adapter_sha256
        assert archive.stat().st_size == row.adapter_bytes
        with tarfile.open(archive) as tar:
            assert sorted(tar.getnames()) == ["adapter_config.json", "qerl_manifest.json"]
        s.execute(update(Job).where(Job.id == job.id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        assert queue.reap(s) == [job.id]
        assert queue.claim(s, job.id, "other-worker", lease_seconds=600).attempt == 2
    with pytest.raises(queue.LeaseLost):
        reporter.checkpoint(2, ckpt, {})
    assert [p.name for p in (artifacts / "checkpoints" / job.id).iterdir()] == [archive.name]
    with sessions() as s:
        assert len(s.execute(select(Checkpoint).where(Checkpoint.job_id == job.id)).scalars().all()) == 1
        queue.finish(s, job.id, 2, "cancelled")


def test_a_checkpoint_the_dead_worker_never_reported_is_still_used(ctx, sessions):
    with sessions() as s:
        job = make_job(s, tiny_spec("tiny", steps=6, checkpoint_interval=2))
    t, out = _run_in_thread(ctx, job.id)
    _wait_step(sessions, job.id, 2)
    ctx.shutdown.set()
    t.join(60)
    assert out == ["requeued"]
    with sessions() as s:  # as if the process died between writing the checkpoint and its row
        on_disk = s.get(Job, job.id).step
        s.execute(update(Job).where(Job.id == job.id).values(resume_checkpoint_id=None, step=0))
        s.execute(Checkpoint.__table__.delete().where(Checkpoint.job_id == job.id))
        s.commit()
    ctx.shutdown.clear()
    assert run_job(ctx, job.id) == "succeeded"
    with sessions() as s:
        assert [m.step for m in _metrics(s, job.id) if m.attempt == 2] == list(range(on_disk + 1, 7))
        assert f"Resumed from checkpoint step {on_disk}" in [e.message for e in events(s, job.id)]


def test_memory_and_disk_errors_get_their_own_codes(tmp_path):
    """What torch, CUDA, Python and the filesystem raise, as the runner classifies it (no GPU here: the
    CUDA error is constructed; the real host-memory and disk-full failures run in test_faults_services)."""
    import errno

    import torch

    from worker.runner import _classify

    art = tmp_path / "artifacts"
    oom = [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.19 GiB total)"),
           MemoryError(),
           RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you "
                        "tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")]
    for exc in oom:
        code, message = _classify(exc, "ftjob-x", art)
        assert code == "out_of_memory" and "micro_batch_size" in message, (exc, message)
    full = OSError(errno.ENOSPC, "No space left on device", str(art / "adapters" / "a.tar.gz"))
    code, message = _classify(full, "ftjob-x", art)
    assert code == "disk_full" and str(art / "adapters" / "a.tar.gz") in message and str(art) in message
    try:  # torch.save reports a full disk as a RuntimeError chained to the OSError
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed") from inner
    except RuntimeError as exc:
        assert _classify(exc, "ftjob-x", art)[0] == "disk_full"
    assert _classify(ValueError("something else"), "ftjob-x", art)[0] == "internal_error"


def test_the_engine_maps_a_gpu_out_of_memory_error_to_out_of_memory(tiny_model_dir, tmp_path):
    """engine.train turns torch.cuda.OutOfMemoryError raised mid-run into TrainError("out_of_memory")
    (a reporter that raises it stands in for the GPU this machine lacks)."""
    import torch

    import engine
    from engine.spec import TrainSpec
    from engine.types import TrainError

    class ExhaustedGPU:
        def event(self, level, message, data=None):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        def metrics(self, step, values):
            raise AssertionError("unreachable")

        def checkpoint(self, step, path, metrics=None):
            raise AssertionError("unreachable")

    spec = TrainSpec.from_dict(tiny_spec(str(tiny_model_dir), steps=1))
    with pytest.raises(TrainError) as err:
        engine.train(spec, workdir=tmp_path / "job", reporter=ExhaustedGPU(), should_stop=lambda: False,
                     resume_from=None)
    assert err.value.code == "out_of_memory" and "micro_batch_size" in str(err.value)


def test_database_writes_retry_with_backoff_while_the_lease_lasts_then_give_up():
    """LeaseKeeper.retry against a database that refuses connections (a closed port): back-off
    0.25, 0.5, 1 s, then it stops before the 2 s lease (counted from the claim) would run out and
    counts the lease as lost (LeaseLost, so the runner records no outcome a database back before
    the reaper's pass would accept); once the lease is known lost it does not retry at all."""
    import socket

    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from service.db import make_engine, make_sessionmaker
    from worker.lease import LeaseKeeper

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/none")
    down = make_sessionmaker(engine)
    keeper = LeaseKeeper(down, "ftjob-x", 1, "test-worker", lease_seconds=2.0, interval_seconds=0.5)  # not started
    tries: list[float] = []

    def write() -> None:
        tries.append(time.monotonic())
        with down() as s:
            s.execute(text("SELECT 1"))

    with pytest.raises(queue.LeaseLost) as gave_up:
        keeper.retry(write, "a test write")
    assert isinstance(gave_up.value.__cause__, OperationalError) and keeper.lost.is_set()
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) == 4 and [round(g * 4) / 4 for g in gaps] == [0.25, 0.5, 1.0], gaps
    assert tries[-1] - keeper.renewed_at < 2.0
    tries.clear()
    with pytest.raises(queue.LeaseLost):
        keeper.retry(write, "a test write")
    assert len(tries) == 1
    engine.dispose()


def test_reported_samples_are_stored_even_with_a_nul_and_replace_a_rerun_of_the_step(ctx, sessions):
    from worker.reporter import DBReporter

    with sessions() as s:
        job = make_job(s, tiny_spec("tiny"))
        attempt = queue.claim(s, job.id, "test-worker", lease_seconds=60).attempt
    rep = DBReporter(sessions, job.id, attempt, store=ArtifactStore(ctx.settings.artifact_dir), total_steps=3,
                     retry=lambda write, what: write())
    row = {"index": 0, "prompt": "say\x00it", "completion": "a\x00b", "reward": 0.5, "scores": {"task": 0.5},
           "finish_reason": "stop", "tokens": 3}
    rep.samples(1, "train", [row, row | {"index": 1}])
    rep.samples(1, "train", [row | {"completion": "again"}])  # the same attempt re-reports the step: replaced
    with sessions() as s:
        got = s.scalars(select(JobSample).where(JobSample.job_id == job.id)).all()
        assert [(x.index, x.prompt, x.completion) for x in got] == [(0, "say\ufffdit", "again")]
        queue.finish(s, job.id, attempt, "cancelled")
