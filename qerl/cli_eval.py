"""`qerl eval ADAPTER --file test.jsonl`: score a fine-tuned adapter on a test file of your own,
beside its base model alone, as the job's held-out evaluation scores it.

Each row gets one greedy completion with the adapter attached (no AQN noise) and one from the
base alone, both graded by the grader the adapter trained with (its manifest records it) or
``--grader``. A row is asked as training asked its questions (engine.data.prompts): a plain
``prompt`` after the turns training put before them, ``messages`` as given. The rows are checked
before the model loads (a bad line, a field the grader reads that a row lacks), and the numbers
are the job's ``eval/*`` metrics: accuracy, reward and its parts, completion length, the share
cut by ``--max-new-tokens``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from qerl.cli_client import ApiKey, BaseUrl, _errors_as_messages
from qerl.cli_generate import (AdapterRef, Base, Device, Framing, Quantization, System, adapter_manifest, framed_chat,
                                load_adapted, read_rows, resolve_adapter)
from qerl.jobbody import load_spec
from qerl.term import rule, stdout_console

console = stdout_console()
SHOWN_CHARS = 200


def _grader_config(grader: str | None, manifest: dict[str, Any], adapter: Path) -> dict[str, Any]:
    if grader is not None:
        return load_spec(grader, 'a grader such as {"type": "string_check", "input": "{{sample.output_text}}", ...}')
    recorded = manifest.get("grader")
    if not isinstance(recorded, dict):
        raise typer.BadParameter(f"the manifest in {adapter} records no grader (adapters trained before qerl recorded "
                                 "it); give the job's grader as a JSON or YAML file", param_hint="--grader")
    return recorded


def _table(tuned: dict[str, float], alone: dict[str, float] | None) -> Table:
    keys = ["eval/accuracy", "eval/reward_mean", *sorted(k for k in tuned if k.startswith("eval/reward/")),
            "eval/completion_len_mean", "eval/truncated_frac"]
    table = Table("metric", "fine-tuned", *(["base alone", "change"] if alone is not None else []))
    for k in keys:
        name = k.removeprefix("eval/").replace("reward/", "reward: ")
        cells = [f"{tuned[k]:.3f}"]
        if alone is not None:
            cells += [f"{alone[k]:.3f}", f"{tuned[k] - alone[k]:+.3f}"]
        table.add_row(name, *cells)
    return table


def _show(rows: list[dict[str, Any]], title: str) -> None:
    if not rows:
        return
    rule(console, title)
    for r in rows:
        question = " ".join(r["messages"][-1]["content"].split())[-SHOWN_CHARS:]
        console.print(f"[dim]line {r['line']}:[/] {escape(question)}")
        for label, key, reward in (("fine-tuned", "completion", "reward"), ("base alone", "base_completion",
                                                                            "base_reward")):
            text = " ".join(r[key].split())[:SHOWN_CHARS]
            console.print(f"  {label} (reward {r[reward]:.2f}): {escape(text)}")


@_errors_as_messages
def eval_cmd(
    adapter_ref: AdapterRef,
    file: Annotated[Path, typer.Option(
        "--file", "-f", exists=True, dir_okay=False,
        help="the test rows as JSON lines, as a training file: {\"prompt\": ...} or {\"messages\": [...]} "
        "plus the fields the grader reads")],
    grader: Annotated[Optional[str], typer.Option(
        help="the grader as a JSON or YAML file (default: the one the adapter trained with, from its manifest)")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="score the first N rows only")] = None,
    system: System = None,
    framing: Framing = True,
    base: Base = None,
    quantization: Quantization = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        min=1, max=32768, help="the longest answer (default: the rollouts' limit in training)")] = None,
    checkpoint: Annotated[Optional[int], typer.Option(
        help="from the server: the LoRA at this checkpoint step of the job instead of its final adapter")] = None,
    compare: Annotated[bool, typer.Option(help="also score the base model alone")] = True,
    show: Annotated[int, typer.Option(min=0, help="print this many answers that improved most (and got worse)")] = 3,
    device: Device = "auto",
    output: Annotated[Optional[Path], typer.Option(
        dir_okay=False, help="write every row's answers and rewards here, as JSON lines")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="the scores as one JSON object")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Score a fine-tuned adapter on a test file with a grader (greedy), beside the base alone."""
    from engine.data.load import Example
    from engine.evaluate import examples_problem, grade, greedy_completions, metrics_of
    from engine.lora import lora_disabled
    from engine.rewards import build_grader
    from engine.rollout.params import SamplingParams
    from engine.train_batch import apply_chat_template
    from engine.types import TrainError

    adapter = resolve_adapter(adapter_ref, checkpoint, base_url, api_key)
    manifest = adapter_manifest(adapter)
    try:
        scorer = build_grader(_grader_config(grader, manifest, adapter))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--grader") from None
    trained_framing = manifest.get("prompt_framing") if framing else []
    trained_framing = [m for m in trained_framing if isinstance(m, dict)] if isinstance(trained_framing, list) else []
    rows = read_rows(file, "--file")[:limit]
    examples = [Example(framed_chat(row, system, trained_framing), row, line) for line, row in rows]
    problem = examples_problem(scorer, examples, str(file))
    if problem:
        raise typer.BadParameter(problem, param_hint="--file")
    rollout = manifest.get("rollout") if isinstance(manifest.get("rollout"), dict) else {}
    params = SamplingParams(max_new_tokens=max_new_tokens or int(rollout.get("max_new_tokens") or 256))
    max_batch = int(rollout.get("max_batch") or 64)

    model, tokenizer, base_model, fmt, dev = load_adapted(adapter, base, quantization, device)
    ids = [apply_chat_template(tokenizer, ex.messages) for ex in examples]
    items = [ex.item for ex in examples]

    def score() -> tuple[list[Any], list[float], list[dict[str, float]], dict[str, float]]:
        completions = greedy_completions(model, tokenizer, ids, params, max_batch=max_batch)
        assert completions is not None  # nothing asks it to stop
        try:
            scores, parts, correct = grade(scorer, completions, items)
        except TrainError as exc:
            console.print(f"[red]{exc.code}: {escape(str(exc))}[/]")
            raise typer.Exit(2) from None
        return completions, scores, parts, metrics_of(completions, scores, parts, correct)

    tuned, tuned_scores, tuned_parts, tuned_metrics = score()
    alone = alone_scores = alone_metrics = None
    if compare:
        with lora_disabled(model):
            alone, alone_scores, _, alone_metrics = score()
    per_row = []
    for i, ex in enumerate(examples):
        r: dict[str, Any] = {"line": ex.line, "messages": ex.messages, "completion": tuned[i].text,
                             "reward": tuned_scores[i], "scores": tuned_parts[i],
                             "finish_reason": tuned[i].finish_reason, "tokens": len(tuned[i].token_ids)}
        if alone is not None and alone_scores is not None:
            r.update(base_completion=alone[i].text, base_reward=alone_scores[i],
                     base_finish_reason=alone[i].finish_reason, base_tokens=len(alone[i].token_ids))
        per_row.append(r)
    if output is not None:
        output.write_text("".join(json.dumps(r) + "\n" for r in per_row))

    def plain(m: dict[str, float] | None) -> dict[str, float] | None:
        return {k.removeprefix("eval/"): v for k, v in m.items()} if m is not None else None

    summary = {"adapter": str(adapter), "model": base_model, "quantization": fmt, "file": str(file),
               "rows": len(examples), "max_new_tokens": params.max_new_tokens, "grader": scorer.name,
               "fine_tuned": plain(tuned_metrics), "base": plain(alone_metrics)}
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    console.print(_table(tuned_metrics, alone_metrics))
    if alone is not None and show:
        changed = sorted((r for r in per_row if r["reward"] != r["base_reward"]),
                         key=lambda r: r["base_reward"] - r["reward"])  # most improved first
        _show([r for r in changed if r["reward"] > r["base_reward"]][:show], "improved most with the adapter")
        _show([r for r in reversed(changed) if r["reward"] < r["base_reward"]][:show], "worse with the adapter")
    console.print(f"[dim]{len(examples)} rows of {escape(str(file))}, greedy, at most {params.max_new_tokens} new "
                  f"tokens; {escape(base_model)} ({fmt}) with the adapter in {adapter}, on {dev}; "
                  f"graded by {escape(str(scorer.name))}[/]")
    if output is not None:
        console.print(f"[dim]every row's answers and rewards: {escape(str(output))}[/]")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
