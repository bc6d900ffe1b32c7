"""`qerl demo`: start the embedded service, run a real fine-tuning job end to end, show it.

Starts ``qerl serve`` (SQLite + in-process worker) in a private data directory, submits the
demo job (SmolLM2-135M-Instruct, NVFP4 base, LoRA, AQN, GRPO/DAPO on a reasoning-gym task),
follows its progress, downloads the adapter (sha256 checked) and prints the evaluation
before and after training.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import typer
from rich.markup import escape
from rich.table import Table

from qerl.client import Client, QerlError
from qerl.term import stdout_console
from qerl.watch import watch_job

console = stdout_console()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(data_dir: Path, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(QERL_DATA_DIR=str(data_dir), QERL_CONFIG=str(data_dir / "config.json"), PYTHONUNBUFFERED="1")
    log = (data_dir / "server.log").open("ab")
    return subprocess.Popen([sys.executable, "-m", "qerl.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}; see its log")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become ready within {timeout:.0f} s")


def _eval_table(metrics: list[dict]) -> Table:
    """Greedy held-out evaluation: before training (step 0) and after."""
    evals = [m for m in metrics if "eval/reward_mean" in m["values"]]
    parts = sorted({k for m in evals for k in m["values"] if k.startswith("eval/reward/")})
    keys = ["eval/accuracy", "eval/reward_mean", *parts]
    table = Table(title="Held-out evaluation (greedy, adapter attached)")
    table.add_column("step", justify="right")
    for k in keys:
        table.add_column(k.removeprefix("eval/").replace("reward/", "reward: "), justify="right")
    for m in evals:
        table.add_row(str(m["step"]), *[f"{m['values'].get(k, float('nan')):.3f}" for k in keys])
    return table


def _show_samples(client: Client, job_id: str, n: int = 2) -> None:
    """Held-out prompts' greedy answers before training (step 0) and after (the last evaluation):
    those whose reward changed most, else the first ones."""
    before = client.samples(job_id, step=0, kind="eval")
    after = client.get(f"/v1/fine_tuning/jobs/{job_id}/samples", kind="eval")["data"]
    if not before or not after:
        return
    console.print(f"[bold]Held-out answers[/] (greedy), before training and after step {after[0]['step']}:")
    pairs = sorted(zip(before, after), key=lambda p: p[0]["reward"] - p[1]["reward"])  # most improved first
    for b, a in pairs[:n]:
        question = b["prompt"].rsplit("user\n", 1)[-1].split("<|im_end|>", 1)[0].strip()[-200:]
        console.print(f"  [dim]{escape(question)}[/]")
        for label, x in (("before", b), ("after", a)):
            console.print(f"    {label:6} reward {x['reward']:.2f}: {escape(' '.join(x['completion'].split())[:160])}")


def run_demo(data_dir: Path, steps: int | None) -> int:
    from engine.data.demo import DEMO_SPEC  # torch-free

    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    os.environ["QERL_CONFIG"] = str(data_dir / "config.json")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    console.print(f"[bold]Starting the embedded qerl service[/] on {url} (data in {data_dir})")
    proc = _start_server(data_dir, port)
    try:
        _wait_ready(url, proc)
        client = Client(base_url=url)
        _cancel_leftovers(client)
        qerl_ext = dict(DEMO_SPEC)
        if steps:
            qerl_ext["steps"] = steps
        model = qerl_ext.pop("model", "smollm2-135m-instruct")
        job = client.create_job({"model": model, "seed": qerl_ext.pop("seed", 0), "suffix": "demo",
                                 "method": {"type": "reinforcement",
                                            "reinforcement": {"grader": qerl_ext.pop("grader")}},
                                 "qerl": qerl_ext})
        console.print(f"Submitted job [bold]{job['id']}[/] on {model}")
        job = watch_job(client, job["id"], console, interval=2.0)
        if job["status"] != "succeeded":
            err = job.get("error") or {}
            console.print(f"[red]Job {job['status']}[/]: {err.get('code')}: {err.get('message')}")
            return 1
        metrics = client.metrics(job["id"])
        console.print(_eval_table(metrics))
        _show_samples(client, job["id"])
        adapter_id = job["qerl"]["adapter_id"]
        out = client.download_adapter(adapter_id, data_dir / "adapters" / adapter_id)
        console.print(f"Adapter [bold]{adapter_id}[/] downloaded (sha256 verified) to {out}; "
                      f"load it with peft.PeftModel.from_pretrained(base, '{out}'), or try it beside the base: "
                      f"qerl generate {out} -p 'What is 12 times 7?'", highlight=False)
        return 0
    except QerlError as exc:
        console.print(f"[red]{exc}[/]")
        return 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _cancel_leftovers(client: Client) -> None:
    """A demo interrupted earlier left its job in this data directory; it would run first."""
    for job in client.get("/v1/fine_tuning/jobs", limit=100)["data"]:
        if job.get("user_provided_suffix") == "demo" and job["status"] in ("queued", "running"):
            client.cancel(job["id"])
            console.print(f"Cancelled {job['id']}, left unfinished by an earlier demo")


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(data_dir: Path = typer.Option(Path("var/demo"), help="where the demo keeps its database and files"),
             steps: int = typer.Option(0, help="override the demo's number of steps (0: the demo's own)")) -> None:
        """Run a real RL fine-tuning job end to end on the embedded service."""
        raise typer.Exit(run_demo(data_dir, steps or None))
