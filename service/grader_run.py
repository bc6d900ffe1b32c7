"""One sample scored by a grader, in a separate process (POST /v1/fine_tuning/alpha/graders/run).

The API process never calls a grader itself: a format grader's regular expression can backtrack
for hours while holding the GIL (every request of the process would wait), and text_similarity's
cost grows with the product of its two texts. Each run starts ``python -m service.grader_run``,
which caps its own memory and CPU, builds the grader with ``engine.rewards`` (what the worker
builds) and calls it once on (sample, item), as the training loop grades a completion; a python
grader inside it runs in its own sandbox with its own limits (``engine.rewards.python_grader``).
A model grader asks the judge the server's QERL_GRADER_* settings name. The parent allows
``BASE_S`` plus each python grader's wall time and each model grader's request timeout, then kills
the process and the sandboxes it started.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BASE_S = 10.0  # wall seconds for everything but the python graders' sandboxes
MEMORY_MB = 2048  # address space of the process (a python grader's sandbox gets its own 1024)
JUDGE_SETTINGS = ("QERL_GRADER_BASE_URL", "QERL_GRADER_API_KEY", "QERL_GRADER_TIMEOUT_SECONDS",
                  "QERL_GRADER_CONCURRENCY")  # what a model grader reads
ROOT = Path(__file__).resolve().parents[1]  # where ``service`` and ``engine`` import from, installed or not


def budget_s(grader: Any) -> float:
    """Wall seconds a run of ``grader`` may take: BASE_S plus, per python grader, its own limit, and
    per model grader one request's timeout."""
    from engine.rewards.model_grader import Judge
    from engine.rewards.multi import leaves
    from engine.rewards.python_grader import PythonGrader

    def own_s(g: Any) -> float:
        if isinstance(g, PythonGrader):
            return g.limits.startup_s + g.limits.wall_s + 1.0
        judge = getattr(g, "judge", None)
        return judge.timeout_s if isinstance(judge, Judge) else 0.0

    return BASE_S + sum(own_s(g) for g in leaves(grader))


def run(grader_cfg: dict[str, Any], grader: Any, sample: str, item: dict[str, Any], *, data_dir: Path,
        artifact_dir: Path) -> dict[str, Any]:
    """{"reward", "scores", "sub_rewards", "execution_time"} or {"error": kind, "message", ...}.

    ``grader`` is ``grader_cfg`` built (and so checked) by the caller. A python grader's sandbox
    hides ``data_dir`` and ``artifact_dir`` (other projects' files, the database of an embedded
    server) as the worker's does."""
    budget = budget_s(grader)
    payload = json.dumps({"grader": grader_cfg, "sample": sample, "item": item, "budget_s": budget})
    with tempfile.TemporaryDirectory(prefix="qerl-grader-run-") as tmp:  # removed even when the run is killed
        # not the API's environment (database URL, secrets): what the grader code and hidden_dirs() read
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(Path.home()),
               "PYTHONPATH": str(ROOT), "TMPDIR": tmp, "QERL_DATA_DIR": str(data_dir),
               "ARTIFACT_DIR": str(artifact_dir)}
        for name in ("QERL_CACHE_DIR", *JUDGE_SETTINGS):
            if os.environ.get(name):
                env[name] = os.environ[name]
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-s", "-m", "service.grader_run"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp, env=env,
                                start_new_session=True, text=True)
        try:
            out, err = proc.communicate(payload, timeout=budget)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.communicate()
            return {"error": "timeout", "execution_time": time.monotonic() - start,
                    "message": f"the grader did not finish within {budget:g} s ({BASE_S:g} s, plus each python "
                               "grader's own limit); look for a regular expression that backtracks, or texts "
                               "too long for text_similarity"}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = err.strip()[-300:]
    return {"error": "other", "execution_time": time.monotonic() - start,
            "message": f"the grading process exited with code {proc.returncode}" + (f": {tail}" if tail else "")}


def _kill_tree(pid: int) -> None:
    """Kill the process group ``pid`` leads and the sandboxes it started (each leads its own group)."""
    try:
        os.killpg(pid, signal.SIGSTOP)  # it starts nothing more while its children are found
    except ProcessLookupError:
        return
    for child in _children(pid):
        try:
            os.killpg(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the (command name)
                found.append(int(entry))
    return found


# -- the child process -----------------------------------------------------------------------
def _grade(job: dict[str, Any]) -> dict[str, Any]:
    """Build the grader and call it once, as engine.evaluate.grade does; failures as data."""
    from engine.rewards import build_grader
    from engine.rewards.model_grader import ModelGraderError, judge_models, judge_tokens
    from engine.rewards.multi import MultiGrader
    from engine.rewards.python_grader import GraderError

    grader = build_grader(job["grader"])
    start = time.perf_counter()
    try:
        score, parts = grader(job["sample"], job["item"])
        score = float(score)
    except ModelGraderError as exc:  # the judge failed, refused, or answered nothing readable
        failure = {"error": f"model_{exc.kind}", "message": str(exc)}
    except GraderError as exc:  # the user's python code raised, or hit a limit of its sandbox
        failure = {"error": "python_timeout" if exc.timed_out else "python_runtime", "message": str(exc)}
    except (OSError, subprocess.SubprocessError) as exc:  # its sandbox could not be started
        failure = {"error": "python_server", "type": type(exc).__name__, "message": f"{type(exc).__name__}: {exc}"}
    except ValueError as exc:  # the item lacks a field the grader reads (a dataset error in training)
        failure = {"error": "invalid_item", "message": str(exc)}
    except MemoryError:
        failure = {"error": "other", "message": f"the grader needed more than {MEMORY_MB} MB of memory; shorten "
                                                "the sample or the item's texts"}
    except Exception as exc:  # noqa: BLE001 - anything else is reported with the run, not raised
        failure = {"error": "other", "message": f"{type(exc).__name__}: {exc}"[:500]}
    else:
        elapsed = time.perf_counter() - start
        if not all(math.isfinite(v) for v in (score, *parts.values())):
            return {"error": "other", "execution_time": elapsed,
                    "message": f"the grader's output is not finite ({score}, parts {parts}); keep "
                               "calculate_output's constants small enough that it stays below 1e308"}
        subs = {k: parts[k] for k in grader.graders} if isinstance(grader, MultiGrader) else {}
        judged = judge_models(grader)
        return {"reward": score, "scores": parts, "sub_rewards": subs, "execution_time": elapsed,
                "token_usage": judge_tokens(grader) if judged else None,
                "sampled_model_name": ", ".join(judged) or None}
    return {**failure, "execution_time": time.perf_counter() - start}


def _main() -> None:
    import resource

    job = json.loads(sys.stdin.read())
    for res, value in ((resource.RLIMIT_AS, MEMORY_MB << 20), (resource.RLIMIT_CPU, math.ceil(job["budget_s"]) + 1)):
        hard = resource.getrlimit(res)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (value, value))
    print(json.dumps(_grade(job)), flush=True)


if __name__ == "__main__":
    _main()
