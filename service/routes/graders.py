"""/v1/fine_tuning/alpha/graders: check a grader, and score one sample with it, before a long RL
job relies on it (OpenAI's grader endpoints).

``validate`` makes the checks job creation makes (``service.jobspec.check_grader``). ``run`` gives
the reward training would give that sample on that item (``service.grader_run``, in a separate
process); a grader that fails or runs out of time answers 200 with reward 0 and the failure in
``metadata.errors`` (OpenAI's flags) and ``qerl.error`` (the message), as OpenAI's run does.
"""
from __future__ import annotations

import os
import threading
from typing import Any

from fastapi import APIRouter

from service import grader_run
from service.auth import CurrentKey
from service.deps import ReleasingRoute, SettingsDep
from service.errors import APIError
from service.jobspec import check_grader
from service.schemas import (GraderRun, GraderRunErrors, GraderRunMetadata, GraderRunQerl, GraderRunResult,
                             GraderValidate, GraderValidated, GraderValidatedQerl)

router = APIRouter(prefix="/fine_tuning/alpha/graders", tags=["graders"], route_class=ReleasingRoute)
# grading processes at once in this API process; each holds a request thread for up to its budget
MAX_RUNS = max(2, os.cpu_count() or 1)
RUNS = threading.BoundedSemaphore(MAX_RUNS)
RETRY_AFTER_S = 2


@router.post("/validate", response_model=GraderValidated)
def validate_grader(body: GraderValidate, key: CurrentKey) -> GraderValidated:
    """The grader as given, with the item fields every row of a job's files must have for it (a
    job over rows without one is refused), or 422 naming its bad field
    (``grader.graders.answer.operation``) and the fix."""
    grader = check_grader(body.grader)
    return GraderValidated(grader=body.grader, qerl=GraderValidatedQerl(item_fields=sorted(grader.item_fields)))


@router.post("/run", response_model=GraderRunResult)
def run_grader(body: GraderRun, key: CurrentKey, settings: SettingsDep) -> GraderRunResult:
    """The reward of ``model_sample`` on ``item``, each named sub-grader's score, and any failure."""
    grader = check_grader(body.grader)
    if not RUNS.acquire(blocking=False):
        raise APIError(429, f"{MAX_RUNS} grader runs are in progress on this server, the most it runs at "
                            f"once; retry in {RETRY_AFTER_S}s.", code="too_many_grader_runs",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    try:
        result = grader_run.run(body.grader, grader, body.model_sample, body.item, data_dir=settings.data_dir,
                                artifact_dir=settings.artifact_dir)  # type: ignore[arg-type]
    finally:
        RUNS.release()
    failure = result.get("error")
    if failure == "invalid_item":
        raise APIError(422, f"item: {result['message']}", code="invalid_value", param="item")
    metadata = GraderRunMetadata(name=grader.name, type=grader.type, errors=_errors(result),
                                 execution_time=result["execution_time"], scores=result.get("scores", {}),
                                 token_usage=result.get("token_usage"),
                                 sampled_model_name=result.get("sampled_model_name"))
    return GraderRunResult(reward=result.get("reward", 0.0), metadata=metadata,
                           sub_rewards=result.get("sub_rewards", {}), qerl=GraderRunQerl(error=result.get("message")))


def _errors(result: dict[str, Any]) -> GraderRunErrors:
    """OpenAI's flags for a failure of service.grader_run (none when it scored)."""
    kind, message = result.get("error"), result.get("message")
    python_runtime = kind in ("python_runtime", "python_timeout")
    return GraderRunErrors(model_grader_server_error=kind == "model_server",
                           model_grader_server_error_details=message if kind == "model_server" else None,
                           model_grader_parse_error=kind == "model_parse",
                           model_grader_refusal_error=kind == "model_refusal",
                           python_grader_runtime_error=python_runtime,
                           python_grader_runtime_error_details=message if python_runtime else None,
                           python_grader_server_error=kind == "python_server",
                           python_grader_server_error_type=result.get("type") if kind == "python_server" else None,
                           unresponsive_reward_error=kind in ("python_timeout", "timeout"),
                           other_error=kind == "other")
