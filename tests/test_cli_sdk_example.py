"""examples/openai_sdk.py, as documented, against the live embedded server: the official openai
SDK uploads, creates a job the real engine trains on the tiny model, follows it, lists its
checkpoints, and the adapter is downloaded and verified."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._client_server import Served, qerl_server  # noqa: F401 (fixture)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "openai_sdk.py"
TINY = {"device": "cpu", "prompts_per_step": 2, "micro_batch_size": 4, "checkpoint_interval": 1,
        "lora": {"r": 4}, "rollout": {"num_generations": 2, "max_new_tokens": 6}, "data": {"eval_size": 2}}


@pytest.mark.timeout(600)
def test_openai_sdk_example_runs_a_job_end_to_end(qerl_server: Served, tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(EXAMPLE), "--model", "tiny", "--steps", "2", "--qerl", json.dumps(TINY),
                          "--out", str(tmp_path), "--timeout", "500"],
                         env=qerl_server.env, capture_output=True, text=True, timeout=560)
    assert run.returncode == 0, (run.stdout, run.stderr, qerl_server.log_tail())
    out = run.stdout
    assert "uploaded arithmetic.jsonl as file-" in out
    assert "grader on 'It is 19.': reward 1.0" in out and "grader on 'It is 0.': reward 0.0" in out
    job_id = out.split("created ", 1)[1].split(":", 1)[0]
    assert f"{job_id}: queued, 2 steps on tiny" in out
    assert "[info] Step 2/2:" in out and f"{job_id} succeeded: ft:tiny:" in out
    assert "checkpoint step 1: ft:tiny:" in out and "checkpoint step 2: ft:tiny:" in out
    assert "eval at step 0: accuracy" in out and "eval at step 2: accuracy" in out
    adapter_dirs = [p for p in tmp_path.iterdir() if p.name.startswith("adapter-")]
    assert len(adapter_dirs) == 1 and f"downloaded and verified in {adapter_dirs[0]}" in out
    assert (adapter_dirs[0] / "adapter_model.safetensors").is_file()
