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
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from qerl.cli_client import ApiKey, BaseUrl, _errors_as_messages
from qerl.cli_generate import (SERVER_REFS, Base, Device, Framing, Quantization, System, adapter_errors,
                                adapter_facts, adapter_manifest, read_rows, resolve_adapter)
from qerl.jobbody import load_spec
from qerl.term import rule, stdout_console

if TYPE_CHECKING:
    from engine.score import Scored

console = stdout_console()
SHOWN_CHARS = 200


def _grader_config(grader: str | None, manifests: list[dict[str, Any]], refs: list[str]) -> dict[str, Any]:
    """--grader, or the grader the adapters trained with (the same for all of them)."""
    if grader is not None:
        return load_spec(grader, 'a grader such as {"type": "string_check", "input": "{{sample.output_text}}", ...}')
    recorded = [m.get("grader") for m in manifests]
    if not all(isinstance(g, dict) for g in recorded):
        ref = refs[next(i for i, g in enumerate(recorded) if not isinstance(g, dict))]
        raise typer.BadParameter(f"the manifest of {ref} records no grader (adapters trained before qerl recorded it); "
                                 "give the job's grader as a JSON or YAML file", param_hint="--grader")
    if any(g != recorded[0] for g in recorded):
        raise typer.BadParameter(f"the adapters trained with different graders ({', '.join(refs)}); give the one to "
                                 "score them all with", param_hint="--grader")
    return recorded[0]


def _table(columns: list[tuple[str, dict[str, float]]], alone: dict[str, float] | None) -> Table:
    """The metrics per adapter, and the base alone's; with one adapter, the change it makes."""
    first = columns[0][1]
    keys = ["eval/accuracy", "eval/reward_mean", *sorted(k for k in first if k.startswith("eval/reward/")),
            "eval/completion_len_mean", "eval/truncated_frac"]
    change = alone is not None and len(columns) == 1
    table = Table("metric", *(name for name, _ in columns), *(["base alone"] if alone is not None else []),
                  *(["change"] if change else []))
    for k in keys:
        cells = [f"{m[k]:.3f}" for _, m in columns]
        if alone is not None:
            cells.append(f"{alone[k]:.3f}")
        if change and alone is not None:
            cells.append(f"{first[k] - alone[k]:+.3f}")
        table.add_row(k.removeprefix("eval/").replace("reward/", "reward: "), *cells)
    return table


def _show(rows: list[dict[str, Any]], title: str) -> None:
    if not rows:
        return
    rule(console, title)
    for r in rows:
        question = " ".join(r["messages"][-1]["content"].split())[-SHOWN_CHARS:]
        where = f"line {r['line']}" if r["line"] is not None else f"question {r['index'] + 1}"
        console.print(f"[dim]{where}:[/] {escape(question)}")
        for label, key, reward in (("fine-tuned", "completion", "reward"), ("base alone", "base_completion",
                                                                            "base_reward")):
            text = " ".join(r[key].split())[:SHOWN_CHARS]
            console.print(f"  {label} (reward {r[reward]:.2f}): {escape(text)}")


@_errors_as_messages
def eval_cmd(
    adapter_refs: Annotated[Optional[list[str]], typer.Argument(
        metavar="ADAPTER...", help="one or more adapters: a directory (qerl adapters download, qerl train), or from "
        "the server a job id (ftjob-...), an adapter id or a fine-tuned model (ft:...)")] = None,
    file: Annotated[Optional[Path], typer.Option(
        "--file", "-f", exists=True, dir_okay=False,
        help="the test rows as JSON lines, as a training file: {\"prompt\": ...} or {\"messages\": [...]} "
        "plus the fields the grader reads")] = None,
    task: Annotated[Optional[str], typer.Option(
        help="instead of --file: fresh questions of this reasoning-gym task (e.g. products), those the adapter "
        "trained on left out; graded by the task's own score_answer unless --grader")] = None,
    size: Annotated[int, typer.Option(min=1, max=100_000, help="with --task: how many questions")] = 50,
    seed: Annotated[Optional[int], typer.Option(
        help="with --task: the questions' seed (default: one past the seed the adapter's questions came from)")] = None,
    sweep: Annotated[Optional[str], typer.Option(
        help="also every succeeded job of this sweep (qerl jobs create --sweep), oldest first")] = None,
    grader: Annotated[Optional[str], typer.Option(
        help="the grader as a JSON or YAML file (default: the one the adapters trained with, from their "
        "manifests)")] = None,
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
    show: Annotated[int, typer.Option(min=0, help="print this many answers that improved most (and got worse), "
                                                   "for one adapter")] = 3,
    device: Device = "auto",
    output: Annotated[Optional[Path], typer.Option(
        dir_okay=False, help="write every row's answers and rewards here, as JSON lines")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="the scores as JSON, a line per adapter")] = False,
    on_server: Annotated[bool, typer.Option(
        "--on-server", help="score on the server's workers (their GPU) instead of here: an evaluation per adapter "
        "(POST /v1/evaluations) of --file, uploaded, or of --task's questions")] = False,
    base_url: BaseUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Score fine-tuned adapters on a test file with a grader (greedy), beside their base alone."""
    from engine.rewards import build_grader
    from engine.score import check_examples, decoding, framed_examples, row_records
    from engine.types import TrainError

    if (file is None) == (task is None):  # before any adapter is looked up or downloaded
        raise typer.BadParameter("give the test rows: --file test.jsonl, or --task NAME for fresh questions of a "
                                 "reasoning-gym task (not both)", param_hint="--file")
    if on_server:
        _check_on_server(adapter_refs or [], system, framing, base, quantization, checkpoint, device)
    refs = _refs(adapter_refs or [], sweep, base_url, api_key)
    if on_server:
        questions = {"task": task, "size": size, **({"seed": seed} if seed is not None else {})} if task else None
        return _eval_on_server(refs, file, questions, grader, limit, max_new_tokens, compare, show, output, as_json,
                               base_url, api_key)
    if checkpoint is not None and len(refs) > 1:
        raise typer.BadParameter("--checkpoint picks a checkpoint of one job: give one ADAPTER",
                                 param_hint="--checkpoint")
    adapters = [resolve_adapter(ref, checkpoint, base_url, api_key) for ref in refs]
    manifests = [adapter_manifest(a) for a in adapters]
    _same_base(refs, adapters, base, quantization)
    try:
        scorer = build_grader(_grader_config(grader, manifests, refs))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--grader") from None
    if file is not None:
        rows, source = read_rows(file, "--file")[:limit], f"rows of {file}"
    else:
        rows, source = _task_rows(task or "", size, seed, manifests[0])
        rows = rows[:limit]
    params, max_batch = decoding(manifests[0], max_new_tokens)
    asks = [framed_examples(rows, m, system, framing) for m in manifests]
    try:
        check_examples(scorer, asks[0], str(file) if file is not None else f"--task {task}")
    except TrainError as exc:
        raise typer.BadParameter(str(exc), param_hint="--file") from None

    results: list[dict[str, Any]] = []
    alone: Scored | None = None
    for ref, adapter, examples in zip(refs, adapters, asks):
        scored, alone_here, facts = _score_adapter(adapter, examples, scorer, params, max_batch, base=base,
                                                   quantization=quantization, device=device,
                                                   with_base=compare and alone is None)
        alone = alone or alone_here
        results.append({"ref": ref, "adapter": adapter, "examples": examples, "scored": scored, **facts})
    per_row = [r for res in results for r in row_records(res["ref"], res["examples"], res["scored"], alone)]
    lines = [{"adapter": str(res["adapter"]), "ref": res["ref"], "model": res["model"],
              "quantization": res["quantization"], "device": res["device"],
              "file": str(file) if file is not None else None, "task": task, "rows": len(rows),
              "max_new_tokens": params.max_new_tokens, "grader": scorer.name,
              "fine_tuned": _plain(res["scored"].metrics), "base": _plain(alone.metrics) if alone is not None else None}
             for res in results]
    where = f"the adapter in {results[0]['adapter']}" if len(results) == 1 else f"{len(results)} adapters"
    _report(lines, per_row, source, where, results[0]["device"], show, output, as_json)


def _report(lines: list[dict[str, Any]], per_row: list[dict[str, Any]], source: str, where: str, on: str, show: int,
            output: Path | None, as_json: bool) -> None:
    """The scores, a local run's or the server's: every row to ``output``; a JSON line per adapter,
    or the table, the answers that changed most and what was scored."""
    if output is not None:
        output.write_text("".join(json.dumps(r) + "\n" for r in per_row))
    if as_json:
        for line in lines:
            print(json.dumps(line), flush=True)
        return
    first = lines[0]
    _print_scores([(line["ref"], _prefixed(line["fine_tuned"])) for line in lines],
                  _prefixed(first["base"]) if first["base"] is not None else None, per_row, show)
    console.print(f"[dim]{first['rows']} {escape(source)}, greedy, at most {first['max_new_tokens']} new tokens; "
                  f"{escape(first['model'])} ({first['quantization']}) with {escape(where)}, on {escape(on)}; graded "
                  f"by {escape(str(first['grader']))}[/]")
    if output is not None:
        console.print(f"[dim]every row's answers and rewards: {escape(str(output))}[/]")


def _print_scores(columns: list[tuple[str, dict[str, float]]], alone: dict[str, float] | None,
                  first_rows: list[dict[str, Any]], show: int) -> None:
    """The table of ``eval/*`` metrics per adapter (and the base alone's), then, for one adapter,
    the answers that improved most and those that got worse."""
    named = [(_short(ref) if len(columns) > 1 else "fine-tuned", m) for ref, m in columns]
    console.print(_table(named, alone))
    if alone is not None and show and len(columns) == 1:
        changed = sorted((r for r in first_rows if r["reward"] != r["base_reward"]),
                         key=lambda r: r["base_reward"] - r["reward"])  # most improved first
        _show([r for r in changed if r["reward"] > r["base_reward"]][:show], "improved most with the adapter")
        _show([r for r in reversed(changed) if r["reward"] < r["base_reward"]][:show], "worse with the adapter")


def _check_on_server(given: list[str], system: str | None, framing: bool, base: str | None,
                     quantization: str | None, checkpoint: int | None, device: str) -> None:
    """--on-server scores the adapters as they trained, on the server's device."""
    local = [ref for ref in given if not ref.startswith(SERVER_REFS)]
    for wrong, option, fix in ((bool(local), "ADAPTER", f"{', '.join(local)} is not on the server: give a job id, "
                                                        "adapter id or ft: model, or leave out --on-server"),
                               (checkpoint is not None, "--checkpoint", "give the checkpoint's name "
                                                                        "(ft:...:ckpt-step-N) as ADAPTER"),
                               (system is not None or not framing, "--system", "rows are asked as training asked"),
                               (base is not None or quantization is not None, "--base",
                                "the server holds the base the adapter trained on, in its format"),
                               (device != "auto", "--device", "the server's workers choose theirs")):
        if wrong:
            raise typer.BadParameter(f"{option} does not go with --on-server: {fix}", param_hint=option)


def _eval_on_server(refs: list[str], file: Path | None, questions: dict[str, Any] | None, grader: str | None,
                    limit: int | None, max_new_tokens: int | None, compare: bool, show: int, output: Path | None,
                    as_json: bool, base_url: str | None, api_key: str | None) -> None:
    """--on-server: the evaluations' numbers and rows, printed as a local run's."""
    from qerl.cli_client import err
    from qerl.cli_eval_server import score_on_server

    config = load_spec(grader, 'a grader such as {"type": "string_check", ...}') if grader is not None else None
    scores = score_on_server(refs, file, questions, config, limit=limit, max_new_tokens=max_new_tokens, compare=compare,
                             base_url=base_url, api_key=api_key, say=lambda m: err.print(f"[dim]{escape(m)}[/]"))
    lines = []
    for score in scores:
        res = score.evaluation["result"]
        lines.append({"evaluation": score.evaluation["id"], "ref": score.ref, "model": res["base_model"],
                      "quantization": res["quantization"], "device": res["device"],
                      "file": str(file) if file is not None else None,
                      "task": questions["task"] if questions else None, "rows": res["rows"],
                      "max_new_tokens": res["max_new_tokens"], "grader": res["grader"],
                      "fine_tuned": res["fine_tuned"], "base": scores[0].evaluation["result"]["base"]})
    source = f"rows of {file}" if file is not None else f"questions of reasoning-gym's {(questions or {})['task']}"
    _report(lines, [r for score in scores for r in score.rows], source,
            scores[0].ref if len(scores) == 1 else f"{len(scores)} adapters", f"the server ({lines[0]['device']})",
            show, output, as_json)


def _prefixed(m: dict[str, float]) -> dict[str, float]:
    return {f"eval/{k}": v for k, v in m.items()}


def _refs(given: list[str], sweep: str | None, base_url: str | None, api_key: str | None) -> list[str]:
    """The adapters named, then the succeeded jobs of ``sweep`` not among them (oldest first)."""
    from qerl.client import Client

    refs = list(dict.fromkeys(given))
    if sweep is not None:
        with Client(base_url=base_url, api_key=api_key) as client:
            jobs = list(reversed(client.all_jobs({"sweep": sweep})))
        done = [j["id"] for j in jobs if j["status"] == "succeeded" and j["id"] not in refs]
        if not done:
            raise typer.BadParameter(f"sweep {sweep} has no succeeded job yet ({len(jobs)} job(s): qerl jobs list "
                                     f"--metadata sweep={sweep})", param_hint="--sweep")
        refs += done
    if not refs:
        raise typer.BadParameter("give an ADAPTER (a directory, job id, adapter id or ft: model) or --sweep ID",
                                 param_hint="ADAPTER")
    return refs


def _task_rows(task: str, size: int, seed: int | None,
               manifest: dict[str, Any]) -> tuple[list[tuple[None, dict[str, Any]]], str]:
    """engine.score.task_rows, its errors said as --task's."""
    from engine.score import task_rows

    try:
        return task_rows(task, size, seed, manifest)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--task") from None


def _same_base(refs: list[str], adapters: list[Path], base: str | None, quantization: str | None) -> None:
    """Adapters scored side by side share the base and format they are held in (the base alone is one)."""
    facts = [adapter_facts(a) for a in adapters]
    if len({(base or b, quantization or q) for b, q, _ in facts}) > 1:
        said = "; ".join(f"{ref}: {b} ({q})" for ref, (b, q, _) in zip(refs, facts))
        raise typer.BadParameter(f"the adapters train different bases or formats ({said}); score them one base at "
                                 "a time", param_hint="ADAPTER")


def _score_adapter(adapter: Path, examples: list[Any], scorer: Any, params: Any, max_batch: int, *,
                   base: str | None, quantization: str | None, device: str,
                   with_base: bool) -> tuple[Scored, Scored | None, dict[str, Any]]:
    """engine.score.score_adapter, its errors said on the command line (a row the grader cannot
    read: its code and message, exit code 2)."""
    from engine.score import score_adapter
    from engine.types import TrainError

    try:
        with adapter_errors():
            got = score_adapter(adapter, examples, scorer, params, max_batch, base=base, quantization=quantization,
                                device=device, with_base=with_base)
    except TrainError as exc:
        console.print(f"[red]{exc.code}: {escape(str(exc))}[/]")
        raise typer.Exit(2) from None
    assert got is not None  # nothing asks it to stop
    return got


def _short(ref: str) -> str:
    """A column's name: the job, adapter or model as given, a directory by its last part."""
    return ref if ref.startswith(SERVER_REFS) else Path(ref).name or ref


def _plain(m: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("eval/"): v for k, v in m.items()}


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
