"""Request and response bodies in OpenAI's fine-tuning shapes (what the ``openai`` SDK parses),
with qerl's additions under a ``qerl`` key. Responses are built from ORM rows by ``service.views``."""
from __future__ import annotations

from typing import Annotated, Any, Callable, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from engine.data.jsonl import json_depth

T = TypeVar("T")
Auto = Literal["auto"]
MetadataKey = Annotated[str, StringConstraints(max_length=64)]  # OpenAI's limits
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
MAX_BODY_DEPTH = 32  # a job body nests ~6 levels; deeper is an attack on the parser and the serializer


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ReinforcementHyperparameters(_In):
    batch_size: Auto | int | None = Field(default=None, description="prompts per step (qerl.prompts_per_step)")
    learning_rate_multiplier: Auto | float | None = None
    n_epochs: Auto | int | None = None
    eval_interval: Auto | int | None = None
    eval_samples: Auto | int | None = None
    compute_multiplier: Auto | float | None = None
    reasoning_effort: Literal["default", "low", "medium", "high"] | None = None


class ReinforcementIn(_In):
    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparameters | None = None


class MethodIn(_In):
    type: Literal["supervised", "dpo", "reinforcement"]
    reinforcement: ReinforcementIn | None = None
    supervised: dict[str, Any] | None = None
    dpo: dict[str, Any] | None = None


NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"  # names end up in model names, file names and logs


class _BoundedIn(_In):
    """A request body whose free-form objects (a grader, qerl options) are nested at most MAX_BODY_DEPTH."""

    @model_validator(mode="before")
    @classmethod
    def _bounded_depth(cls, data: Any) -> Any:
        if json_depth(data) > MAX_BODY_DEPTH:
            raise ValueError(f"the request body nests deeper than {MAX_BODY_DEPTH} levels; flatten it")
        return data


class JobCreate(_BoundedIn):
    model: str = Field(min_length=1, max_length=255, pattern=NO_CONTROL)
    training_file: str | None = Field(default=None, max_length=255, pattern=NO_CONTROL)
    validation_file: str | None = Field(default=None, max_length=255, pattern=NO_CONTROL)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(default=None, max_length=64, pattern=NO_CONTROL)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    method: MethodIn | None = None
    hyperparameters: ReinforcementHyperparameters | None = None  # deprecated by OpenAI; method wins
    integrations: list[dict[str, Any]] | None = None
    qerl: dict[str, Any] | None = None  # TrainSpec fields; see service.jobspec


# ---- responses ------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (OpenAI's shape)."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "The request was refused; `error.message` says why and the fix"},
    503: {"model": ErrorResponse, "description": "The database or the broker is unreachable; retry later"},
}


class ListPage(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None

    @classmethod
    def of(cls, data: list[T], more: bool, key: Callable[[T], str] = lambda item: item.id) -> "ListPage[T]":
        """A page of ``data``, its cursors the ``key`` of its first and last items."""
        return cls(data=data, has_more=more, first_id=key(data[0]) if data else None,
                   last_id=key(data[-1]) if data else None)


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    expires_at: int | None = None
    status_details: str | None = None
    qerl: dict[str, Any] = Field(default_factory=dict)  # rows, prompts (distinct), fields ({name: rows}), sha256; None: not counted


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


class CheckpointDeleted(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    deleted: bool = True


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    deleted: bool = True


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobProgress(BaseModel):
    step: int
    total_steps: int
    # succeeded before total_steps: qerl.early_stop_patience ended it (its events say when and why)
    stopped_early: bool = False


class JobQerl(BaseModel):
    quantization: str
    progress: JobProgress
    attempt: int
    max_attempts: int
    cancel_requested: bool
    adapter_id: str | None
    started_at: int | None
    dataset: dict[str, Any] | None
    spec: dict[str, Any]
    queue_position: int | None = Field(None, description="while queued: 1 = the next job a free worker "
                                       "takes (projects take turns: it can move back as other projects queue jobs)")


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: dict[str, Any]
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: str
    trained_tokens: int | None
    training_file: str | None
    validation_file: str | None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, str] | None = None
    method: dict[str, Any]
    user_provided_suffix: str | None = None
    qerl: JobQerl


class FineTuningJobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None


class CheckpointQerl(BaseModel):
    """The checkpoint's LoRA archive where the job keeps them (qerl.keep_checkpoint_adapters): it
    stays downloadable until the checkpoint or the fine-tuned model is deleted; null otherwise
    (downloadable while the checkpoint is on disk)."""
    adapter_bytes: int | None = None
    adapter_sha256: str | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, Any]
    step_number: int
    qerl: CheckpointQerl = Field(default_factory=CheckpointQerl)


class StepMetrics(BaseModel):
    step: int
    attempt: int
    created_at: int
    values: dict[str, Any]


class JobSampleView(BaseModel):
    """One of the samples a job reported for a step (``kind`` train: the step's sampled rollouts,
    prompt-major; eval: the evaluation's greedy completions at that step)."""

    object: Literal["fine_tuning.job.sample"] = "fine_tuning.job.sample"
    step: int
    kind: Literal["train", "eval"]
    index: int
    attempt: int
    prompt: str  # as the model saw it (chat template applied; the end kept when long)
    completion: str
    reward: float
    scores: dict[str, Any]  # each named (sub-)grader's score
    finish_reason: str  # stop | length
    tokens: int
    created_at: int


class Adapter(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    created_at: int
    name: str
    base_model: str
    job_id: str
    bytes: int
    sha256: str
    manifest: dict[str, Any]


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    qerl: dict[str, Any] = Field(default_factory=dict)  # kind: base | adapter, adapter_id, base_model


# ---- graders: /v1/fine_tuning/alpha/graders/validate and /run ---------------------------------
class GraderValidate(_BoundedIn):
    grader: dict[str, Any]


class GraderRun(_BoundedIn):
    grader: dict[str, Any]
    model_sample: str = Field(description="fills {{sample.output_text}} (and {{sample.output_json}} when it is JSON)")
    item: dict[str, Any] = Field(default_factory=dict, description="the dataset row: fills {{item.<field>}}")


class GraderValidatedQerl(BaseModel):
    item_fields: list[str] = Field(default_factory=list)  # top-level fields every row must have


class GraderValidated(BaseModel):
    grader: dict[str, Any]
    qerl: GraderValidatedQerl = Field(default_factory=GraderValidatedQerl)


class GraderRunErrors(BaseModel):
    """OpenAI's error flags of a grader run."""

    model_config = ConfigDict(protected_namespaces=())
    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderRunErrors
    execution_time: float  # seconds
    scores: dict[str, float]  # each named (sub-)grader's score, as training logs them (reward/<name>)
    token_usage: int | None = None
    sampled_model_name: str | None = None


class GraderRunQerl(BaseModel):
    error: str | None = None  # what failed and the fix, whichever grader failed


class GraderRunResult(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, float]  # a multi grader's sub-graders: the values calculate_output combined
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)
    qerl: GraderRunQerl = Field(default_factory=GraderRunQerl)


# ---- evaluations ----------------------------------------------------------------------------
class EvaluationDataset(_In):
    """Fresh questions of a reasoning-gym task; for a model trained on that task, with its config and
    another seed, leaving out every question it trained on (engine.score.task_rows)."""
    task: str = Field(min_length=1, max_length=128, pattern=NO_CONTROL)
    size: int = Field(default=50, ge=1, le=10_000)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1,
                             description="default: one past the seed of the model's own questions")


class EvaluationCreate(_BoundedIn):
    """Score a fine-tuned model on test rows on a worker's GPU: one greedy answer per row with the
    adapter and one from its base alone, graded as the job's held-out evaluation grades."""
    model: str = Field(min_length=1, max_length=255, pattern=NO_CONTROL,
                       description="a fine-tuned model (ft:...), a kept checkpoint (ft:...:ckpt-step-N), a succeeded "
                                   "job's id (ftjob-...) or an adapter id (adapter-...)")
    file: str | None = Field(default=None, max_length=255, pattern=NO_CONTROL,
                             description="the test rows: an uploaded file (purpose fine-tune) in a training file's "
                                         "format")
    dataset: EvaluationDataset | None = Field(default=None, description="instead of a file: fresh questions of a "
                                                                        "reasoning-gym task")
    grader: dict[str, Any] | None = Field(default=None, description="default: the grader the model trained with")
    max_new_tokens: int | None = Field(default=None, ge=1, le=32768,
                                       description="the longest answer (default: the rollouts' limit in training)")
    limit: int | None = Field(default=None, ge=1, description="score the first N rows only")
    compare_base: bool = Field(default=True, description="also score the base model alone")
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)


class EvaluationResult(BaseModel):
    """The ``eval/*`` metrics without their prefix (accuracy, reward_mean, reward/<part>,
    completion_len_mean, truncated_frac, ...), the adapter's and the base's alone."""
    fine_tuned: dict[str, float]
    base: dict[str, float] | None = None
    rows: int
    base_model: str
    quantization: str
    device: str
    max_new_tokens: int
    grader: str


class Evaluation(BaseModel):
    id: str
    object: Literal["evaluation"] = "evaluation"
    created_at: int
    started_at: int | None = None
    finished_at: int | None = None
    status: str
    model: str
    file: str | None
    dataset: dict[str, Any] | None = None
    grader: dict[str, Any] | None
    limit: int | None = None
    max_new_tokens: int | None = None
    compare_base: bool
    metadata: dict[str, str] | None = None
    error: JobError | None = None
    result: EvaluationResult | None = None
    result_files: list[str] = Field(default_factory=list, description="every row's answers and rewards (JSONL)")
    queue_position: int | None = None
    attempt: int = 0
