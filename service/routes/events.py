"""A job's events (JSON list, newest first, or a live SSE stream), metrics, reported samples and
checkpoints (each downloadable as a PEFT adapter while it is kept on disk, or for good with
keep_checkpoint_adapters).

JSON: OpenAI's shape; ``after`` is the id of the last (oldest) event of the previous page, so the
SDK's auto-pagination walks back in time. SSE (``Accept: text/event-stream``): oldest first from
``Last-Event-ID`` (exclusive), then new events as they are written, until the job is terminal.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask
from sqlalchemy.orm import Session

from service import crud
from service.auth import CurrentKey
from service.deps import ReadSessionDep, ReleasingRoute, SessionDep, SettingsDep, StoreDep, json_response
from service.errors import APIError, not_found
from service.models import Checkpoint, Job
from service.schemas import (CheckpointDeleted, FineTuningJobCheckpoint, FineTuningJobEvent, JobSampleView, ListPage,
                             StepMetrics)
from service.storage import verified_artifact
from service.views import TERMINAL, checkpoint_view, event_view, parse_event_id, unix

router = APIRouter(prefix="/fine_tuning/jobs/{job_id}", tags=["fine-tuning"], route_class=ReleasingRoute)


def _job(session: Session, project: str, job_id: str) -> Job:
    job = crud.get_job(session, project, job_id)
    if job is None:
        raise not_found("fine-tuning job", job_id, "fine_tuning_job_id")
    return job


@router.get("/events", response_model=ListPage[FineTuningJobEvent],
            responses={200: {"content": {"text/event-stream": {}}}})
async def list_events(job_id: str, request: Request, key: CurrentKey,  # type: ignore[no-untyped-def]
                      settings: SettingsDep, after: str | None = None,
                      limit: int = Query(20, ge=1, le=crud.MAX_LIMIT)):
    """Polled like the job itself: reads on the event loop (service.reads)."""
    return await events_response(request, key.project, job_id, settings, after, limit)


async def events_response(request: Request, project: str, job_id: str, settings: Any, after: str | None, limit: int,
                          kind: str = "fine_tune") -> Response:
    """A job's events (an evaluation's with ``kind="eval"``): a page, or the stream (``Accept:
    text/event-stream``) until it ends."""
    reads = request.app.state.reads
    if await reads.job(project, job_id, kind) is None:
        raise (not_found("evaluation", job_id, "evaluation_id") if kind == "eval"
               else not_found("fine-tuning job", job_id, "fine_tuning_job_id"))
    if "text/event-stream" in request.headers.get("accept", ""):
        start = parse_event_id(request.headers.get("last-event-id")) or 0
        stream = _stream(request, reads, job_id, start, settings.sse_poll_seconds, settings.sse_keepalive_seconds)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    rows, more = await reads.events_desc(job_id, before=parse_event_id(after), limit=limit)
    data = [event_view(e) for e in rows]
    return json_response(ListPage.of(data, more))


async def _stream(request: Request, reads: Any, job_id: str, after: int, poll_s: float,
                  keepalive_s: float) -> AsyncIterator[str]:
    yield f"retry: {int(poll_s * 2000)}\n\n"
    idle = 0.0
    while True:
        status, events = await reads.status_and_events_since(job_id, after)
        for e in events:
            view = event_view(e)
            yield f"id: {view.id}\nevent: {e.type}\ndata: {view.model_dump_json()}\n\n"
            after = e.id
        if events:
            idle = 0.0
            continue
        if status in TERMINAL:  # only when nothing new was left to send
            yield f"event: done\ndata: {json.dumps({'status': status})}\n\n"
            return
        if await request.is_disconnected():
            return
        await anyio.sleep(poll_s)
        idle += poll_s
        if idle >= keepalive_s:
            idle = 0.0
            yield ": keep-alive\n\n"


@router.get("/metrics", response_model=ListPage[StepMetrics])
def job_metrics(job_id: str, key: CurrentKey, session: ReadSessionDep, after_step: int | None = None,
                limit: int = Query(1000, ge=1, le=crud.MAX_LIMIT)) -> ListPage[StepMetrics]:
    _job(session, key.project, job_id)
    rows, more = crud.latest_metrics(session, job_id, after_step=after_step, limit=limit)
    data = [StepMetrics(step=r.step, attempt=r.attempt, created_at=unix(r.created_at) or 0, values=r.values)
            for r in rows]
    return ListPage.of(data, more, key=lambda m: str(m.step))


@router.get("/samples", response_model=ListPage[JobSampleView])
def job_samples(job_id: str, key: CurrentKey, session: ReadSessionDep, step: int | None = None,
                kind: Literal["train", "eval"] | None = None, after_step: int | None = None,
                order: Literal["asc", "desc"] = "desc",
                limit: int = Query(1, ge=1, le=100, description="steps per page")) -> ListPage[JobSampleView]:
    """The samples the job reported (qerl.log_samples per step and per evaluation): by default the
    newest step's; ``step=N`` that step's; ``limit`` steps a page, ``after_step`` the cursor."""
    _job(session, key.project, job_id)
    rows, more = crud.job_samples(session, job_id, step=step, kind=kind, after_step=after_step, limit=limit,
                                  newest_first=order == "desc")
    data = [JobSampleView(step=r.step, kind=r.kind, index=r.index, attempt=r.attempt,  # type: ignore[arg-type]
                          prompt=r.prompt, completion=r.completion, reward=r.reward, scores=r.scores, finish_reason=r.finish_reason,
                          tokens=r.tokens, created_at=unix(r.created_at) or 0) for r in rows]
    return ListPage.of(data, more, key=lambda x: str(x.step))


@router.get("/checkpoints", response_model=ListPage[FineTuningJobCheckpoint])
def list_checkpoints(job_id: str, key: CurrentKey, session: ReadSessionDep, after: str | None = None,
                     limit: int = Query(10, ge=1, le=crud.MAX_LIMIT)) -> ListPage[FineTuningJobCheckpoint]:
    job = _job(session, key.project, job_id)
    rows, more = crud.list_checkpoints(session, job_id, after=after, limit=limit)
    data = [checkpoint_view(c, job) for c in rows]
    return ListPage.of(data, more)


@router.get("/checkpoints/{checkpoint_id}/content", response_class=FileResponse,
            responses={200: {"content": {"application/gzip": {}}}})
def checkpoint_content(job_id: str, checkpoint_id: str, key: CurrentKey, session: ReadSessionDep,
                       store: StoreDep) -> FileResponse:
    """The LoRA at that checkpoint's step as a PEFT adapter (tar.gz, like GET /v1/adapters/{id}/content):
    from the artifact store where the job keeps its checkpoints' adapters (qerl.keep_checkpoint_adapters),
    else while the checkpoint is on disk (or in the artifact bucket): the newest 2 while the job runs or is
    paused, all of them for QERL_JOB_FILES_RETENTION_SECONDS after it ends. The same step's archive has the
    same bytes either way."""
    job = _job(session, key.project, job_id)
    c = _checkpoint(session, job, checkpoint_id)
    name = f"{job.id}-ckpt-step-{c.step}.tar.gz"
    if c.adapter_path and c.adapter_sha256:
        path = verified_artifact(store, c.adapter_path, c.adapter_sha256,
                                 f"the LoRA archive of checkpoint {checkpoint_id}")
        return FileResponse(path, media_type="application/gzip", filename=name,
                            headers={"X-Checksum-Sha256": c.adapter_sha256, "ETag": f'"{c.adapter_sha256}"'})
    gone = APIError(404, f"Checkpoint {checkpoint_id} (step {c.step}) is no longer on disk: a job keeps its newest 2 "
                         "checkpoints while it runs, and those for QERL_JOB_FILES_RETENTION_SECONDS after it ends; "
                         "create jobs with qerl.keep_checkpoint_adapters=true to keep every checkpoint's LoRA. "
                         "The job's final adapter stays (GET /v1/adapters).", code="checkpoint_not_kept",
                    param="checkpoint_id")
    try:
        with store.checkpoint_dir(c.path) as ckpt:
            src = ckpt / "adapter"
            if not (src / "adapter_config.json").is_file():
                raise gone
            staged = store.pack(src)
    except (ValueError, FileNotFoundError):  # recorded outside the store; gone, or pruned while being packed
        raise gone from None
    return FileResponse(staged.tmp, media_type="application/gzip", filename=name,
                        headers={"X-Checksum-Sha256": staged.sha256, "ETag": f'"{staged.sha256}"'},
                        background=BackgroundTask(staged.discard))


@router.delete("/checkpoints/{checkpoint_id}", response_model=CheckpointDeleted)
def delete_checkpoint(job_id: str, checkpoint_id: str, key: CurrentKey, session: SessionDep,
                      store: StoreDep) -> CheckpointDeleted:
    """The checkpoint leaves the list and its kept LoRA archive goes (row first, then the file).
    The engine's own checkpoint files, which a paused or interrupted job resumes from, stay."""
    job = _job(session, key.project, job_id)
    c = _checkpoint(session, job, checkpoint_id, for_update=True)
    path = c.adapter_path
    users = crud.active_jobs_starting_from(session, job.project, {path} if path else set())
    if users:
        raise APIError(409, f"Checkpoint {checkpoint_id}'s LoRA is being trained further by job(s) {', '.join(users)} "
                            "that have not finished; cancel them or wait until they end, then delete it.",
                       code="checkpoint_in_use", param="checkpoint_id")
    crud.delete_checkpoint(session, job, c)
    session.commit()
    if path:
        store.delete(path)
    return CheckpointDeleted(id=checkpoint_id)


def _checkpoint(session: Session, job: Job, checkpoint_id: str, *, for_update: bool = False) -> Checkpoint:
    c = session.get(Checkpoint, checkpoint_id, with_for_update=for_update)
    if c is None or c.job_id != job.id:
        raise not_found("checkpoint", checkpoint_id, "checkpoint_id")
    return c
