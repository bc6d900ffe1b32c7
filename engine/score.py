"""A fine-tuned adapter scored on test rows, as the job's held-out evaluation scores it.

`qerl eval` on a user's machine and the worker on the server score an adapter alike, so both
call this module: the adapter's manifest names its base model, the format it trained in, the
turns training put before its questions and its grader; the rows are framed as training asked
them and checked against the grader before any model loads; then each gets one greedy answer
(no AQN noise) with the adapter attached and one from the base alone, graded into the
``eval/*`` metrics (engine.evaluate). Torch is imported on first use, so the CLI can import
this module at start-up.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.manifest import MANIFEST
from engine.types import TrainError

if TYPE_CHECKING:
    import torch

    from engine.data.load import Example

DEFAULT_MAX_NEW_TOKENS = 256  # a manifest that records no rollout limit
DEFAULT_MAX_BATCH = 64


class NotAnAdapter(ValueError):
    """A directory without PEFT's ``adapter_config.json``."""


class AdapterOptionError(ValueError):
    """The adapter cannot load as asked; ``option`` names what to change: ``base``,
    ``quantization`` or ``device``."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


class AdapterLoadError(ValueError):
    """The base model or the adapter failed to load (a missing or mismatched file, an unknown
    model); ``reason`` is the loader's message."""

    def __init__(self, base: str, adapter: Path, reason: str) -> None:
        super().__init__(f"cannot load {base} with the adapter in {adapter}: {reason}")
        self.base, self.adapter, self.reason = base, adapter, reason


@dataclass
class Scored:
    """An adapter's (or the base alone's) greedy completions of the test rows, graded."""

    completions: list[Any]
    scores: list[float]
    parts: list[dict[str, float]]
    metrics: dict[str, float]


@dataclass
class AdapterScore:
    """One adapter's scores on the test rows (``evaluate_adapter``)."""

    model: str
    quantization: str
    device: str
    max_new_tokens: int
    grader: str
    rows: int
    fine_tuned: dict[str, float]  # eval/* metrics of the adapter
    base: dict[str, float] | None  # of the base alone (None when not compared)
    records: list[dict[str, Any]]  # row_records


# -- the adapter directory ----------------------------------------------------------------------
def read_manifest(adapter: Path) -> dict[str, Any]:
    """The adapter's ``qerl_manifest.json`` ({} for a PEFT directory without one)."""
    if not (adapter / "adapter_config.json").is_file():
        raise NotAnAdapter(f"{adapter} is not a PEFT adapter directory (no adapter_config.json)")
    path = adapter / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def adapter_facts(adapter: Path) -> tuple[str, str, list[dict[str, str]]]:
    """(base model, quantization, prompt framing) the adapter was trained with, from its manifest
    (or PEFT's config: no framing known)."""
    manifest = read_manifest(adapter)
    if manifest:
        base = manifest.get("base_model") or {}
        name = base.get("name") if isinstance(base, dict) else base
        return str(name or ""), str(manifest.get("quantization") or "bf16"), _framing_turns(manifest)
    config = json.loads((adapter / "adapter_config.json").read_text())
    return str(config.get("base_model_name_or_path") or ""), "bf16", []


def recorded_grader(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The grader config the adapter trained with, or None where its manifest records none."""
    grader = manifest.get("grader")
    return grader if isinstance(grader, dict) else None


def decoding(manifest: dict[str, Any], max_new_tokens: int | None = None) -> tuple[Any, int]:
    """(SamplingParams, max batch) for scoring: ``max_new_tokens`` or the rollouts' limit in
    training, and the batch training decoded in."""
    from engine.rollout.params import SamplingParams

    rollout = manifest.get("rollout") if isinstance(manifest.get("rollout"), dict) else {}
    params = SamplingParams(max_new_tokens=max_new_tokens or int(rollout.get("max_new_tokens")
                                                                  or DEFAULT_MAX_NEW_TOKENS))
    return params, int(rollout.get("max_batch") or DEFAULT_MAX_BATCH)


def _framing_turns(manifest: dict[str, Any]) -> list[dict[str, str]]:
    framing = manifest.get("prompt_framing")
    return [m for m in framing if isinstance(m, dict)] if isinstance(framing, list) else []


# -- the rows ------------------------------------------------------------------------------------
def read_test_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line, row) of a JSONL file of test rows, each checked as an upload's rows are; bad lines
    are a TrainError ``invalid_file`` naming them."""
    from engine.data.jsonl import parse_jsonl_lines

    rows, errors = parse_jsonl_lines(path.read_bytes())
    if errors:
        raise TrainError("invalid_file", f"{path}: {'; '.join(errors)}")
    return rows


def task_rows(task: str, size: int, seed: int | None,
              manifest: dict[str, Any]) -> tuple[list[tuple[None, dict[str, Any]]], str]:
    """``size`` questions of a reasoning-gym task as test rows (each row the task's entry, its
    question the prompt), and what they are. Where the adapter trained on that task (its manifest's
    ``dataset``), they come with its config, from another seed (one past its own unless ``seed``),
    and without the questions it trained on (its whole dataset: the held-out ones included). A task
    that cannot be built, or whose every question it trained on, is a ValueError."""
    from engine.data.builtin import reasoning_gym_entries

    trained = manifest.get("dataset") if isinstance(manifest.get("dataset"), dict) else None
    trained = trained if trained is not None and trained.get("task") == task else None
    job_seed = int(manifest.get("seed") or 0)
    first = int(trained.get("seed", job_seed)) if trained is not None else job_seed
    try:
        seen = {e["question"] for e in reasoning_gym_entries(trained, job_seed)[0]} if trained is not None else set()
        record = {"source": "reasoning_gym", "task": task, "size": size + len(seen),
                  "seed": first + 1 if seed is None else seed,
                  **({"config": trained["config"]} if trained is not None and trained.get("config") else {})}
        entries, _ = reasoning_gym_entries(record, 0)
    except TrainError as exc:
        raise ValueError(str(exc).replace("data.dataset.", "")) from None
    fresh: list[dict[str, Any]] = []
    skipped = 0
    for e in entries:
        if len(fresh) == size:
            break
        if e["question"] in seen:
            skipped += 1
        else:
            fresh.append(e)
    if not fresh:
        raise ValueError(f"every one of the {len(entries)} questions of {task} that seed {record['seed']} gives is "
                         f"among the {len(seen)} the adapter trained on: with its config the task has too few "
                         "questions to hold any out; give a file of test rows")
    said = f"questions of reasoning-gym's {task} (seed {record['seed']})"
    if trained is not None:
        said += f", {skipped} that the adapter trained on left out"
    return [(None, {"prompt": e["question"], **e}) for e in fresh], said


def framed_chat(row: dict[str, Any], system: str | None, framing: list[dict[str, str]]) -> list[dict[str, str]]:
    """The chat for a row of a prompts file (checked by engine.data.jsonl.row_problem): a plain
    ``prompt`` comes after ``framing`` (the turns training put before its questions), whose system
    turn ``system`` replaces; ``messages`` (OpenAI's chat format) are sent as given, with ``system``
    first where they have no system turn."""
    from engine.data.prompts import row_messages

    if "prompt" not in row:
        return row_messages(row, system_prompt=system, one_shot=False)
    head = [{"role": "system", "content": system}] if system else []
    rest = [m for m in framing if m.get("role") != "system"]
    return [*(head or [m for m in framing if m.get("role") == "system"]), *rest,
            {"role": "user", "content": row["prompt"]}]


def framed_examples(rows: list[tuple[int | None, dict[str, Any]]], manifest: dict[str, Any], system: str | None = None,
                  framing: bool = True) -> list[Example]:
    """The test rows as one adapter's training asked its questions (its manifest's prompt framing;
    ``framing`` False: as given)."""
    from engine.data.load import Example

    turns = _framing_turns(manifest) if framing else []
    return [Example(framed_chat(row, system, turns), row, line) for line, row in rows]




def check_examples(scorer: Any, examples: list[Example], where: str) -> None:
    """A TrainError ``invalid_file`` where ``scorer`` cannot grade every example (a field it reads
    that a row lacks), before any model loads; ``where`` names the rows in the message."""
    from engine.evaluate import examples_problem

    problem = examples_problem(scorer, examples, where)
    if problem:
        raise TrainError("invalid_file", problem)


# -- the model -----------------------------------------------------------------------------------
def load_adapted(adapter: Path, base: str | None, quantization: str | None,
                 device: str) -> tuple[Any, Any, str, str, torch.device]:
    """(model, tokenizer, base model, format, device): the adapter attached to its base (the one its
    manifest names unless ``base``), held in the format it trained in unless ``quantization``.
    AdapterOptionError for a choice that cannot work, AdapterLoadError where loading fails."""
    base_model, fmt = _load_choices(adapter, base, quantization)
    dev = _device(device)
    return (*_load(adapter, base_model, fmt, dev), base_model, fmt, dev)


def _load_choices(adapter: Path, base: str | None, quantization: str | None) -> tuple[str, str]:
    from engine.spec import QUANTIZATIONS

    trained_base, trained_format, _ = adapter_facts(adapter)
    base_model = base or trained_base
    if not base_model:
        raise AdapterOptionError("base", f"{adapter} does not name its base model")
    fmt = quantization or trained_format
    if fmt not in QUANTIZATIONS:
        raise AdapterOptionError("quantization", f"choose one of {', '.join(QUANTIZATIONS)}; got {fmt!r}")
    return base_model, fmt


def _device(device: str) -> torch.device:
    from engine.train_loop import pick_device

    try:
        return pick_device(device)
    except (TrainError, RuntimeError) as exc:
        raise AdapterOptionError("device", str(exc)) from exc


def _load(adapter: Path, base_model: str, fmt: str, dev: torch.device) -> tuple[Any, Any]:
    import torch

    from engine.lora import load_peft_adapter, peft_lora_spec
    from engine.model import load_model
    from engine.model.load import compute_dtype

    try:
        model, tokenizer = load_model(base_model, quantization=fmt, lora=peft_lora_spec(adapter), device=dev,
                                      dtype=compute_dtype(dev), source_dtype=torch.bfloat16)
        load_peft_adapter(model, adapter)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise AdapterLoadError(base_model, adapter, str(exc)) from exc
    return model, tokenizer


# -- scoring -------------------------------------------------------------------------------------
def score_model(model: Any, tokenizer: Any, ids: list[list[int]], items: list[dict[str, Any]], scorer: Any,
                params: Any, max_batch: int, should_stop: Callable[[], bool] | None = None) -> Scored | None:
    """The model's greedy completions of the prompts ``ids``, graded against ``items``; None when
    ``should_stop`` cut decoding short. A row the grader cannot read is a TrainError."""
    from engine.evaluate import grade, greedy_completions, metrics_of

    completions = greedy_completions(model, tokenizer, ids, params, max_batch=max_batch, should_stop=should_stop)
    if completions is None:
        return None
    scores, parts, correct = grade(scorer, completions, items)
    return Scored(completions, scores, parts, metrics_of(completions, scores, parts, correct))


def score_adapter(adapter: Path, examples: list[Example], scorer: Any, params: Any, max_batch: int, *,
                  base: str | None, quantization: str | None, device: str, with_base: bool,
                  should_stop: Callable[[], bool] | None = None
                  ) -> tuple[Scored, Scored | None, dict[str, Any]] | None:
    """(the adapter's graded completions, the base alone's where ``with_base``, where it ran:
    model, quantization, device), or None when ``should_stop`` cut it short. The model is
    released (and the CUDA cache emptied) before this returns."""
    from engine.lora import lora_disabled
    from engine.train_batch import apply_chat_template

    model, tokenizer, base_model, fmt, dev = load_adapted(adapter, base, quantization, device)
    try:
        ids = [apply_chat_template(tokenizer, ex.messages) for ex in examples]
        items = [ex.item for ex in examples]
        tuned = score_model(model, tokenizer, ids, items, scorer, params, max_batch, should_stop)
        alone = None
        if tuned is not None and with_base:
            with lora_disabled(model):
                alone = score_model(model, tokenizer, ids, items, scorer, params, max_batch, should_stop)
    finally:
        del model
        _release(dev)
    if tuned is None or (with_base and alone is None):
        return None
    return tuned, alone, {"model": base_model, "quantization": fmt, "device": str(dev)}


def _release(dev: torch.device) -> None:
    """Hand a dropped model's memory back before the next one loads."""
    import gc

    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def row_records(ref: str, examples: list[Example], tuned: Scored, alone: Scored | None) -> list[dict[str, Any]]:
    """Each test row's answer and reward with the adapter ``ref`` (and the base alone's)."""
    out = []
    for i, ex in enumerate(examples):
        c = tuned.completions[i]
        r: dict[str, Any] = {"adapter": ref, "index": i, "line": ex.line, "messages": ex.messages, "completion": c.text,
                             "reward": tuned.scores[i], "scores": tuned.parts[i], "finish_reason": c.finish_reason,
                             "tokens": len(c.token_ids)}
        if alone is not None:
            b = alone.completions[i]
            r.update(base_completion=b.text, base_reward=alone.scores[i], base_finish_reason=b.finish_reason,
                     base_tokens=len(b.token_ids))
        out.append(r)
    return out


def evaluate_adapter(adapter: Path, rows: list[tuple[int | None, dict[str, Any]]], *,
                     grader: dict[str, Any] | None = None, max_new_tokens: int | None = None, device: str = "auto",
                     compare: bool = True, ref: str = "", where: str = "the test rows",
                     should_stop: Callable[[], bool] | None = None) -> AdapterScore | None:
    """The adapter in ``adapter`` scored on ``rows`` ((line, row) pairs, as read_test_rows gives),
    graded by ``grader`` or the one it trained with, beside the base alone where ``compare``;
    None when ``should_stop`` cut it short. The rows are checked before the model loads
    (TrainError ``invalid_file``, naming ``where`` and the line); a grader that cannot be built,
    or none known, is a ValueError."""
    from engine.rewards import build_grader

    manifest = read_manifest(adapter)
    config = grader if grader is not None else recorded_grader(manifest)
    if config is None:
        raise ValueError(f"the manifest of {adapter} records no grader (adapters trained before qerl recorded "
                         "it); give the job's grader")
    scorer = build_grader(config)
    if not rows:
        raise TrainError("invalid_file", f"{where}: no rows; give at least one")
    examples = framed_examples(rows, manifest)
    check_examples(scorer, examples, where)
    params, max_batch = decoding(manifest, max_new_tokens)
    got = score_adapter(adapter, examples, scorer, params, max_batch, base=None, quantization=None, device=device,
                        with_base=compare, should_stop=should_stop)
    if got is None:
        return None
    tuned, alone, facts = got
    return AdapterScore(model=facts["model"], quantization=facts["quantization"], device=facts["device"],
                        max_new_tokens=params.max_new_tokens, grader=scorer.name, rows=len(rows),
                        fine_tuned=tuned.metrics, base=alone.metrics if alone is not None else None,
                        records=row_records(ref, examples, tuned, alone))
