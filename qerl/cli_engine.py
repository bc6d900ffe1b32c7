"""`qerl train SPEC.json` and `qerl quantize MODEL OUT_DIR`: the engine without the service.

``train`` runs ``engine.train`` in this process with a progress bar and writes the adapter to
``<workdir>/adapter`` and the reported samples to ``<workdir>/samples.jsonl``; Ctrl-C stops at the next step boundary with a checkpoint that
``--resume`` continues from. ``quantize`` writes a compressed-tensors NVFP4 checkpoint that
vLLM and transformers load.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from qerl.term import stdout_console

console = stdout_console()


class ProgressReporter:
    """Reporter that draws a progress bar and prints events, evaluations and checkpoints; the
    reported samples go to ``samples_path`` (JSON lines: step, kind, then the sample)."""

    def __init__(self, progress: Progress, total: int, samples_path: Path | None = None) -> None:
        self.progress = progress
        self.task = progress.add_task("train", total=total, reward="-", sigma="-", tps="-")
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.samples_path = samples_path

    def samples(self, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
        if self.samples_path is not None:
            self.samples_path.parent.mkdir(parents=True, exist_ok=True)
            with self.samples_path.open("a") as fh:
                fh.writelines(json.dumps({"step": step, "kind": kind, **r}) + "\n" for r in rows)

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        style = {"warn": "yellow", "warning": "yellow", "error": "red"}.get(level, "dim")
        self.progress.console.print(f"[{style}]{message}[/]")

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if "reward_mean" not in values:  # an evaluation: reported as an event too
            return
        self.steps.append((step, dict(values)))
        self.progress.update(self.task, completed=step, reward=f"{values['reward_mean']:.3f}",
                             sigma=f"{values.get('aqn_sigma', 0.0):.1e}",
                             tps=f"{values.get('rollout_tokens_per_s', 0.0):.0f}")

    def checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        pass  # the engine's "Checkpoint saved" event says it


def _load_spec(path: Path):
    from engine.spec import TrainSpec

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), dict):
        _default_eval_size(data["data"])
    try:
        return TrainSpec.from_dict(data)
    except ValueError as exc:
        raise typer.BadParameter(f"{path}: {exc}") from None


def _default_eval_size(data: dict[str, Any]) -> None:
    """Without data.eval_size or a validation_file, hold out what a job through the service would:
    32 questions, or a quarter of fewer than 128 (engine.spec.default_eval_size)."""
    from engine.data.jsonl import parse_jsonl
    from engine.data.prompts import count_prompts
    from engine.spec import default_eval_size

    if "eval_size" in data or data.get("validation_file") is not None:
        return
    questions = None
    if isinstance(data.get("dataset"), dict):
        size = data["dataset"].get("size", 200)
        questions = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
    elif isinstance(data.get("train_file"), str):
        try:
            rows, errors = parse_jsonl(Path(data["train_file"]).read_bytes())
        except OSError:
            return  # the engine names the file it cannot read
        questions = None if errors else count_prompts(rows)
    if questions is not None:
        data["eval_size"] = default_eval_size(questions)


def train_cmd(
    spec_path: Path = typer.Argument(..., metavar="SPEC.json", help="TrainSpec as JSON (see engine/spec.py)"),
    workdir: Path = typer.Option(Path("qerl-run"), "--workdir", help="Checkpoints and the adapter go here"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="A checkpoint dir (or checkpoints/ for the newest)"),
) -> None:
    """Fine-tune a base model with RL on this machine."""
    from engine import train
    from engine.types import TrainError

    spec = _load_spec(spec_path)
    stop = {"requested": False}

    def on_sigint(signum: int, frame: Any) -> None:
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True
        console.print("[yellow]Stopping at the next step boundary (Ctrl-C again to abort)...[/]")

    previous = signal.signal(signal.SIGINT, on_sigint)
    columns = (TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("reward {task.fields[reward]}"),
               TextColumn("sigma {task.fields[sigma]}"), TextColumn("{task.fields[tps]} tok/s"),
               TimeElapsedColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, console=console, disable=not console.is_terminal) as progress:  # no bar in a log
            reporter = ProgressReporter(progress, spec.steps, samples_path=workdir / "samples.jsonl")
            result = train(spec, workdir=workdir, reporter=reporter, should_stop=lambda: stop["requested"],
                           resume_from=resume)
    except TrainError as exc:
        console.print(f"[red]{exc.code}: {exc}[/]")
        raise typer.Exit(1) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    state = "stopped" if result.stopped else "finished"
    console.print(f"{state} after {result.steps} steps; adapter: {result.adapter_dir}")
    for key in ("eval_initial/accuracy", "eval/accuracy", "eval/reward_mean"):
        if key in result.metrics:
            console.print(f"  {key} = {result.metrics[key]:.4f}")


def quantize_cmd(
    model: str = typer.Argument(..., help="A registry name (qerl models) or a local Hugging Face model dir"),
    out_dir: Path = typer.Argument(..., help="Where to write the compressed-tensors NVFP4 checkpoint"),
) -> None:
    """Quantize a model to NVFP4 (compressed-tensors nvfp4-pack-quantized) for vLLM / transformers."""
    from engine.model.load import resolve_model_dir
    from engine.quant import ct_io

    try:
        src = resolve_model_dir(model)  # registry names (the built-in GGUF is converted once)
        out = ct_io.quantize_cli(str(src), str(out_dir))
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    console.print(f"NVFP4 checkpoint written to {out}")


def register(app: typer.Typer) -> None:
    app.command("train")(train_cmd)
    app.command("quantize")(quantize_cmd)
