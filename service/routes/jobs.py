"""/v1/fine_tuning/jobs: create (Idempotency-Key honoured), list, retrieve, cancel, pause, resume."""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from sqlalchemy.orm import Session

from service import crud
from service.auth import CurrentKey
from service.deps import ReadSessionDep, ReleasingRoute, SessionDep, SettingsDep, StoreDep, json_response
from service.errors import APIError, not_found
from service.jobspec import build_spec
from service.models import File, Job, new_id
from service.storage import ArtifactStore, verified_artifact
from service.schemas import FineTuningJob, JobCreate, ListPage
from service.views import ACTIVE, TERMINAL, job_view

log = logging.getLogger(__name__)
router = APIRouter(prefix="/fine_tuning/jobs", tags=["fine-tuning"], route_class=ReleasingRoute)
STATUSES = (*ACTIVE, *TERMINAL)


def request_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def replay(job: Job, digest: str, view: Callable[[Job], Any] = job_view) -> Any:
    """The job (or evaluation) an earlier request with the same Idempotency-Key created, if the body matches."""
    if job.request_hash != digest:
        raise APIError(422, "This Idempotency-Key was already used with a different request body (job "
                            f"{job.id}). Send the same body to get that job back, or use a new key.",
                       code="idempotency_key_reused", param="Idempotency-Key")
    return view(job)


def _view(session: Session, job: Job) -> FineTuningJob:
    """The job as the API shows it, with its place in the queue while it is queued."""
    from service import queue

    return job_view(job, queue.positions_of(session, [job.id]).get(job.id) if job.status == "queued" else None)


def wake(session: Session, job_id: str) -> None:
    """Tell a worker; a failure is logged only (the job is committed and the sweeper re-sends)."""
    try:
        from service import queue

        queue.wake(job_id, session=session)
    except Exception:
        log.exception("could not send the wake-up for job %s; the sweeper will retry", job_id)


def counted(store: ArtifactStore, f: File | None) -> File | None:
    """A file uploaded before uploads counted their fields and distinct prompts (migrations 0006 and
    0007) is counted the first time a job uses it, so that the job's checks and held-out split read
    the same numbers as a new upload's; the counts stay with the file once the job is created."""
    from engine.data.jsonl import field_counts, parse_jsonl
    from engine.data.prompts import count_prompts

    if f is None or f.prompts is not None or f.purpose != "fine-tune":
        return f
    rows, _ = parse_jsonl(verified_artifact(store, f.path, f.sha256, f"file {f.id}").read_bytes())
    f.fields, f.prompts = field_counts(rows), count_prompts(rows)
    return f


@router.post("", response_model=FineTuningJob)
def create_job(body: JobCreate, key: CurrentKey, session: SessionDep, settings: SettingsDep, store: StoreDep,
               idempotency_key: Annotated[str | None, Header(max_length=255)] = None) -> FineTuningJob:
    raw = body.model_dump(mode="json", exclude_unset=True)
    digest = request_hash(raw)
    if idempotency_key is not None:
        earlier = crud.job_by_idempotency_key(session, key.project, idempotency_key)
        if earlier is not None:
            return replay(earlier, digest)
    model, spec = build_spec(body, lambda fid: counted(store, crud.get_file(session, key.project, fid, for_update=True)),
                             lambda name: crud.find_parent(session, key.project, name))
    check_active_limit(session, key.project, settings.max_active_jobs, "create another")
    job = Job(id=new_id("ftjob"), project=key.project, model=model, status="queued", request=raw, spec=spec,
              training_file=body.training_file, validation_file=body.validation_file, seed=spec["seed"],
              suffix=body.suffix, user_metadata=body.metadata, idempotency_key=idempotency_key,
              request_hash=digest, max_attempts=settings.max_attempts, total_steps=spec["steps"])
    if crud.insert_job(session, job, f"Created fine-tuning job: {job.id}") is None:
        earlier = crud.job_by_idempotency_key(session, key.project, idempotency_key or "")
        if earlier is None:  # pragma: no cover - the winner's row must be visible after its commit
            raise APIError(409, "A concurrent request with this Idempotency-Key is in progress; retry.",
                           code="idempotency_conflict")
        return replay(earlier, digest)
    view = _view(session, job)
    wake(session, job.id)
    return view


@router.get("", response_model=ListPage[FineTuningJob])
def list_jobs(request: Request, key: CurrentKey, session: ReadSessionDep, after: str | None = None,
              limit: int = Query(20, ge=1, le=crud.MAX_LIMIT), status: str | None = None) -> ListPage[FineTuningJob]:
    """Newest first; ``status=`` and OpenAI's metadata filter (``metadata[k]=v``, every pair must
    match; ``metadata=null``: jobs created without metadata)."""
    if status is not None and status not in STATUSES:
        raise APIError(422, f"Invalid value for 'status': {status!r}; use one of {', '.join(STATUSES)}.",
                       code="invalid_value", param="status")
    rows, more = crud.list_jobs(session, key.project, after=after, limit=limit, status=status,
                                metadata=_metadata_filter(request))
    from service import queue

    positions = queue.positions_of(session, [j.id for j in rows if j.status == "queued"])
    data = [job_view(j, positions.get(j.id)) for j in rows]
    return ListPage.of(data, more)


def _metadata_filter(request: Request) -> dict[str, str] | None:
    """``metadata[k]=v`` pairs of the query string, {} for ``metadata=null``, None for no filter."""
    pairs = [(k, v) for k, v in request.query_params.multi_items() if k == "metadata" or k.startswith("metadata[")]
    if not pairs:
        return None
    if [k for k, _ in pairs] == ["metadata"]:
        if pairs[0][1] != "null":
            raise APIError(422, "Invalid metadata filter: use metadata[KEY]=VALUE (repeatable), or metadata=null "
                                "for jobs without metadata.", code="invalid_value", param="metadata")
        return {}
    wanted: dict[str, str] = {}
    for k, v in pairs:
        name = k[len("metadata["):-1] if k.startswith("metadata[") and k.endswith("]") else None
        if not name or len(name) > 64 or name in wanted or len(v) > 512:
            raise APIError(422, f"Invalid metadata filter {k}={v[:80]!r}: use metadata[KEY]=VALUE with a key of 1-64 "
                                "characters, each key once, a value of at most 512, and not together with "
                                "metadata=null.", code="invalid_value", param="metadata")
        wanted[name] = v
    if len(wanted) > 16:
        raise APIError(422, "A metadata filter has at most 16 keys (a job's metadata has at most 16).",
                       code="invalid_value", param="metadata")
    return wanted


@router.get("/{job_id}", response_model=FineTuningJob)
async def get_job(job_id: str, key: CurrentKey, request: Request) -> Response:
    """The request clients poll: one read on the event loop (service.reads); a queued job, two."""
    job = await request.app.state.reads.job(key.project, job_id)
    if job is None:
        raise not_found("fine-tuning job", job_id, "fine_tuning_job_id")
    position = await request.app.state.reads.queue_position(job_id) if job.status == "queued" else None
    return json_response(job_view(job, position))


ACTIVE_LIMIT_RETRY_S = 30


def check_active_limit(session: Session, project: str, limit: int, action: str) -> None:
    """429 when the project already has ``limit`` jobs waiting for or holding a worker (0: no limit)."""
    if not limit:
        return
    active = crud.count_queue_holding_jobs(session, project)
    if active >= limit:
        session.rollback()
        raise APIError(429, f"This project has {active} jobs queued or running, the most this server allows "
                            f"(QERL_MAX_ACTIVE_JOBS={limit}); wait until one ends, or cancel or pause one, then "
                            f"{action}.", code="too_many_active_jobs",
                       # a place frees when a job ends, perhaps hours away: clients should not retry blindly
                       headers={"Retry-After": str(ACTIVE_LIMIT_RETRY_S), "x-should-retry": "false"})


def transition(session: Session, project: str, job_id: str, change: Callable[[Session, Job], Job],
               conflict_code: str, kind: str = "fine_tune") -> Job:
    """Apply a queue transition to one of the project's jobs (``kind="eval"``: evaluations) and
    commit it (409 if the job's state does not allow it: nothing is written then)."""
    from service import queue

    what, param = ("evaluation", "evaluation_id") if kind == "eval" else ("fine-tuning job", "fine_tuning_job_id")
    job = crud.get_job(session, project, job_id, kind=kind)
    if job is None:
        raise not_found(what, job_id, param)
    try:
        job = change(session, job)
    except queue.JobConflict as exc:
        session.rollback()
        raise APIError(409, str(exc), code=conflict_code, param=param) from None
    session.commit()
    return job


@router.post("/{job_id}/cancel", response_model=FineTuningJob)
def cancel_job(job_id: str, key: CurrentKey, session: SessionDep) -> FineTuningJob:
    from service import queue

    return job_view(transition(session, key.project, job_id, queue.cancel, "job_not_cancellable"))


@router.post("/{job_id}/pause", response_model=FineTuningJob)
def pause_job(job_id: str, key: CurrentKey, session: SessionDep) -> FineTuningJob:
    """queued -> paused; running -> pausing -> paused once the engine has saved a checkpoint
    (within a step), freeing the worker for the next queued job."""
    from service import queue

    return job_view(transition(session, key.project, job_id, queue.pause, "job_not_pausable"))


@router.post("/{job_id}/resume", response_model=FineTuningJob)
def resume_job(job_id: str, key: CurrentKey, session: SessionDep, settings: SettingsDep) -> FineTuningJob:
    """paused -> queued: a worker resumes it from its latest checkpoint."""
    from service import queue

    def resume(s: Session, job: Job) -> Job:
        if job.status == "paused":  # the other states answer as the transition does
            check_active_limit(s, key.project, settings.max_active_jobs, f"resume {job.id}")
        return queue.resume(s, job)

    job = transition(session, key.project, job_id, resume, "job_not_resumable")
    view = _view(session, job)
    if job.status == "queued":  # a duplicate wake-up for a job that was already queued is harmless
        wake(session, job.id)
    return view
