"""/v1/evaluations: score a fine-tuned model on test rows on a worker's GPU, beside its base alone.

An evaluation is a job row of kind ``eval``: queued, claimed, leased, reaped and cancelled as a
training job is (service.queue), so a lost worker loses no evaluation; the worker runs
engine.score.evaluate_adapter on the adapter's archive and the test file, and writes the scores
(``result``) and every row's answers (``result_files``, JSONL).
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from engine import registry
from engine.data.builtin import check_dataset
from engine.types import TrainError
from service import crud
from service.auth import CurrentKey
from service.deps import ReadSessionDep, ReleasingRoute, SessionDep, SettingsDep, StoreDep, json_response
from service.errors import APIError, not_found
from service.jobspec import check_file_fields, check_grader, usable_file
from service.models import Job, new_id
from service.routes.events import events_response
from service.routes.jobs import STATUSES, check_active_limit, counted, replay, request_hash, transition, wake
from service.schemas import Evaluation, EvaluationCreate, FineTuningJobEvent, ListPage
from service.views import evaluation_view

router = APIRouter(prefix="/evaluations", tags=["evaluations"], route_class=ReleasingRoute)


@router.post("", response_model=Evaluation)
def create_evaluation(body: EvaluationCreate, key: CurrentKey, session: SessionDep, settings: SettingsDep,
                      store: StoreDep, idempotency_key: Annotated[str | None, Header(max_length=255)] = None
                      ) -> Evaluation:
    """Queued for a worker; a retry with the same Idempotency-Key and body gets the same evaluation."""
    raw = body.model_dump(mode="json", exclude_unset=True)
    digest = request_hash(raw)
    if idempotency_key is not None:
        earlier = crud.job_by_idempotency_key(session, key.project, idempotency_key)
        if earlier is not None:
            return replay(earlier, digest, evaluation_view)
    if (body.file is None) == (body.dataset is None):
        raise APIError(422, "give the test rows: 'file' (an uploaded file id) or 'dataset' (fresh questions of a "
                            "reasoning-gym task, e.g. {\"task\": \"products\", \"size\": 50}), not both",
                       code="missing_required", param="file")
    source = crud.find_model(session, key.project, body.model)
    if source is None:
        raise APIError(422, f"no fine-tuned model, kept checkpoint, succeeded job or adapter {body.model!r} in this "
                            "project; GET /v1/models lists the fine-tuned models (ft:...)", code="model_not_found",
                       param="model")
    try:
        registry.resolve(source.base_model)
    except ValueError as exc:
        raise APIError(422, f"{body.model} was trained on {source.base_model!r}, which this deployment no longer "
                            f"serves: {exc}", code="model_not_found", param="model") from None
    trained = crud.get_job(session, key.project, source.job_id)
    grader = body.grader if body.grader is not None else ((trained.spec or {}).get("grader") if trained else None)
    if grader is None:
        raise APIError(422, f"{body.model} trained without a grader of its own (a built-in task's scorer); give the "
                            "grader to score the test rows with as 'grader'", code="missing_required", param="grader")
    built = check_grader(grader, "grader.")
    f = None
    if body.file is not None:
        f = usable_file(lambda fid: counted(store, crud.get_file(session, key.project, fid, for_update=True)), "file",
                        body.file)
        check_file_fields(built, f, "file", body.file)
    else:
        _check_questions(body, trained)
    check_active_limit(session, key.project, settings.max_active_jobs, "create another")
    spec = {"model": source.base_model, "init_adapter": source.path,
            "grader": grader, "limit": body.limit, "max_new_tokens": body.max_new_tokens,
            "compare_base": body.compare_base,
            "dataset": body.dataset.model_dump() if body.dataset is not None else None}
    job = Job(id=new_id("evaljob"), kind="eval", project=key.project, model=source.name, status="queued",
              request=raw, spec=spec, validation_file=f.id if f is not None else None, seed=0,
              user_metadata=body.metadata,
              idempotency_key=idempotency_key, request_hash=digest, max_attempts=settings.max_attempts)
    if crud.insert_job(session, job, f"Created evaluation: {job.id}") is None:  # a concurrent twin won
        return replay(crud.job_by_idempotency_key(session, key.project, idempotency_key or ""), digest,
                      evaluation_view)
    from service import queue

    view = evaluation_view(job, queue.positions_of(session, [job.id]).get(job.id))
    wake(session, job.id)
    return view


def _check_questions(body: EvaluationCreate, trained: Job | None) -> None:
    """The task's questions as the worker will draw them (engine.score.task_rows, from what the model
    trained on), or 422 naming ``dataset`` (503 where this server cannot import reasoning-gym)."""
    from engine.score import task_rows

    assert body.dataset is not None
    d = body.dataset
    try:
        check_dataset({"source": "reasoning_gym", "task": d.task, "size": 1})
    except TrainError as exc:
        if exc.code == "dataset_unavailable":
            raise APIError(503, f"{exc} The evaluation was not created.", code=exc.code, param="dataset") from None
        raise APIError(422, str(exc).replace("data.dataset.", "dataset."), code="invalid_value",
                       param="dataset.task") from None
    spec = (trained.spec or {}) if trained is not None else {}
    try:
        task_rows(d.task, d.size, d.seed, {"dataset": (spec.get("data") or {}).get("dataset"), "seed": spec.get("seed")})
    except ValueError as exc:
        raise APIError(422, str(exc), code="invalid_value", param="dataset") from None


@router.get("", response_model=ListPage[Evaluation])
def list_evaluations(key: CurrentKey, session: ReadSessionDep, after: str | None = None,
                     limit: int = Query(20, ge=1, le=crud.MAX_LIMIT), status: str | None = None,
                     model: str | None = Query(None, max_length=255)) -> ListPage[Evaluation]:
    """Newest first; ``status=`` and ``model=`` (the fine-tuned model or checkpoint scored) filter."""
    if status is not None and status not in STATUSES:
        raise APIError(422, f"Invalid value for 'status': {status!r}; use one of {', '.join(STATUSES)}.",
                       code="invalid_value", param="status")
    rows, more = crud.list_jobs(session, key.project, after=after, limit=limit, status=status, kind="eval",
                                model=model)
    from service import queue

    positions = queue.positions_of(session, [j.id for j in rows if j.status == "queued"])
    return ListPage.of([evaluation_view(j, positions.get(j.id)) for j in rows], more)


@router.get("/{evaluation_id}", response_model=Evaluation)
async def get_evaluation(evaluation_id: str, key: CurrentKey, request: Request) -> Response:
    job = await request.app.state.reads.job(key.project, evaluation_id, kind="eval")
    if job is None:
        raise not_found("evaluation", evaluation_id, "evaluation_id")
    position = await request.app.state.reads.queue_position(job.id) if job.status == "queued" else None
    return json_response(evaluation_view(job, position))


@router.get("/{evaluation_id}/events", response_model=ListPage[FineTuningJobEvent],
            responses={200: {"content": {"text/event-stream": {}}}})
async def evaluation_events(evaluation_id: str, request: Request, key: CurrentKey, settings: SettingsDep,
                            after: str | None = None, limit: int = Query(20, ge=1, le=crud.MAX_LIMIT)) -> Response:
    """Its events as a fine-tuning job's (service.routes.events): a page, or the stream until it ends."""
    return await events_response(request, key.project, evaluation_id, settings, after, limit, kind="eval")


@router.post("/{evaluation_id}/cancel", response_model=Evaluation)
def cancel_evaluation(evaluation_id: str, key: CurrentKey, session: SessionDep) -> Evaluation:
    from service import queue

    return evaluation_view(transition(session, key.project, evaluation_id, queue.cancel, "evaluation_not_cancellable",
                                      kind="eval"))
