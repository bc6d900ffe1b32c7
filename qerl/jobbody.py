"""The POST /v1/fine_tuning/jobs body from a spec file (JSON or YAML) and command-line flags.

Precedence: the spec file, then the named flags, then ``--set a.b.c=VALUE`` overrides. Named
flags map to the ``qerl`` extension object by TrainSpec's field names (``qerl.rollout.num_generations``).
``--sweep a.b.c=[V1, V2]`` makes one body per value (per combination, for several).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


JOB_BODY = 'a job body such as {"model": ..., "training_file": ..., "qerl": {...}}'
MAX_SWEEP = 64  # jobs one --sweep may create


def load_spec(path: str, what: str = JOB_BODY) -> dict[str, Any]:
    """A job body (or ``what`` else) from a JSON or YAML file (``-``: stdin). YAML needs PyYAML."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    is_yaml = path.endswith((".yaml", ".yml"))
    if not is_yaml:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            if path.endswith(".json"):
                raise ValueError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
            is_yaml = True
    if is_yaml:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the spec as JSON") from None
        try:
            body = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: invalid YAML ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError(f"{path}: the spec must be an object ({what})")
    return body


def _parse_value(text: str) -> Any:
    """``--set`` values: JSON when they parse (numbers, true, [..], {..}), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def set_path(body: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_path(b, "qerl.rollout.temperature", 0.8)`` creating objects on the way."""
    keys = dotted.split(".")
    node = body
    for key in keys[:-1]:
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise ValueError(f"--set {dotted}: {key!r} is already a {type(nxt).__name__}, not an object")
        node = nxt
    node[keys[-1]] = value


def build_job_body(spec: dict[str, Any] | None, *, model: str | None, training_file: str | None,
                   validation_file: str | None, dataset: str | None, dataset_size: int | None,
                   grader: str | None, steps: int | None, prompts_per_step: int | None,
                   num_generations: int | None, max_new_tokens: int | None, learning_rate: float | None,
                   lora_r: int | None, quantization: str | None, algorithm: str | None, aqn: bool | None,
                   seed: int | None, suffix: str | None, metadata: list[str], overrides: list[str],
                   eval_interval: int | None = None, early_stop: int | None = None) -> dict[str, Any]:
    """The POST /v1/fine_tuning/jobs body: the spec file, then the flags, then ``--set`` overrides."""
    body: dict[str, Any] = json.loads(json.dumps(spec or {}))
    top = {"model": model, "training_file": training_file, "validation_file": validation_file,
           "seed": seed, "suffix": suffix}
    body.update({k: v for k, v in top.items() if v is not None})
    qerl_flags = {"steps": steps, "prompts_per_step": prompts_per_step, "quantization": quantization,
                  "rollout.num_generations": num_generations, "rollout.max_new_tokens": max_new_tokens,
                  "optim.lr": learning_rate, "lora.r": lora_r, "rl.algorithm": algorithm, "aqn.enabled": aqn,
                  "eval_interval": eval_interval, "early_stop_patience": early_stop}
    for key, value in qerl_flags.items():
        if value is not None:
            set_path(body, f"qerl.{key}", value)
    if dataset is not None:
        ds = {"source": "reasoning_gym", "task": dataset}
        if dataset_size is not None:
            ds["size"] = dataset_size
        set_path(body, "qerl.dataset", ds)
    if grader is not None:
        text = Path(grader[1:]).read_text() if grader.startswith("@") else grader
        try:
            grader_obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--grader must be a JSON object or @file.json ({exc.msg})") from None
        body.setdefault("method", {"type": "reinforcement"})
        set_path(body, "method.reinforcement.grader", grader_obj)
    for item in metadata:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: write KEY=VALUE")
        set_path(body, f"metadata.{key}", value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: write a.b.c=VALUE, e.g. qerl.rollout.temperature=0.8")
        set_path(body, key, _parse_value(value))
    if not body.get("model"):
        raise ValueError("no model: pass --model NAME (see GET /v1/models) or put \"model\" in the spec file")
    return body


def sweep_points(sweeps: list[str]) -> list[dict[str, Any]]:
    """``--sweep`` values as every combination of them: ``["qerl.optim.lr=[1e-5, 2e-5]",
    "qerl.lora.r=[8, 16]"]`` -> four {field: value} points, the first field varying slowest."""
    axes: list[tuple[str, list[Any]]] = []
    for item in sweeps:
        key, sep, text = item.partition("=")
        values = _parse_value(text) if sep else None
        if not key or not isinstance(values, list) or not values:
            raise ValueError(f"--sweep {item!r}: write a.b.c=[VALUE, ...], a JSON list, "
                             "e.g. qerl.optim.lr=[1e-5,2e-5]")
        if any(key == k for k, _ in axes):
            raise ValueError(f"--sweep {key} is given twice; put all its values in one list")
        axes.append((key, values))
    points: list[dict[str, Any]] = [{}]
    for key, values in axes:
        points = [{**p, key: v} for p in points for v in values]
    if len(points) > MAX_SWEEP:
        raise ValueError(f"--sweep makes {len(points)} jobs, more than {MAX_SWEEP}; sweep fewer values")
    return points


def sweep_bodies(body: dict[str, Any], points: list[dict[str, Any]], sweep_id: str) -> list[dict[str, Any]]:
    """One job body per point: ``body`` with the point's fields set, and metadata naming the sweep
    (``sweep``) and the point (``sweep_point``) so that `qerl jobs list --metadata sweep=ID` finds them."""
    out = []
    for point in points:
        b = json.loads(json.dumps(body))
        for key, value in point.items():
            set_path(b, key, value)
        set_path(b, "metadata.sweep", sweep_id)
        set_path(b, "metadata.sweep_point", ", ".join(f"{k}={json.dumps(v)}" for k, v in point.items())[:512])
        out.append(b)
    return out
