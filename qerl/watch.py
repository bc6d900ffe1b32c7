"""Following a job from the terminal: a live rich progress bar fed by the job's event stream.

The SSE stream (a background thread, reconnecting with Last-Event-ID) brings each step's
metrics as it happens; the job object is polled for status and progress; evaluation results,
which have no event of their own, are re-read from GET .../metrics when the engine announces
them and once more at the end, so nothing the stream missed is lost.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator

import httpx
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

from engine.types import NO_UPDATE
from qerl.client import PAUSED, TERMINAL_STATES, Client, QerlError


def _metric_values(event: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(step, values) of a metrics event, else None."""
    data = event.get("data")
    if event.get("type") != "metrics" or not isinstance(data, dict) or "step" not in data:
        return None
    values = data.get("values") if isinstance(data.get("values"), dict) else data
    return int(data["step"]), {k: v for k, v in values.items() if k not in ("step", "total_steps")}


def _fmt(values: dict[str, Any], key: str, spec: str) -> str | None:
    v = values.get(key)
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def step_line(step: int, total: int | None, values: dict[str, Any]) -> str:
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    for label, key, spec in (("reward", "reward_mean", ".3f"), ("acc", "accuracy", ".2f"),
                             ("entropy", "entropy", ".3f"), ("kl", "kl", ".2e"), ("sigma", "aqn_sigma", ".1e"),
                             ("tok/s", "rollout_tokens_per_s", ".0f"), ("s", "step_s", ".1f"),
                             ("eval reward", "eval/reward_mean", ".3f"), ("eval acc", "eval/accuracy", ".2f")):
        text = _fmt(values, key, spec)
        if text is not None:
            parts.append(f"{text} {label}" if label in ("tok/s", "s") else f"{label} {text}")
    if values.get("updates_skipped"):
        parts.append(NO_UPDATE)
    return "  ".join(parts)


def _eta(step: int, total: int, step_seconds: list[float], started_at: int | None) -> str:
    if not total or step >= total:
        return "ETA 0:00:00" if total else "ETA -"
    recent = step_seconds[-5:]
    if recent:
        per_step = sum(recent) / len(recent)
    elif started_at and step:
        per_step = (time.time() - started_at) / step
    else:
        return "ETA -"
    secs = int(per_step * (total - step))
    return f"ETA {secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"


def _stream_into(base_url: str, api_key: str, job_id: str, sink: "queue.Queue[dict[str, Any]]",
                 stop: threading.Event) -> None:
    """Follow the job's SSE stream into ``sink``, reconnecting with Last-Event-ID until ``stop``."""
    last_id: str | None = None
    with Client(base_url=base_url, api_key=api_key) as client:
        while not stop.is_set():
            try:
                for ev in client.stream_server_events(job_id, last_id):
                    if ev.event == "done" or stop.is_set():
                        return
                    if ev.id:
                        last_id = ev.id
                    if isinstance(ev.data, dict):
                        sink.put(ev.data)
            except QerlError as exc:
                if exc.status < 500:
                    return  # e.g. 404/406: the watcher falls back to polling the metrics
            except httpx.HTTPError:
                pass
            stop.wait(1.0)


def watch_job(client: Client, job_id: str, console: Console, interval: float = 1.0) -> dict[str, Any]:
    """Show a live progress bar until the job ends; return the final job object."""
    sink: queue.Queue[dict[str, Any]] = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=_stream_into, args=(client.base_url, client.api_key, job_id, sink, stop),
                              daemon=True)
    thread.start()
    printed: dict[int, set[str]] = {}  # step -> kinds printed ("train", "eval")
    latest: dict[str, Any] = {}
    step_seconds: list[float] = []
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
               TextColumn("{task.completed}/{task.total} steps"), TextColumn("{task.fields[info]}"),
               TextColumn("{task.fields[eta]}"))
    job = client.job(job_id)
    total = int(job["qerl"]["progress"].get("total_steps") or 0)

    def kind(key: str) -> str:
        return "eval" if key.startswith("eval/") else "train"

    def show(step: int, values: dict[str, Any]) -> None:
        """Print a step's line once per kind (training metrics; the evaluation run at that step)."""
        latest.update({k: v for k, v in values.items() if kind(k) == "train"})
        new = {kind(k) for k in values} - printed.setdefault(step, set())
        if not new:
            return
        printed[step] |= new
        subset = {k: v for k, v in values.items() if kind(k) in new}
        if isinstance(subset.get("step_s"), (int, float)):
            step_seconds.append(float(subset["step_s"]))
        console.print(escape(step_line(step, total, subset)), highlight=False)

    try:
        # Not a terminal (a log, a pipe): no bar, whose last frame would be cut to the console's width;
        # the step lines above and a closing line say the same.
        with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
            task = progress.add_task(job["status"], total=total or None, info="", eta="")
            last_place = None
            while True:
                evaluated = False
                while True:
                    try:
                        event = sink.get_nowait()
                    except queue.Empty:
                        break
                    mv = _metric_values(event)
                    if mv is not None:
                        show(*mv)
                        continue
                    evaluated = evaluated or "evaluation" in str(event.get("message", "")).lower()
                    if event.get("level") in ("warn", "error"):
                        color = "yellow" if event["level"] == "warn" else "red"
                        console.print(f"[{color}]{escape(str(event.get('message', '')))}[/]")
                if evaluated:  # evaluation results are stored as metrics without an event of their own
                    for m in client.metrics(job_id):
                        show(int(m["step"]), m["values"])
                prog = job["qerl"]["progress"]
                total = int(prog.get("total_steps") or 0) or total
                step = int(prog.get("step") or 0)
                info = _info(latest)
                place = job["qerl"].get("queue_position") if job["status"] == "queued" else None
                if place and place != last_place:
                    console.print(f"queued: position {place} (1: the next job a free worker takes)", highlight=False)
                last_place = place
                progress.update(task, description=job["status"], total=total or None, completed=step, info=info,
                                eta=_eta(step, total, step_seconds, job["qerl"].get("started_at")))
                if job["status"] in TERMINAL_STATES or job["status"] == PAUSED:
                    for m in client.metrics(job_id):  # what the stream had not delivered yet
                        show(int(m["step"]), m["values"])
                    info = _info(latest)
                    progress.update(task, info=info)
                    progress.refresh()
                    if not console.is_terminal:
                        console.print(escape("  ".join(p for p in (job["status"], f"{step}/{total} steps", info) if p)),
                                      highlight=False)
                    return job
                if not thread.is_alive():  # no stream: poll the metrics instead
                    for m in client.metrics(job_id):
                        show(int(m["step"]), m["values"])
                time.sleep(interval)
                job = client.job(job_id)
    finally:
        stop.set()


def _info(latest: dict[str, Any]) -> str:
    """The bar's numbers: the latest step's reward, entropy, AQN sigma and rollout speed."""
    return "  ".join(p for p in (
        _labelled("reward", _fmt(latest, "reward_mean", ".3f")),
        _labelled("entropy", _fmt(latest, "entropy", ".3f")),
        _labelled("sigma", _fmt(latest, "aqn_sigma", ".1e")),
        _labelled("tok/s", _fmt(latest, "rollout_tokens_per_s", ".0f"))) if p)


def _labelled(label: str, text: str | None) -> str | None:
    return f"{label} {text}" if text is not None else None


def follow_events(client: Client, job_id: str) -> Iterator[dict[str, Any]]:
    """Every event from the start, reconnecting until the job is finished and the stream drained."""
    last_id: str | None = None
    while True:
        try:
            for ev in client.stream_server_events(job_id, last_id):
                if ev.event == "done":
                    return
                if ev.id:
                    last_id = ev.id
                if isinstance(ev.data, dict):
                    yield ev.data
        except httpx.TransportError:
            pass
        if client.job(job_id)["status"] in TERMINAL_STATES:
            return
        time.sleep(1.0)
