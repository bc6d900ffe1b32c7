"""Runs one claimed job: the code shared by the Celery task and the embedded worker thread.

claim -> resolve the spec's files and the resume point -> ``engine.train`` with a DB reporter,
a lease-keeping side thread and ``should_stop`` = cancel | pause | lease lost | shutdown -> an
outcome: succeeded (adapter tar.gz + Adapter row), failed (a code the user can act on),
cancelled, paused (resumed later from the checkpoint the engine saved on stopping: on a pause, or
when a judge model stopped answering) or requeued
(shutdown: another worker resumes from that checkpoint).
Every write is fenced by the attempt, so a worker that lost its lease changes nothing.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

import engine
from engine.spec import TrainSpec
from engine.types import OOM_ADVICE, GraderUnavailable, TrainError, is_disk_full, is_out_of_memory
from service import crud, queue
from service.models import Adapter, Checkpoint, File, Job, new_id
from service.results import EVAL_ROWS_FILENAME, RESULTS_FILENAME, RESULTS_PURPOSE, step_metrics_csv
from service.storage import ArtifactStore, Corrupt, StoreUnavailable
from service.views import base_model_of, fine_tuned_model_name
from worker.artifacts import job_workdir, pack_adapter, pull_workdir, worker_store
from worker.lease import LeaseKeeper
from worker.reporter import DBReporter

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    settings: Any  # service.settings.Settings: artifact_dir, lease_seconds, heartbeat_seconds
    sessions: Callable[[], Session]
    worker_id: str
    shutdown: threading.Event
    parent_pid: int | None = None  # Celery child: stop if this parent dies


def run_next(ctx: WorkerContext) -> str | None:
    """Claim the queued job whose turn it is (service.queue.fair_order) and run it; None if the
    queue is empty."""
    with ctx.sessions() as s:
        job = queue.claim_next(s, ctx.worker_id, lease_seconds=ctx.settings.lease_seconds)
    return None if job is None else execute(ctx, job)


def execute(ctx: WorkerContext, job: Job) -> str:
    """Run a job this worker has just claimed (``job`` as claim() returned it)."""
    store = worker_store(ctx.settings)
    keeper = LeaseKeeper(ctx.sessions, job.id, job.attempt, ctx.worker_id, lease_seconds=ctx.settings.lease_seconds,
                         interval_seconds=ctx.settings.heartbeat_seconds, parent_pid=ctx.parent_pid)
    keeper.start()

    def should_stop() -> bool:
        return (keeper.cancelled.is_set() or keeper.pausing.is_set() or keeper.lost.is_set()
                or keeper.orphaned.is_set() or ctx.shutdown.is_set())

    log.info("job %s attempt %d: running on %s", job.id, job.attempt, ctx.worker_id)
    try:
        try:
            succeed = (_evaluate if job.kind == "eval" else _train)(ctx, keeper, job, store, should_stop)
        except queue.LeaseLost:
            return _lease_lost(job)
        except GraderUnavailable as exc:  # the engine saved a checkpoint: paused until the judge is back
            if keeper.lost.is_set():
                return _lease_lost(job)
            return _requeue(ctx, keeper, job, str(exc), pause=True)
        except Exception as exc:  # noqa: BLE001 - every failure ends the job with a code
            if keeper.lost.is_set():
                return _lease_lost(job)
            code, message = _classify(exc, job.id, store.root)
            return _end(ctx, keeper, job, "failed", error_code=code, error_message=message)
        if keeper.lost.is_set():
            return _lease_lost(job)
        if keeper.cancelled.is_set():
            return _end(ctx, keeper, job, "cancelled")
        if succeed is None:  # stopped: paused if a pause was asked for, else handed back to the queue
            reason = ("Worker process lost its parent" if keeper.orphaned.is_set() and not ctx.shutdown.is_set()
                      else "Worker shutting down")
            return _requeue(ctx, keeper, job, reason)
        return succeed()
    finally:
        keeper.stop()


def _train(ctx: WorkerContext, keeper: LeaseKeeper, job: Job, store: ArtifactStore,
           should_stop: Callable[[], bool]) -> Callable[[], str] | None:
    """A training job's run (engine.train); what records its success, or None when it stopped."""
    spec, resume_from = keeper.retry(lambda: _prepare(ctx, job, store), "reading the job's files")
    reporter = DBReporter(ctx.sessions, job.id, job.attempt, store=store, total_steps=spec.steps,
                          retry=keeper.retry, on_status=keeper.saw,
                          keep_checkpoint_adapters=spec.keep_checkpoint_adapters)
    result = engine.train(spec, workdir=job_workdir(store.root, job.id), reporter=reporter,
                          should_stop=should_stop, resume_from=resume_from)
    return None if result.stopped else lambda: _succeed(ctx, keeper, job, Path(result.adapter_dir), store)


def _prepare(ctx: WorkerContext, job: Job, store: ArtifactStore) -> tuple[TrainSpec, Path | None]:
    """The spec with worker-local file paths, and where to resume from (None: from step 0). With an
    artifact bucket, the files, the parent LoRA and the job's checkpoints come from it when this host
    lacks them."""
    try:
        spec = TrainSpec.from_dict(job.spec)
    except ValueError as exc:
        raise TrainError("invalid_spec", f"the stored job spec is invalid: {exc}") from None
    with ctx.sessions() as s:
        for attr, param in (("train_file", "training_file"), ("validation_file", "validation_file")):
            ref = getattr(job, param) or getattr(spec.data, attr)
            if ref and str(ref).startswith("file-"):
                setattr(spec.data, attr, str(_file_path(s, ref, param, store)))
        if spec.init_adapter is not None:
            spec.init_adapter = str(_unpack_parent(s, job, spec.init_adapter, store))
        resume_from = None
        if job.attempt > 1:  # ran before, maybe on another host
            pull_workdir(store, job.id)
        if job.resume_checkpoint_id:
            ckpt = s.get(Checkpoint, job.resume_checkpoint_id)
            path = store.root / ckpt.path if ckpt is not None else None  # absolute paths stay absolute
            if path is not None and not path.is_dir() and not Path(ckpt.path).is_absolute():
                try:
                    path = store.local_dir(ckpt.path)
                except FileNotFoundError:
                    pass
            if path is not None and path.is_dir():
                resume_from = path
            else:
                log.warning("job %s: checkpoint %s is gone from the artifact store", job.id, job.resume_checkpoint_id)
    if resume_from is None and job.attempt > 1:  # died before reporting its newest checkpoint
        from engine.checkpoint import latest_checkpoint  # torch: only once a job runs

        resume_from = latest_checkpoint(job_workdir(store.root, job.id) / "checkpoints")
    return spec, resume_from


def _unpack_parent(s: Session, job: Job, rel: str, store: ArtifactStore) -> Path:
    """The LoRA the job trains further (a fine-tuned model's or a kept checkpoint's; an evaluation's
    adapter), sha256-checked and unpacked into the job's workdir (``init-adapter/``), afresh on every
    attempt."""
    sha256 = (s.scalar(select(Adapter.sha256).where(Adapter.path == rel))
              or s.scalar(select(Checkpoint.adapter_sha256).where(Checkpoint.adapter_path == rel).limit(1)))
    try:
        if sha256 is None:
            raise FileNotFoundError(rel)
        archive = store.verified(rel, sha256)
    except (FileNotFoundError, Corrupt) as exc:
        does = "this evaluation scores" if job.kind == "eval" else "this job trains further"
        raise TrainError("model_not_found", f"the fine-tuned model {job.model} that {does} is no longer available "
                                            f"({exc}); create it again with another model") from None
    dest = job_workdir(store.root, job.id) / "init-adapter"
    tmp = dest.with_name(f".tmp-init-adapter-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")  # our own archive; "data" refuses links and paths outside tmp
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _evaluate(ctx: WorkerContext, keeper: LeaseKeeper, job: Job, store: ArtifactStore,
              should_stop: Callable[[], bool]) -> Callable[[], str] | None:
    """An evaluation's run: the adapter's archive onto this host, its test rows (the file, or a
    task's fresh questions), then engine.score.evaluate_adapter; what records its scores, or None
    when it stopped."""
    from engine.score import evaluate_adapter, read_manifest, read_test_rows, task_rows  # torch: once a job runs

    spec = job.spec or {}
    questions = spec.get("dataset")

    def prepare() -> tuple[Path | None, Path]:
        with ctx.sessions() as s:
            test = _file_path(s, job.validation_file, "file", store) if job.validation_file else None
            return test, _unpack_parent(s, job, spec["init_adapter"], store)

    test, adapter = keeper.retry(prepare, "reading the evaluation's files")
    try:
        if test is not None:
            rows, where = read_test_rows(test), f"file {job.validation_file}"
            said = f"rows of {job.validation_file}"
        else:
            rows, said = task_rows(questions["task"], questions["size"], questions.get("seed"), read_manifest(adapter))
            where = f"dataset {questions['task']}"
        rows = rows[:spec.get("limit") or None]
        reporter = DBReporter(ctx.sessions, job.id, job.attempt, store=store, total_steps=0, retry=keeper.retry,
                              on_status=keeper.saw)
        alone = " and with its base alone" if spec.get("compare_base", True) else ""
        reporter.event("info", f"Scoring {len(rows)} {said} with {job.model}{alone}")
        scored = evaluate_adapter(adapter, rows, grader=spec.get("grader"), max_new_tokens=spec.get("max_new_tokens"),
                                  compare=bool(spec.get("compare_base", True)), ref=job.model, where=where,
                                  should_stop=should_stop)
    except GraderUnavailable as exc:  # no checkpoint to pause at: the evaluation ends, to be created again
        raise TrainError("grader_unavailable", f"{exc}; create the evaluation again once it answers") from None
    except TrainError:  # the rows, or the grader's own failure: as the engine says it
        raise
    except ValueError as exc:  # a grader or adapter the engine cannot use
        raise TrainError("invalid_request", str(exc)) from None
    return None if scored is None else lambda: _succeed_eval(ctx, keeper, job, scored, store)


def _file_path(s: Session, file_id: str, param: str, store: ArtifactStore) -> Path:
    """The training (or validation) file on this host, its bytes checked against the sha256 of its upload."""
    f = s.get(File, file_id)
    try:
        if f is None or f.deleted_at is not None:
            raise FileNotFoundError(file_id)
        return store.verified(f.path, f.sha256)
    except (FileNotFoundError, IsADirectoryError):
        raise TrainError("invalid_file", f"{param} {file_id} is no longer available (deleted?); upload it again "
                                         "and create a new job") from None
    except Corrupt:
        raise TrainError("invalid_file", f"the stored bytes of {param} {file_id} no longer match the sha256 "
                                         "recorded at its upload; upload it again and create a new job") from None


def _classify(exc: BaseException, job_id: str, artifact_dir: Path) -> tuple[str, str]:
    """(error_code, message) for a failed run: the engine's own code, memory, disk, or internal."""
    if isinstance(exc, TrainError):
        return exc.code, str(exc)
    if isinstance(exc, StoreUnavailable):
        return "artifact_store_unavailable", (f"The job's files could not be read from or written to the artifact "
                                              f"store: {exc}. Check that the bucket is reachable (GET /readyz), "
                                              "then create the job again.")
    if is_out_of_memory(exc):  # host MemoryError, torch's CPU allocator, torch.cuda.OutOfMemoryError
        return "out_of_memory", OOM_ADVICE
    if is_disk_full(exc):
        where = getattr(exc, "filename", None) or artifact_dir
        return "disk_full", (f"No space left on device while writing {where}. Free space on the filesystem that "
                             f"holds ARTIFACT_DIR ({artifact_dir}): delete adapters no longer needed (DELETE "
                             "/v1/models/ft:..., or `qerl adapters delete`) and kept checkpoint LoRAs (`qerl jobs "
                             "checkpoints JOB --delete STEP`), and a lower "
                             "QERL_JOB_FILES_RETENTION_SECONDS removes finished jobs' checkpoints sooner. Then create "
                             "the job again.")
    log.exception("job %s: internal error", job_id)
    return "internal_error", (f"Internal error ({type(exc).__name__}: {str(exc)[:300]}). "
                              "Retry the job; if it fails again, report it with the job id.")


def _end(ctx: WorkerContext, keeper: LeaseKeeper, job: Job, status: str, **kw: Any) -> str:
    def write() -> str:
        with ctx.sessions() as s:
            return queue.finish(s, job.id, job.attempt, status, **kw)

    try:
        final = keeper.retry(write, f"recording the outcome ({status})")
    except queue.LeaseLost:
        return _lease_lost(job)
    log.info("job %s attempt %d: %s %s", job.id, job.attempt, final, kw.get("error_code") or "")
    return final


def _requeue(ctx: WorkerContext, keeper: LeaseKeeper, job: Job, reason: str, *, pause: bool = False) -> str:
    def write() -> str:
        with ctx.sessions() as s:
            return queue.requeue(s, job.id, job.attempt, reason, pause=pause)

    try:
        status = keeper.retry(write, "handing the job back to the queue")
    except queue.LeaseLost:
        return _lease_lost(job)
    log.info("job %s attempt %d: %s", job.id, job.attempt, status)
    return "requeued" if status == "queued" else status


def _succeed(ctx: WorkerContext, keeper: LeaseKeeper, job: Job, adapter_dir: Path, store: ArtifactStore) -> str:
    adapter_id = new_id("adapter")
    try:
        packed = pack_adapter(adapter_dir, store, f"{adapter_id}.tar.gz")
    except Exception as exc:  # noqa: BLE001
        code, message = _classify(exc, job.id, store.root)
        return _end(ctx, keeper, job, "failed", error_code=code, error_message=message)
    adapter = Adapter(id=adapter_id, project=job.project, job_id=job.id, name=fine_tuned_model_name(job),
                      base_model=base_model_of(job), path=packed.path, bytes=packed.bytes, sha256=packed.sha256,
                      manifest=packed.manifest)
    try:
        results = _results_file(ctx, keeper, job, store)
    except Exception as exc:  # noqa: BLE001
        store.delete(packed.path)
        if isinstance(exc, queue.LeaseLost):
            return _lease_lost(job)
        code, message = _classify(exc, job.id, store.root)
        return _end(ctx, keeper, job, "failed", error_code=code, error_message=message)
    final = _end(ctx, keeper, job, "succeeded", adapter=adapter, results=results)
    if final != "succeeded":  # cancelled at the last moment, or lease lost: the files are nobody's
        store.delete(packed.path)
        store.delete(results.path)
    return final


def _succeed_eval(ctx: WorkerContext, keeper: LeaseKeeper, job: Job, scored: Any, store: ArtifactStore) -> str:
    """An evaluation's scores into its row, every test row's answers and rewards into a results file."""
    data = "".join(json.dumps(r) + "\n" for r in scored.records).encode()
    try:
        results = _stored_file(job, store, data, EVAL_ROWS_FILENAME, len(scored.records))
    except Exception as exc:  # noqa: BLE001
        code, message = _classify(exc, job.id, store.root)
        return _end(ctx, keeper, job, "failed", error_code=code, error_message=message)
    outcome = {"fine_tuned": _plain(scored.fine_tuned), "base": _plain(scored.base) if scored.base is not None else None,
               "rows": scored.rows, "base_model": scored.model, "quantization": scored.quantization,
               "device": scored.device, "max_new_tokens": scored.max_new_tokens, "grader": scored.grader}
    final = _end(ctx, keeper, job, "succeeded", results=results, outcome=outcome)
    if final != "succeeded":
        store.delete(results.path)
    return final


def _plain(metrics: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("eval/"): float(v) for k, v in metrics.items()}


def _stored_file(job: Job, store: ArtifactStore, data: bytes, filename: str, rows: int) -> File:
    """``data`` in the artifact store as a results file of the job, and its File row (not yet added:
    it goes in with the job's success, so a job that does not end succeeded leaves only a file to delete)."""
    file_id = new_id("file")
    staged = store.stage([data])
    try:
        blob = staged.publish(f"files/{file_id}{Path(filename).suffix}")
    finally:
        staged.discard()  # a no-op once published
    return File(id=file_id, project=job.project, filename=filename, purpose=RESULTS_PURPOSE,
                bytes=blob.bytes, sha256=blob.sha256, path=blob.path, rows=rows, status="processed")


def _results_file(ctx: WorkerContext, keeper: LeaseKeeper, job: Job, store: ArtifactStore) -> File:
    """step_metrics.csv in the artifact store, and its File row (not yet added: it goes in with
    the job's success, so a job that does not end succeeded leaves only a file to delete)."""
    def read() -> bytes:
        with ctx.sessions() as s:
            return step_metrics_csv(crud.all_metrics(s, job.id))

    data = keeper.retry(read, "reading the metrics for the results file")
    return _stored_file(job, store, data, RESULTS_FILENAME, data.count(b"\n") - 1)


def _lease_lost(job: Job) -> str:
    log.warning("job %s attempt %d: lease lost; this worker's run is discarded", job.id, job.attempt)
    return "lease_lost"
