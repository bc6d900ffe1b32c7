"""`qerl files|jobs|adapters`: drive a qerl server from the terminal.

The server URL and API key come from ``--base-url`` / ``--api-key``, then ``QERL_BASE_URL`` /
``QERL_API_KEY``, then the local config the embedded server writes. Failures print the
server's own message (OpenAI's error shape) and exit 1; ``jobs watch`` exits 1 when the job
fails, 2 when it is cancelled and 3 when it is paused, so scripts can chain on it.
"""
from __future__ import annotations

import functools
import json
import secrets
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Column, Table

from qerl.client import Client, QerlError
from qerl.compare import results, settings, side_by_side, steps_done
from qerl.jobbody import build_job_body, load_spec, sweep_bodies, sweep_points
from qerl.term import stdout_console
from qerl.watch import follow_events, watch_job

out = stdout_console()
err = Console(stderr=True, soft_wrap=True, emoji=False)

WHOLE = ("id", "name", "job", "fine-tuned model")  # what a user copies into the next command


def _table(*headers: str) -> Table:
    """A table whose ids and names are never cut short: on a narrow terminal they fold inside their
    cell instead of ending in an ellipsis."""
    return Table(*(Column(h, overflow="fold") if h in WHOLE else h for h in headers))


BaseUrl = Annotated[Optional[str], typer.Option("--base-url", envvar="QERL_BASE_URL", show_envvar=True,
                                                help="server URL (default: the local config, else http://127.0.0.1:8000)")]
ApiKey = Annotated[Optional[str], typer.Option("--api-key", envvar="QERL_API_KEY", show_envvar=True,
                                               help="API key (default: the local config)")]
AsJson = Annotated[bool, typer.Option("--json", help="print the server's JSON instead of a table")]
EXIT_FAILED, EXIT_CANCELLED, EXIT_PAUSED = 1, 2, 3


# -- plumbing ----------------------------------------------------------------------------------
def _errors_as_messages(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the errors a user can act on into one line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except QerlError as exc:
            code = f" {exc.code}" if exc.code else ""
            err.print(f"[red]error[/] ({exc.status}{code}): {escape(exc.message)}")
        except httpx.ConnectError as exc:
            url = exc.request.url.copy_with(path="/", query=None) if exc.request else "the server"
            err.print(f"[red]error[/]: cannot reach the qerl server at {url} ({escape(str(exc))}); start it with "
                      "`qerl serve`, or pass --base-url / set QERL_BASE_URL")
        except httpx.HTTPError as exc:
            err.print(f"[red]error[/]: {type(exc).__name__}: {escape(str(exc))}")
        except (ValueError, OSError) as exc:
            err.print(f"[red]error[/]: {escape(str(exc))}")
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        raise typer.Exit(1)

    return wrapper


def _client(base_url: str | None, api_key: str | None) -> Client:
    return Client(base_url=base_url, api_key=api_key)


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False))


def _when(ts: int | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _size(n: int | None) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


STATUS_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "cancelling": "yellow",
                "running": "cyan", "queued": "blue", "validating_files": "blue", "pausing": "magenta",
                "paused": "magenta"}


def _status(s: str, job: dict[str, Any] | None = None) -> str:
    """A job's state, coloured; a queued job's with its place in the queue (#1: next)."""
    place = ((job or {}).get("qerl") or {}).get("queue_position") if s == "queued" else None
    return f"[{STATUS_STYLE.get(s, 'white')}]{s}[/]" + (f" #{place}" if place else "")


def _report_outcome(job: dict[str, Any]) -> None:
    status = job["status"]
    if status == "succeeded":
        p = (job.get("qerl") or {}).get("progress") or {}
        early = (f" after {p['step']} of {p['total_steps']} steps (stopped early: early_stop_patience)"
                 if p.get("stopped_early") else "")
        out.print(f"[green]Job {job['id']} succeeded[/]{early}: {escape(job.get('fine_tuned_model') or '')}")
        adapter = (job.get("qerl") or {}).get("adapter_id")
        if adapter:
            out.print(f"download the adapter: qerl adapters download {adapter} -o ./{adapter}")
        for f in job.get("result_files") or []:
            out.print(f"every step's metrics: qerl files download {f}")
        return
    if status == "paused":
        step = ((job.get("qerl") or {}).get("progress") or {})
        out.print(f"[magenta]Job {job['id']} paused[/] at step {step.get('step', 0)}/{step.get('total_steps', '?')}; "
                  f"resume it with: qerl jobs resume {job['id']}")
        raise typer.Exit(EXIT_PAUSED)
    e = job.get("error") or {}
    out.print(f"[red]Job {job['id']} {status}[/]" + (f": {e.get('code')}: {escape(str(e.get('message')))}" if e else ""))
    raise typer.Exit(EXIT_FAILED if status == "failed" else EXIT_CANCELLED)


def _event_line(ev: dict[str, Any]) -> str:
    level = ev.get("level", "info")
    color = {"warn": "yellow", "error": "red"}.get(level, "dim")
    return f"[dim]{_when(ev.get('created_at'))}[/] [{color}]{level:5}[/] {escape(str(ev.get('message', '')))}"


# -- commands ----------------------------------------------------------------------------------
files_app = typer.Typer(no_args_is_help=True, help="Upload, list, download and delete files.")
jobs_app = typer.Typer(no_args_is_help=True, help="Create, follow, pause, resume and cancel fine-tuning jobs.")
adapters_app = typer.Typer(no_args_is_help=True, help="List, download and delete trained LoRA adapters.")
models_app = typer.Typer(no_args_is_help=True, help="The base models a job can train, and this project's fine-tuned ones.")


@files_app.command("upload")
@_errors_as_messages
def files_upload(path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="a JSONL file")],
                 purpose: Annotated[str, typer.Option(help="OpenAI file purpose")] = "fine-tune",
                 base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """Upload a JSONL training or validation file; prints its id."""
    with _client(base_url, api_key) as client:
        f = client.upload_file(path, purpose)
    if as_json:
        return _print_json(f)
    q = f.get("qerl") or {}
    rows, prompts, fields = q.get("rows"), q.get("prompts"), q.get("fields")
    repeats = f" ({prompts} distinct prompts)" if prompts is not None and rows is not None and prompts < rows else ""
    out.print(f"[bold]{f['id']}[/]  {escape(f['filename'])}  {_size(f['bytes'])}"
              + (f"  {rows} rows{repeats}" if rows is not None else ""))
    if fields and rows:  # what {{item.<field>}} can read: a typo, or a field only some rows have, shows here
        out.print("fields: " + ", ".join(escape(k) + (f" (in {n} of {rows} rows)" if n < rows else "")
                                         for k, n in sorted(fields.items())), highlight=False)


@files_app.command("list")
@_errors_as_messages
def files_list(base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """The files of this key's project."""
    with _client(base_url, api_key) as client:
        files = client.files()
    if as_json:
        return _print_json(files)
    if not files:
        return out.print("no files yet (qerl files upload train.jsonl uploads one)", highlight=False)
    table = _table("id", "filename", "purpose", "size", "rows", "prompts", "created")
    for f in files:
        q = f.get("qerl") or {}
        table.add_row(f["id"], escape(f["filename"]), f["purpose"], _size(f["bytes"]), str(q.get("rows", "")),
                      str(q["prompts"]) if q.get("prompts") is not None else "-", _when(f.get("created_at")))
    out.print(table)


@files_app.command("download")
@_errors_as_messages
def files_download(file_id: Annotated[str, typer.Argument(help="file id: an upload, or a job's results file")],
                   output: Annotated[Optional[str], typer.Option(
                       "-o", "--output", help="where to write it (default: ./FILENAME; - for stdout)")] = None,
                   base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """Download a file, sha256-checked: a job's step_metrics.csv (its per-step metrics), or an upload."""
    with _client(base_url, api_key) as client:
        if output == "-":
            with tempfile.TemporaryDirectory() as tmp:
                sys.stdout.buffer.write(client.download_file(file_id, Path(tmp) / "content").read_bytes())
            return
        name = Path(client.get(f"/v1/files/{file_id}")["filename"]).name
        target = Path(output) if output else Path(name if name not in ("", ".", "..") else file_id)
        client.download_file(file_id, target)
    out.print(f"[green]sha256 verified[/] {file_id} written to {escape(str(target))}")


@files_app.command("delete")
@_errors_as_messages
def files_delete(file_id: str, base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """Delete a file (refused while an unfinished job uses it)."""
    with _client(base_url, api_key) as client:
        gone = client.delete_file(file_id)
    if as_json:
        return _print_json(gone)
    out.print(f"deleted {gone['id']}")


@jobs_app.command("create")
@_errors_as_messages
def jobs_create(
    spec: Annotated[Optional[str], typer.Argument(help="job body as a JSON or YAML file (- for stdin); flags override it")] = None,
    model: Annotated[Optional[str], typer.Option(help="base model (GET /v1/models)")] = None,
    training_file: Annotated[Optional[str], typer.Option(help="uploaded file id (qerl files upload)")] = None,
    validation_file: Annotated[Optional[str], typer.Option(help="uploaded file id for evaluation")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="a built-in reasoning-gym task instead of a file, e.g. products")] = None,
    dataset_size: Annotated[Optional[int], typer.Option(help="items generated for --dataset")] = None,
    grader: Annotated[Optional[str], typer.Option(help="grader as JSON or @file.json (OpenAI grader shapes)")] = None,
    steps: Annotated[Optional[int], typer.Option(help="optimizer steps")] = None,
    prompts_per_step: Annotated[Optional[int], typer.Option(help="prompts per step")] = None,
    num_generations: Annotated[Optional[int], typer.Option(help="samples per prompt (G)")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="rollout length limit")] = None,
    learning_rate: Annotated[Optional[float], typer.Option(help="LoRA learning rate")] = None,
    lora_r: Annotated[Optional[int], typer.Option(help="LoRA rank")] = None,
    quantization: Annotated[Optional[str], typer.Option(help="nvfp4, nf4 or bf16")] = None,
    algorithm: Annotated[Optional[str], typer.Option(help="grpo, dapo or dr_grpo")] = None,
    aqn: Annotated[Optional[bool], typer.Option("--aqn/--no-aqn", help="adaptive quantization noise")] = None,
    eval_interval: Annotated[Optional[int], typer.Option(help="evaluate the held-out prompts every N steps")] = None,
    early_stop: Annotated[Optional[int], typer.Option(
        help="end once N evaluations in a row are no better (qerl.early_stop_patience)")] = None,
    seed: Annotated[Optional[int], typer.Option()] = None,
    suffix: Annotated[Optional[str], typer.Option(help="added to the fine-tuned model name")] = None,
    metadata: Annotated[Optional[list[str]], typer.Option(help="KEY=VALUE, repeatable")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="any body field: a.b.c=VALUE (JSON value), repeatable")] = None,
    sweep: Annotated[Optional[list[str]], typer.Option(
        "--sweep", help="a.b.c=[V1,V2,...]: one job per value (per combination when repeated)")] = None,
    idempotency_key: Annotated[Optional[str], typer.Option(help="retries with the same key create one job")] = None,
    dry_run: Annotated[bool, typer.Option(help="print the body instead of sending it")] = False,
    watch: Annotated[bool, typer.Option(help="then follow it like `qerl jobs watch`")] = False,
    base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False,
) -> None:
    """Submit a fine-tuning job (OpenAI's body; qerl options under "qerl"), or a sweep of them."""
    body = build_job_body(load_spec(spec) if spec else None, model=model, training_file=training_file,
                          validation_file=validation_file, dataset=dataset, dataset_size=dataset_size,
                          grader=grader, steps=steps, prompts_per_step=prompts_per_step,
                          num_generations=num_generations, max_new_tokens=max_new_tokens,
                          learning_rate=learning_rate, lora_r=lora_r, quantization=quantization,
                          algorithm=algorithm, aqn=aqn, seed=seed, suffix=suffix, metadata=metadata or [],
                          overrides=set_ or [], eval_interval=eval_interval, early_stop=early_stop)
    if sweep:
        return _create_sweep(body, sweep_points(sweep), idempotency_key=idempotency_key, dry_run=dry_run,
                             watch=watch, base_url=base_url, api_key=api_key, as_json=as_json)
    if dry_run:
        return _print_json(body)
    with _client(base_url, api_key) as client:
        job = client.create_job(body, idempotency_key)
        if as_json:
            _print_json(job)
        else:
            out.print(f"[bold]{job['id']}[/] {_status(job['status'], job)}  {escape(job['model'])}  "
                      f"{job['qerl']['progress'].get('total_steps', '?')} steps")
        if watch:
            _report_outcome(watch_job(client, job["id"], out))


def _create_sweep(body: dict[str, Any], points: list[dict[str, Any]], *, idempotency_key: str | None,
                  dry_run: bool, watch: bool, base_url: str | None, api_key: str | None, as_json: bool) -> None:
    """Create one job per sweep point, all tagged with one sweep id; if the server refuses one, the
    jobs created before it are cancelled, so that a sweep is whole or gone."""
    if watch:
        raise QerlError(422, "--watch follows one job; follow a sweep with qerl jobs list --metadata sweep=ID")
    sweep_id = (idempotency_key or secrets.token_hex(4))[:64]
    bodies = sweep_bodies(body, points, sweep_id)
    if dry_run:
        return _print_json(bodies)
    jobs: list[dict[str, Any]] = []
    with _client(base_url, api_key) as client:
        for i, b in enumerate(bodies):
            try:
                jobs.append(client.create_job(b, f"{idempotency_key}-{i}" if idempotency_key else None))
            except QerlError as exc:
                left = []
                for j in jobs:
                    try:
                        client.cancel(j["id"])
                    except QerlError:
                        left.append(j["id"])
                undone = (f"; the {len(jobs)} jobs created before it were cancelled" if jobs and not left else
                          f"; of the jobs created before it these could not be cancelled: {', '.join(left)}"
                          if left else "")
                raise QerlError(exc.status, f"sweep point {i + 1} of {len(bodies)} "
                                            f"({b['metadata']['sweep_point']}): {exc.message}{undone}",
                                exc.code) from None
    if as_json:
        return _print_json(jobs)
    table = _table("job", "sweep point", "steps")
    for j, b in zip(jobs, bodies):
        table.add_row(j["id"], escape(b["metadata"]["sweep_point"]), str(j["qerl"]["progress"].get("total_steps")))
    out.print(table)
    out.print(f"sweep {sweep_id}: qerl jobs list --metadata sweep={sweep_id}; "
              f"qerl jobs compare --sweep {sweep_id} --diff", highlight=False)


@jobs_app.command("list")
@_errors_as_messages
def jobs_list(status: Annotated[Optional[str], typer.Option(help="only jobs in this state")] = None,
              limit: Annotated[int, typer.Option(min=1, max=100)] = 20,
              after: Annotated[Optional[str], typer.Option(help="page after this job id")] = None,
              metadata: Annotated[Optional[list[str]], typer.Option(
                  help="only jobs whose metadata has KEY=VALUE, repeatable")] = None,
              base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """Jobs of this key's project, newest first."""
    wanted = {}
    for item in metadata or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise QerlError(422, f"--metadata {item!r}: write KEY=VALUE")
        wanted[key] = value
    with _client(base_url, api_key) as client:
        page = client.list_jobs(status=status, limit=limit, after=after, metadata=wanted)
    if as_json:
        return _print_json(page)
    if not page["data"]:
        said = ([f"status {status}"] * bool(status) + [f"metadata {k}={v}" for k, v in wanted.items()]
                + [f"an id after {after}"] * bool(after))
        return out.print(f"no jobs with {' and '.join(said)}" if said else
                         "no jobs yet (qerl jobs create job.yaml --training-file file-... submits one)", highlight=False)
    table = _table("id", "status", "model", "progress", "created", "fine-tuned model")
    for j in page["data"]:
        table.add_row(j["id"], _status(j["status"], j), escape(j["model"]), steps_done(j),
                      _when(j["created_at"]), escape(j.get("fine_tuned_model") or ""))
    out.print(table)
    if page.get("has_more"):
        out.print(f"[dim]more: qerl jobs list --after {page['data'][-1]['id']}[/]")


@jobs_app.command("checkpoints")
@_errors_as_messages
def jobs_checkpoints(job_id: str,
                     delete: Annotated[Optional[int], typer.Option(
                         "--delete", metavar="STEP", help="delete the checkpoint of this step (and its kept LoRA)")] = None,
                     base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """A job's checkpoints (oldest first): step, training reward, held-out reward where the job
    evaluated at that step, and whether its LoRA is kept for good (qerl.keep_checkpoint_adapters)
    or only while the checkpoint is on disk."""
    with _client(base_url, api_key) as client:
        if delete is not None:
            c = _checkpoint_at(client, job_id, delete)
            gone = client.delete_checkpoint(job_id, c["id"])
            if as_json:
                return _print_json(gone)
            out.print(f"deleted checkpoint {c['id']} (step {delete}) of {job_id}")
            return
        ckpts = sorted(client.checkpoints(job_id), key=lambda c: c["step_number"])
    if as_json:
        return _print_json(ckpts)
    if not ckpts:
        out.print(f"no checkpoints for {job_id} (a job saves one every qerl.checkpoint_interval steps, 5 unless "
                  "set, and when it pauses)")
        return
    table = _table("step", "id", "reward", "eval reward", "saved", "LoRA")
    for c in ckpts:
        reward, held_out = (c["metrics"].get(k) for k in ("reward_mean", "eval/reward_mean"))
        kept = (c.get("qerl") or {}).get("adapter_bytes")
        table.add_row(str(c["step_number"]), c["id"], _number(reward), _number(held_out), _when(c["created_at"]),
                      f"kept ({kept / 2**20:.1f} MiB)" if kept is not None else "while on disk")
    out.print(table)
    out.print(f"[dim]download one: qerl adapters download {job_id} --checkpoint STEP[/]")


@jobs_app.command("samples")
@_errors_as_messages
def jobs_samples(job_id: str,
                 step: Annotated[Optional[int], typer.Option(help="this step's samples (default: the newest step's)")] = None,
                 kind: Annotated[Optional[str], typer.Option(help="train (the step's rollouts) or eval (greedy)")] = None,
                 full_prompt: Annotated[bool, typer.Option("--full-prompt", help="the whole prompt, not its end")] = False,
                 base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """What the model generated at a step, with each sample's reward: the step's first rollouts
    and the evaluation's greedy completions (qerl.log_samples of each)."""
    if kind not in (None, "train", "eval"):
        raise QerlError(422, f"--kind must be train or eval; got {kind!r}")
    with _client(base_url, api_key) as client:
        page = client.samples(job_id, step=step, kind=kind)
    if as_json:
        return _print_json(page)
    if not page:
        if step is not None:
            with _client(base_url, api_key) as client:
                progress = client.job(job_id)["qerl"]["progress"]
            at, total = progress["step"], progress["total_steps"]
            if step > at or step < 0:
                why = f"the job has {total} steps" if step > total or step < 0 else "it has not got there yet"
                out.print(f"no samples for {job_id} at step {step}: {why} (it is at step {at} of {total})")
                return
        out.print(f"no samples for {job_id}" + (f" at step {step}" if step is not None else "") +
                  " (reported from the first step on; qerl.log_samples=0 turns them off)")
        return
    for x in page:
        scores = ", ".join(f"{k} {v:.3g}" for k, v in x["scores"].items() if v is not None)
        out.print(f"[bold]step {x['step']} {x['kind']} #{x['index']}[/]  reward [bold]{x['reward']:.4g}[/]"
                  f"  ({escape(scores)}; {x['finish_reason']}, {x['tokens']} tokens)")
        prompt = x["prompt"] if full_prompt else "..." + x["prompt"][-160:] if len(x["prompt"]) > 160 else x["prompt"]
        out.print(f"[dim]{escape(prompt)}[/]")
        out.print(escape(x["completion"]), highlight=False)
        out.print()


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else ""


@jobs_app.command("get")
@_errors_as_messages
def jobs_get(job_id: str, base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """One job: state, progress, error, result."""
    with _client(base_url, api_key) as client:
        job = client.job(job_id)
    if as_json:
        return _print_json(job)
    q = job["qerl"]
    table = Table(show_header=False, box=None)
    rows = [("id", job["id"]), ("status", _status(job["status"])), ("model", escape(job["model"])),
            ("progress", steps_done(job, " steps")),
            ("quantization", q.get("quantization", "")), ("attempt", f"{q.get('attempt')}/{q.get('max_attempts')}"),
            ("training file", job.get("training_file") or "-"), ("created", _when(job["created_at"])),
            ("started", _when(q.get("started_at"))), ("finished", _when(job.get("finished_at"))),
            ("fine-tuned model", escape(job.get("fine_tuned_model") or "-")), ("adapter", q.get("adapter_id") or "-"),
            ("results file", ", ".join(job.get("result_files") or []) or "-")]
    if q.get("queue_position"):
        rows.insert(2, ("queue position", f"{q['queue_position']} (1: the next job a free worker takes)"))
    if job.get("error"):
        rows.append(("error", f"[red]{escape(job['error']['code'])}: {escape(job['error']['message'])}[/]"))
    rows += [(k, escape(v)) for k, v in settings(q.get("spec") or {})]
    for k, v in rows:
        table.add_row(f"[bold]{k}[/]", str(v))
    out.print(table)


@jobs_app.command("compare")
@_errors_as_messages
def jobs_compare(job_ids: Annotated[Optional[list[str]], typer.Argument(help="two or more job ids")] = None,
                 sweep: Annotated[Optional[str], typer.Option(
                     help="the jobs of this sweep (qerl jobs create --sweep), oldest first")] = None,
                 only_differences: Annotated[bool, typer.Option(
                     "--diff", help="only the settings in which the jobs differ")] = False,
                 base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """Jobs side by side: their settings (those that differ in bold) and what they reached
    (reward, held-out accuracy and reward from first to last, time, rollout speed)."""
    with _client(base_url, api_key) as client:
        ids = list(job_ids or [])
        if sweep is not None:
            ids += [j["id"] for j in reversed(client.all_jobs({"sweep": sweep})) if j["id"] not in ids]
        if len(ids) < 2:
            raise QerlError(422, "give two or more job ids to compare (qerl jobs list shows them)" if sweep is None
                            else f"sweep {sweep} has {len(ids)} job(s); compare needs two or more")
        jobs = [client.job(j) for j in ids]
        metrics = [client.metrics(j["id"]) for j in jobs]
    setting_cols = [[("model", j["model"]), ("quantization", j["qerl"].get("quantization", "")),
                     ("training file", j.get("training_file") or "-"),
                     *settings(j["qerl"].get("spec") or {})] for j in jobs]
    result_cols = [results(j, m) for j, m in zip(jobs, metrics)]
    if as_json:
        return _print_json({j["id"]: {"settings": dict(s), "results": dict(r)}
                            for j, s, r in zip(jobs, setting_cols, result_cols)})
    table = Table("", *(Column(j["id"], overflow="fold") for j in jobs))  # ids whole, as _table keeps them
    rows = side_by_side(setting_cols)
    same = [name for name, values in rows if len(set(values)) == 1]
    for name, values in rows:
        differs = len(set(values)) > 1
        if differs or not only_differences:
            table.add_row(f"[bold]{name}[/]" if differs else f"[dim]{name}[/]",
                          *(f"[bold]{escape(v)}[/]" if differs else escape(v) for v in values))
    table.add_section()
    for name, values in side_by_side(result_cols):
        table.add_row(f"[bold]{name}[/]", *(escape(v) for v in values))
    out.print(table)
    if only_differences and same:
        out.print(f"[dim]the same in all: {', '.join(same)}[/]", highlight=False)


JobId = Annotated[Optional[str], typer.Argument(help="the job's id (or --sweep ID for a sweep's jobs)")]
Sweep = Annotated[Optional[str], typer.Option(help="every job of this sweep (qerl jobs create --sweep) it applies to")]


@jobs_app.command("cancel")
@_errors_as_messages
def jobs_cancel(job_id: JobId = None, sweep: Sweep = None, base_url: BaseUrl = None, api_key: ApiKey = None,
                as_json: AsJson = False) -> None:
    """Ask a job to stop; a running job saves a checkpoint and winds down (cancelling -> cancelled)."""
    _job_action(Client.cancel, job_id, sweep, ("validating_files", "queued", "running", "pausing", "paused"),
                base_url, api_key, as_json)


def _job_action(action: Callable[[Client, str], dict[str, Any]], job_id: str | None, sweep: str | None,
                applies: tuple[str, ...], base_url: str | None, api_key: str | None, as_json: bool) -> None:
    """POST one of a job's actions (cancel, pause, resume) and print the job's new status; with a
    sweep, to each of its jobs in a state the action ``applies`` to (oldest first)."""
    if (job_id is None) == (sweep is None):
        raise QerlError(422, "give a job id or --sweep ID (qerl jobs list shows both)")
    refused: list[str] = []
    with _client(base_url, api_key) as client:
        if job_id is not None:
            jobs = [action(client, job_id)]
        else:
            jobs = []
            for j in reversed(client.all_jobs({"sweep": sweep})):
                if j["status"] in applies:
                    try:
                        jobs.append(action(client, j["id"]))
                    except QerlError as exc:  # it moved on meanwhile (finished, say): the others still go
                        refused.append(f"{j['id']}: {exc.message}")
    if as_json:
        _print_json(jobs[0] if job_id is not None else jobs)
    elif not jobs and not refused:
        out.print(f"no job of sweep {sweep} is {' or '.join(applies)}", highlight=False)
    else:
        for job in jobs:
            out.print(f"{job['id']} {_status(job['status'])}")
    if refused:
        raise QerlError(409, "; ".join(refused))


@jobs_app.command("pause")
@_errors_as_messages
def jobs_pause(job_id: JobId = None, sweep: Sweep = None, base_url: BaseUrl = None, api_key: ApiKey = None,
               as_json: AsJson = False) -> None:
    """Pause a job: a running job saves a checkpoint within a step and frees its worker (pausing -> paused)."""
    _job_action(Client.pause, job_id, sweep, ("validating_files", "queued", "running"), base_url, api_key, as_json)


@jobs_app.command("resume")
@_errors_as_messages
def jobs_resume(job_id: JobId = None, sweep: Sweep = None, base_url: BaseUrl = None, api_key: ApiKey = None,
                as_json: AsJson = False) -> None:
    """Queue a paused job again; it continues from the checkpoint it saved when it paused."""
    _job_action(Client.resume, job_id, sweep, ("paused",), base_url, api_key, as_json)


@jobs_app.command("watch")
@_errors_as_messages
def jobs_watch(job_id: str, interval: Annotated[float, typer.Option(help="seconds between status checks")] = 1.0,
               base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """Live progress until the job ends or pauses; exit 0 if it succeeded, 1 if it failed, 2 if
    cancelled, 3 if paused."""
    with _client(base_url, api_key) as client:
        _report_outcome(watch_job(client, job_id, out, interval))


@jobs_app.command("events")
@_errors_as_messages
def jobs_events(job_id: str, follow: Annotated[bool, typer.Option("--follow", "-f", help="stream new events until the job ends")] = False,
                limit: Annotated[int, typer.Option(min=1, max=1000)] = 100,
                base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """A job's event log (oldest first); --follow streams it live (server-sent events)."""
    with _client(base_url, api_key) as client:
        if follow:
            for ev in follow_events(client, job_id):
                if as_json:
                    typer.echo(json.dumps(ev))
                else:
                    out.print(_event_line(ev), highlight=False)
            return
        events = client.events(job_id, limit=limit)
    events.sort(key=lambda e: (e.get("created_at") or 0, _numeric_id(e.get("id"))))
    if as_json:
        return _print_json(events)
    for ev in events:
        out.print(_event_line(ev), highlight=False)


def _numeric_id(value: Any) -> int:
    digits = "".join(ch for ch in str(value) if ch.isdigit())
    return int(digits) if digits else 0


@adapters_app.command("list")
@_errors_as_messages
def adapters_list(base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """Trained adapters of this key's project."""
    with _client(base_url, api_key) as client:
        adapters = client.adapters()
    if as_json:
        return _print_json(adapters)
    if not adapters:
        return out.print("no adapters yet (a job that succeeds makes one)", highlight=False)
    table = _table("id", "name", "base model", "job", "size", "sha256", "created")
    for a in adapters:
        table.add_row(a["id"], escape(a["name"]), escape(a["base_model"]), a["job_id"], _size(a["bytes"]),
                      a["sha256"][:12], _when(a["created_at"]))
    out.print(table)


@models_app.command("list")
@_errors_as_messages
def models_list(base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """The base models this server can train (a job's --model), then this project's fine-tuned
    models (ft:..., which --model also takes, to train further)."""
    with _client(base_url, api_key) as client:
        models = client.models()
    if as_json:
        return _print_json(models)
    table = _table("id", "kind", "from", "job", "created")
    for m in models:
        q = m.get("qerl") or {}
        source = q.get("base_model") if q.get("kind") == "adapter" else q.get("hub_id")
        table.add_row(escape(m["id"]), escape(str(q.get("kind", ""))), escape(str(source or "")),
                      q.get("job_id") or "", _when(m["created"]))
    out.print(table)


@adapters_app.command("download")
@_errors_as_messages
def adapters_download(adapter_id: Annotated[str, typer.Argument(
                          help="adapter id, the id of a job that succeeded, or the fine-tuned model (ft:...)")],
                      output: Annotated[Optional[Path], typer.Option("-o", "--output", file_okay=False,
                                                                      help="directory (default ./<adapter id>)")] = None,
                      checkpoint: Annotated[Optional[int], typer.Option(
                          help="with a job id: the LoRA of its checkpoint at this step instead")] = None,
                      base_url: BaseUrl = None, api_key: ApiKey = None) -> None:
    """Download, verify (sha256) and extract an adapter into a directory PEFT and vLLM load."""
    with _client(base_url, api_key) as client:
        if checkpoint is not None:
            return _download_checkpoint(client, adapter_id, checkpoint, output)
        adapter_id = client.adapter_id_of(adapter_id)
        meta = client.adapter(adapter_id)
        target = output or Path(adapter_id)
        with _progress() as progress:
            task = progress.add_task(adapter_id, total=meta.get("bytes") or None)
            client.download_adapter(adapter_id, target, lambda n, total: progress.update(task, advance=n))
    out.print(f"[green]sha256 verified[/] {meta['sha256']}")
    out.print(f"adapter {adapter_id} ({escape(meta['name'])}, base {escape(meta['base_model'])}) extracted to {target}")
    _how_to_load(meta["name"], target)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=out)


def _how_to_load(name: str, target: Path) -> None:
    out.print(f"load it: peft.PeftModel.from_pretrained(base_model, {str(target)!r})  |  "
              f"vLLM: LoRARequest({name!r}, 1, {str(target)!r})", highlight=False)


def _checkpoint_at(client: Client, job_id: str, step: int) -> dict[str, Any]:
    found = [c for c in client.checkpoints(job_id) if c["step_number"] == step]
    if not found:
        raise QerlError(404, f"job {job_id} has no checkpoint at step {step} (qerl jobs checkpoints {job_id} "
                             "lists them)")
    return found[0]  # newest first: the latest attempt's


def _download_checkpoint(client: Client, job_id: str, step: int, output: Path | None) -> None:
    if not job_id.startswith("ftjob-"):
        raise QerlError(422, f"--checkpoint needs a job id (ftjob-...), not {job_id!r}")
    c = _checkpoint_at(client, job_id, step)
    target = output or Path(f"{job_id}-ckpt-step-{step}")
    with _progress() as progress:
        task = progress.add_task(c["id"], total=None)
        client.download_checkpoint(job_id, c["id"], target, lambda n, total: progress.update(task, advance=n))
    out.print(f"[green]sha256 verified[/] checkpoint {c['id']} (step {step}) extracted to {target}")
    _how_to_load(c["fine_tuned_model_checkpoint"], target)


@adapters_app.command("delete")
@_errors_as_messages
def adapters_delete(adapter: Annotated[str, typer.Argument(help="adapter id, or the fine-tuned model name (ft:...)")],
                    base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """Delete a trained adapter (its archive on the server goes; the job that made it stays)."""
    with _client(base_url, api_key) as client:
        gone = client.delete_adapter(adapter)
    if as_json:
        return _print_json(gone)
    out.print(f"deleted {escape(gone['id'])}")


def register(app: typer.Typer) -> None:
    app.add_typer(files_app, name="files")
    app.add_typer(jobs_app, name="jobs")
    app.add_typer(adapters_app, name="adapters")
    app.add_typer(models_app, name="models")
