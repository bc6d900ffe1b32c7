"""`qerl evaluations list|get|cancel`: the evaluations the server's workers run (POST
/v1/evaluations; `qerl eval ... --on-server` creates them)."""
from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from qerl.cli_client import ApiKey, AsJson, BaseUrl, _client, _errors_as_messages, _print_json, _status, _table, _when
from qerl.term import stdout_console

out = stdout_console()
evaluations_app = typer.Typer(no_args_is_help=True, help="List, show and cancel evaluations run on the server.")


def _accuracy(ev: dict[str, Any]) -> tuple[str, str]:
    """The adapter's and the base alone's held-out accuracy, once it has succeeded."""
    result = ev.get("result") or {}
    tuned, alone = result.get("fine_tuned") or {}, result.get("base") or {}
    return (f"{tuned['accuracy']:.3f}" if "accuracy" in tuned else "-",
            f"{alone['accuracy']:.3f}" if "accuracy" in alone else "-")


@evaluations_app.command("list")
@_errors_as_messages
def evaluations_list(status: Annotated[Optional[str], typer.Option(help="only evaluations in this state")] = None,
                     limit: Annotated[int, typer.Option(min=1, max=100)] = 20,
                     after: Annotated[Optional[str], typer.Option(help="page after this evaluation id")] = None,
                     base_url: BaseUrl = None, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """Evaluations of this key's project, newest first."""
    with _client(base_url, api_key) as client:
        page = client.get("/v1/evaluations", status=status, limit=limit, after=after)
    if as_json:
        return _print_json(page)
    if not page["data"]:
        return out.print(f"no evaluations with status {status}" if status else
                         "no evaluations yet (qerl eval ftjob-... --file test.jsonl --on-server runs one)",
                         highlight=False)
    table = _table("id", "status", "model", "file", "accuracy", "base alone", "created")
    for ev in page["data"]:
        table.add_row(ev["id"], _status(ev["status"], {"qerl": ev}), escape(ev["model"]), ev.get("file") or "",
                      *_accuracy(ev), _when(ev["created_at"]))
    out.print(table)
    if page.get("has_more"):
        out.print(f"[dim]more: qerl evaluations list --after {page['data'][-1]['id']}[/]")


@evaluations_app.command("get")
@_errors_as_messages
def evaluations_get(evaluation_id: str, base_url: BaseUrl = None, api_key: ApiKey = None,
                    as_json: AsJson = False) -> None:
    """One evaluation: what it scores and, once it has succeeded, its numbers beside the base alone's."""
    from qerl.cli_eval import _prefixed, _table as metrics_table

    with _client(base_url, api_key) as client:
        ev = client.get(f"/v1/evaluations/{evaluation_id}")
    if as_json:
        return _print_json(ev)
    grader = (ev.get("grader") or {}).get("name") or (ev.get("grader") or {}).get("type") or "-"
    out.print(f"{ev['id']}  {_status(ev['status'], {'qerl': ev})}  {escape(ev['model'])} on {ev.get('file') or '-'}, "
              f"graded by {escape(str(grader))}; created {_when(ev['created_at'])}", highlight=False)
    if ev.get("error"):
        out.print(f"[red]{escape(ev['error']['code'])}[/]: {escape(ev['error']['message'])}")
    result = ev.get("result")
    if result:
        alone = result.get("base")
        out.print(metrics_table([("fine-tuned", _prefixed(result["fine_tuned"]))], _prefixed(alone) if alone else None))
        out.print(f"[dim]{result['rows']} rows, greedy, at most {result['max_new_tokens']} new tokens; "
                  f"{escape(result['base_model'])} ({result['quantization']}) on {result['device']}; every row's "
                  f"answers: qerl files download {' '.join(ev.get('result_files') or [])}[/]")


@evaluations_app.command("cancel")
@_errors_as_messages
def evaluations_cancel(evaluation_id: str, base_url: BaseUrl = None, api_key: ApiKey = None,
                       as_json: AsJson = False) -> None:
    """Cancel a queued or running evaluation."""
    with _client(base_url, api_key) as client:
        ev = client.post(f"/v1/evaluations/{evaluation_id}/cancel")
    if as_json:
        return _print_json(ev)
    out.print(f"{ev['id']} {ev['status']}", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(evaluations_app, name="evaluations")
