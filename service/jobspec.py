"""A job request body -> an engine ``TrainSpec`` dict, validated before anything is queued.

Mapping (OpenAI name -> TrainSpec): ``model`` -> model (registry names only, never a path);
``training_file``/``validation_file`` -> data.train_file/validation_file (paths relative to the
artifact store; the worker's runner makes them absolute); ``qerl.dataset`` -> data.dataset;
``method.reinforcement.grader`` -> grader; hyperparameters: ``batch_size`` -> prompts_per_step,
``learning_rate_multiplier`` -> optim.lr = 1e-5 x m, ``n_epochs`` -> steps = ceil(epochs x
training rows / batch) x rl.mu (the rows the held-out prompts leave), ``eval_interval`` ->
eval_interval, ``eval_samples`` -> data.eval_size, ``compute_multiplier`` ->
rollout.num_generations = round(4 x m). ``qerl`` takes TrainSpec's own
fields, plus the shortcuts ``algorithm`` (rl.algorithm) and ``dataset`` (data.dataset). A
fine-tuned ``model`` (``ft:...``, or a kept checkpoint's ``ft:...:ckpt-step-N``) is trained further:
its base, LoRA shape and weights (init_adapter).
"""
from __future__ import annotations

import copy
import math
import re
import secrets
from typing import Any, Callable

from engine import registry
from engine.data.builtin import check_dataset
from engine.data.jsonl import missing_item_fields
from engine.rewards import Grader, build_grader
from engine.rewards.multi import leaves
from engine.spec import LORA_SHAPE, TrainSpec, default_eval_size, same_lora_value
from engine.types import TrainError
from service.errors import APIError
from service.crud import Parent
from service.models import File
from service.schemas import JobCreate
from service.views import DEFAULT_LR

RECORDS = ("data", "lora", "aqn", "rollout", "rl", "optim")  # TrainSpec's sub-records
TOP_LEVEL_OWNED = {"model": "model", "grader": "method.reinforcement.grader", "seed": "seed"}
_FIELD = re.compile(r"^(?:unknown field )?([A-Za-z_][\w.\[\]]*)")


def _invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(422, message, code=code, param=param)


def check_grader(grader: dict[str, Any], prefix: str = "") -> Grader:
    """The grader the worker will build (torch-free: the same checks), or 422 naming the field as
    ``prefix`` + its path (``grader.graders.answer.operation``)."""
    try:
        return build_grader(grader)
    except ValueError as exc:
        match = _FIELD.match(str(exc))
        raise _invalid(prefix + (match.group(1) if match else "grader"), str(exc)) from None


def usable_file(lookup_file: Callable[[str], File | None], param: str, file_id: str) -> File:
    """The project's uploaded JSONL file ``file_id`` (purpose fine-tune), or 422 naming ``param``."""
    f = lookup_file(file_id)
    if f is None:
        raise _invalid(param, f"{param}: no file {file_id!r} in this project; upload it with POST /v1/files "
                              "(purpose=fine-tune) and pass the returned id", code="file_not_found")
    if f.purpose != "fine-tune":
        raise _invalid(param, f"{param}: file {file_id!r} has purpose {f.purpose!r}; upload it with "
                              "purpose=fine-tune")
    return f


def check_file_fields(grader: Grader, f: File, param: str, file_id: str) -> None:
    """422 naming ``param`` when rows of the file lack a field the grader reads (from the counts
    taken at upload; an uncounted file is the worker's to check)."""
    counts = getattr(f, "fields", None)
    problem = counts is not None and (
        missing_item_fields(grader.item_fields, counts, f.rows, f"{param} {file_id}")
        or next((f"{param} {file_id}: {p}" for p in (g.check_field_counts(counts, f.rows)
                                                     for g in leaves(grader)) if p), None))
    if problem:
        raise _invalid(param, problem)


def _param_of(message: str) -> str:
    """The field a TrainSpec ValueError names, as a request param (``lora.r`` -> ``qerl.lora.r``)."""
    match = _FIELD.match(message)
    name = match.group(1).rstrip(".") if match else ""
    root = name.split(".")[0].split("[")[0]
    if root in TOP_LEVEL_OWNED:
        return TOP_LEVEL_OWNED[root]
    if root == "data" and name.startswith("data.dataset"):
        return "qerl.dataset"
    return f"qerl.{name}" if name else "qerl"


def _positive(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _training_rows(body: JobCreate, data: dict[str, Any], size: int, questions: int) -> int:
    """Rows the training split will keep: the ``size`` rows of the training file (a built-in task's
    questions), less those of the prompts held out for evaluation when there is no validation file
    (the rows of a repeated prompt go with it: their share of the file, where its ``questions``
    distinct prompts repeat)."""
    held = data.get("eval_size", default_eval_size(questions)) if body.validation_file is None else 0
    if not isinstance(held, int) or isinstance(held, bool) or not 0 <= held < questions:
        return size  # TrainSpec or the check after it names the field
    return max(1, size - round(held * size / questions))


def _hyper(body: JobCreate, d: dict[str, Any], qerl: dict[str, Any], size: int, questions: int) -> dict[str, str]:
    """Apply the OpenAI hyperparameters to the spec dict d; returns {spec field: the request param
    it came from} for the error that names a field set this way."""
    method_h = body.method.reinforcement.hyperparameters if body.method and body.method.reinforcement else None
    h = method_h or body.hyperparameters
    if h is None:
        return {}
    p = "method.reinforcement.hyperparameters" if method_h else "hyperparameters"
    if h.reasoning_effort not in (None, "default"):
        raise _invalid(f"{p}.reasoning_effort", f"{p}.reasoning_effort applies to reasoning models served by "
                                                "OpenAI; remove it or use 'default'")
    # ranges in the user's terms (TrainSpec's own bounds, mapped back through the conversions below)
    for name, value, lo, hi in [("batch_size", h.batch_size, 1, 4096), ("n_epochs", h.n_epochs, 1, 1000),
                                ("eval_interval", h.eval_interval, 0, 1_000_000),
                                ("eval_samples", h.eval_samples, 0, 100_000)]:
        if isinstance(value, int) and not lo <= value <= hi:
            raise _invalid(f"{p}.{name}", f"{p}.{name} must be 'auto' or an integer in [{lo}, {hi}]; got {value}")
    for name, value, hi in [("learning_rate_multiplier", h.learning_rate_multiplier, 1000),
                            ("compute_multiplier", h.compute_multiplier, 64)]:
        if isinstance(value, float) and not (0 < value <= hi):
            raise _invalid(f"{p}.{name}", f"{p}.{name} must be 'auto' or a number in (0, {hi}]; got {value}")
    came_from = {}
    if isinstance(h.batch_size, int):
        d["prompts_per_step"] = h.batch_size
        came_from["prompts_per_step"] = f"{p}.batch_size"
    if isinstance(h.learning_rate_multiplier, float):
        d.setdefault("optim", {})["lr"] = DEFAULT_LR * h.learning_rate_multiplier
        came_from["optim.lr"] = f"{p}.learning_rate_multiplier"
    if isinstance(h.eval_interval, int):
        d["eval_interval"] = h.eval_interval
        came_from["eval_interval"] = f"{p}.eval_interval"
    if isinstance(h.eval_samples, int):
        d.setdefault("data", {})["eval_size"] = h.eval_samples
        came_from["data.eval_size"] = f"{p}.eval_samples"
    if isinstance(h.compute_multiplier, float):
        d.setdefault("rollout", {})["num_generations"] = max(2, round(4 * h.compute_multiplier))
        came_from["rollout.num_generations"] = f"{p}.compute_multiplier"
    if isinstance(h.n_epochs, int):
        if "steps" in qerl:
            raise _invalid(f"{p}.n_epochs", f"give either {p}.n_epochs or qerl.steps, not both")
        # wrong types in these inputs are left for TrainSpec to reject with its own message
        batch = _positive(d.get("prompts_per_step"), TrainSpec.prompts_per_step)
        d["steps"] = (math.ceil(h.n_epochs * _training_rows(body, d["data"], size, questions) / batch)
                      * _positive(d.get("rl", {}).get("mu"), 1))
        came_from["steps"] = f"{p}.n_epochs"
    return came_from


def _parent(model: str, lookup_parent: Callable[[str], Parent | None]) -> Parent:
    """The fine-tuned model or kept checkpoint LoRA of this project a job trains further."""
    parent = lookup_parent(model)
    if parent is None:
        if ":ckpt-step-" in model:
            raise _invalid("model", f"no checkpoint {model!r} with a kept LoRA in this project: a job keeps its "
                                    "checkpoints' LoRAs for training further when created with "
                                    "qerl.keep_checkpoint_adapters=true (GET /v1/fine_tuning/jobs/{id}/checkpoints "
                                    "shows them with qerl.adapter_sha256)", code="model_not_found")
        raise _invalid("model", f"no fine-tuned model {model!r} in this project; GET /v1/models lists them",
                       code="model_not_found")
    return parent


def _inherit_lora(d: dict[str, Any], parent: Parent) -> None:
    """The parent's LoRA shape, unless the request gives the same; dropout may change."""
    theirs = parent.lora
    ours = d.setdefault("lora", {})
    for name in LORA_SHAPE:
        if name not in theirs:
            continue
        if name in ours:
            a, b = ours[name], theirs[name]
            if not same_lora_value(name, a, b):
                raise _invalid(f"qerl.lora.{name}", f"qerl.lora.{name}={a!r}, but {parent.name} was trained with "
                                                    f"{b!r}: a model trained further keeps its LoRA's shape; set "
                                                    f"qerl.lora.{name} to {b!r} or leave it out")
        ours[name] = theirs[name]


def build_spec(body: JobCreate, lookup_file: Callable[[str], File | None],
               lookup_parent: Callable[[str], Parent | None] = lambda name: None) -> tuple[str, dict[str, Any]]:
    """(the job's model name, TrainSpec dict) or APIError 422 naming the param and the fix. A
    fine-tuned model or kept checkpoint (``ft:...``, ``lookup_parent``) is trained further: its base
    model, its LoRA as ``init_adapter`` (the archive's path in the artifact store), its LoRA shape."""
    parent = _parent(body.model, lookup_parent) if body.model.startswith("ft:") else None
    try:
        entry = registry.resolve(parent.base_model if parent is not None else body.model)
    except ValueError as exc:
        raise _invalid("model", str(exc) if parent is None else f"{body.model} was trained on {parent.base_model!r}, "
                                                               f"which this deployment no longer serves: {exc}",
                       code="model_not_found") from None
    if body.method is not None and body.method.type != "reinforcement":
        raise _invalid("method.type", f"this service trains with reinforcement learning only; set method.type to "
                                      f"'reinforcement' (got {body.method.type!r})")
    if body.integrations:
        raise _invalid("integrations", "integrations are not supported; remove 'integrations'")
    qerl = copy.deepcopy(body.qerl or {})
    for key, use in TOP_LEVEL_OWNED.items():
        if key in qerl:
            raise _invalid(f"qerl.{key}", f"qerl.{key} is not accepted; set '{use}' instead")
    d: dict[str, Any] = {k: v for k, v in qerl.items() if k not in ("algorithm", "dataset")}
    for key in RECORDS:
        if not isinstance(d.get(key, {}), dict):
            raise _invalid(f"qerl.{key}", f"qerl.{key} must be an object, e.g. {{\"{key}\": {{...}}}}")
    if "init_adapter" in d:
        raise _invalid("qerl.init_adapter", "qerl.init_adapter is not accepted; to train a fine-tuned model further, "
                                            "set 'model' to its name (ft:...)")
    if parent is not None:
        _inherit_lora(d, parent)
        d["init_adapter"] = parent.path
    data = d.setdefault("data", {})
    for forbidden, use in (("train_file", "training_file"), ("validation_file", "validation_file")):
        if forbidden in data:
            raise _invalid(f"qerl.data.{forbidden}", f"qerl.data.{forbidden} is not accepted; upload the file "
                                                     f"(POST /v1/files) and pass its id as '{use}'")
    if "algorithm" in qerl:
        d.setdefault("rl", {})
        if not isinstance(d["rl"], dict) or "algorithm" in d["rl"]:
            raise _invalid("qerl.algorithm", "give the algorithm once: qerl.algorithm or qerl.rl.algorithm")
        d["rl"]["algorithm"] = qerl["algorithm"]
    if "dataset" in qerl:
        data["dataset"] = qerl["dataset"]
    if (body.training_file is None) == ("dataset" not in data):
        raise _invalid("training_file", "give exactly one of training_file (an uploaded JSONL file id) or "
                                        "qerl.dataset (a built-in task, e.g. {\"source\": \"reasoning_gym\", "
                                        "\"task\": \"products\"})", code="missing_required")
    rows, prompts, files = None, None, []
    for param, file_id in (("training_file", body.training_file), ("validation_file", body.validation_file)):
        if file_id is None:
            continue
        f = usable_file(lookup_file, param, file_id)
        data["train_file" if param == "training_file" else "validation_file"] = f.path
        if param == "training_file":
            rows, prompts = f.rows, getattr(f, "prompts", None)
        files.append((param, file_id, f))
    grader = body.method.reinforcement.grader if body.method and body.method.reinforcement else None
    if grader is None and body.training_file is not None:
        raise _invalid("method.reinforcement.grader", "a training_file needs a grader: set method = {\"type\": "
                       "\"reinforcement\", \"reinforcement\": {\"grader\": {...}}} (e.g. a string_check grader)",
                       code="missing_required")
    if grader is not None:
        built = check_grader(grader, "method.reinforcement.")
        d["grader"] = grader
        for param, file_id, f in files:
            check_file_fields(built, f, param, file_id)
    # the rows training draws from (a built-in task's questions; a malformed task is TrainSpec's to
    # name), and the distinct questions a held-out split takes: counted at upload, else (an older
    # upload) the rows
    dataset = data.get("dataset")
    size = rows if rows is not None else _positive(dataset.get("size") if isinstance(dataset, dict) else None, 200)
    questions = prompts if prompts is not None else size
    came_from = _hyper(body, d, qerl, size, questions)
    if body.validation_file is None and "eval_size" not in data:
        data["eval_size"] = default_eval_size(questions)  # a small set keeps most of its questions
    distinct = questions if rows is not None else None  # a file's (a built-in task's are TrainSpec's to check)
    d["model"] = entry.name
    d["seed"] = body.seed if body.seed is not None else secrets.randbelow(2**31)
    try:
        spec = TrainSpec.from_dict(d)
        if distinct is not None and spec.data.validation_file is None and spec.data.eval_size >= distinct:
            of = f"{distinct} rows" if distinct == rows else f"{distinct} distinct prompts (in {rows} rows)"
            raise ValueError(f"data.eval_size={spec.data.eval_size} would hold out every one of the training file's "
                             f"{of}; lower it below {distinct}, upload more prompts, or give a validation_file")
    except ValueError as exc:
        match = _FIELD.match(str(exc))
        field = match.group(1).rstrip(".") if match else ""
        if field in came_from:  # set through a hyperparameter: name it, then the spec's words
            raise _invalid(came_from[field], f"{came_from[field]}: {exc}") from None
        raise _invalid(_param_of(str(exc)), str(exc)) from None
    if spec.data.dataset is not None:
        try:
            check_dataset(spec.data.dataset)  # the task's name and config: reasoning-gym builds one item
        except TrainError as exc:
            if exc.code == "dataset_unavailable":  # this server's install, not the request
                raise APIError(503, f"{exc} The job was not created.", code=exc.code, param="qerl.dataset") from None
            raise _invalid("qerl.dataset", str(exc)) from None
    return (parent.name if parent is not None else entry.name), spec.to_dict()
