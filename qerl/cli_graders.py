"""`qerl graders validate|run`: try a grader on the server before a long RL job relies on it.

``run`` exits 1 when the grader failed on the sample (the reward is then 0 and the error is
printed), so a script can check a grader on a few samples before ``qerl jobs create``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from qerl.cli_client import ApiKey, AsJson, BaseUrl, _errors_as_messages, _print_json, out
from qerl.client import Client
from qerl.jobbody import load_spec

RUN_TIMEOUT_S = 300.0  # a multi grader with several python graders may take each one's time limit
GRADER = 'a grader such as {"type": "string_check", "input": "{{sample.output_text}}", ...}'
ITEM = 'a dataset row such as {"answer": "42"}'

graders_app = typer.Typer(no_args_is_help=True, help="Validate a grader, or score one sample with it.")
GraderFile = Annotated[str, typer.Argument(help="the grader as a JSON or YAML file (- for stdin), OpenAI's grader "
                                                "shape, e.g. {\"type\": \"string_check\", ...}")]
Sample = Annotated[str, typer.Option("--sample", help="the model's output to grade ({{sample.output_text}})")]
ItemFile = Annotated[Optional[Path], typer.Option("--item", exists=True, dir_okay=False,
                                                  help="the dataset row as a JSON or YAML file ({{item.<field>}})")]


@graders_app.command("validate")
@_errors_as_messages
def graders_validate(grader: GraderFile, base_url: BaseUrl = None, api_key: ApiKey = None,
                     as_json: AsJson = False) -> None:
    """Check a grader as job creation checks it; a bad field is named with the fix."""
    with Client(base_url, api_key) as client:
        body = client.post("/v1/fine_tuning/alpha/graders/validate", {"grader": load_spec(grader, GRADER)})
    if as_json:
        return _print_json(body)
    fields = (body.get("qerl") or {}).get("item_fields") or []
    out.print(f"[green]valid[/]: {escape(body['grader'].get('type', ''))} grader "
              f"{escape(str(body['grader'].get('name', '')))}".rstrip()
              + (f"; every row must have {escape(', '.join(fields))}" if fields else ""), highlight=False)


@graders_app.command("run")
@_errors_as_messages
def graders_run(grader: GraderFile, sample: Sample, item: ItemFile = None, base_url: BaseUrl = None,
                api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """The reward training would give the --sample on the --item, with each sub-grader's score."""
    body: dict[str, Any] = {"grader": load_spec(grader, GRADER), "model_sample": sample}
    if item is not None:
        body["item"] = load_spec(str(item), ITEM)
    with Client(base_url, api_key, timeout=RUN_TIMEOUT_S) as client:
        result = client.post("/v1/fine_tuning/alpha/graders/run", body)
    error = (result.get("qerl") or {}).get("error")
    if as_json:
        _print_json(result)
    else:
        meta = result["metadata"]
        out.print(f"reward {result['reward']:.4g}  ({escape(meta['type'])} {escape(meta['name'])}, "
                  f"{meta['execution_time'] * 1000:.1f} ms)", highlight=False)  # a table's title would wrap
        table = Table("grader", "score")
        for name, score in meta["scores"].items():
            table.add_row(escape(name), f"{score:.4g}")
        out.print(table)
        if error:
            flags = [k for k, v in meta["errors"].items() if v is True]
            out.print(f"[red]the grader failed[/] ({', '.join(flags)}): {escape(error)}")
    if error:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(graders_app, name="graders")
