"""A short GRPO job through the service with rollout.backend "vllm": a real ``qerl serve``
(embedded worker) in .venv-vllm, the job created and watched with the ``qerl`` CLI, SmolLM2-135M
with an NVFP4 base (vLLM samples from its dequantized bf16 weights on CPU), LoRA r=8, AQN on."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from tests._vllm_env import needs_vllm, run_in_vllm_env

STEPS = 2
pytestmark = pytest.mark.timeout(900)


def test_in_vllm_env() -> None:
    run_in_vllm_env(__file__)


@needs_vllm
def test_a_grpo_job_runs_end_to_end_with_vllm_rollouts(tmp_path, monkeypatch):
    from engine.model.load import resolve_model_dir
    from tests._client_server import start_server, stop_server

    monkeypatch.setenv("QERL_MODELS", json.dumps({"smollm2-vllm": str(resolve_model_dir("smollm2-135m-instruct"))}))
    served = start_server(tmp_path / "serve")
    try:
        sets = {"qerl.device": "cpu", "qerl.quantization": "nvfp4", "qerl.lora.r": 8, "qerl.rollout.backend": "vllm",
                "qerl.rollout.kv_cache_memory_bytes": 256 * 2**20, "qerl.rollout.max_new_tokens": 16,
                "qerl.rollout.num_generations": 2, "qerl.prompts_per_step": 2, "qerl.data.eval_size": 0,
                "qerl.checkpoint_interval": 1, "qerl.rl.algorithm": "grpo",
                "qerl.rl.mask_truncated": False}  # every sampled token trains: the KL check below sees them all
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
        created = served.qerl("jobs", "create", "--model", "smollm2-vllm", "--dataset", "products",
                              "--dataset-size", "16", "--steps", str(STEPS), "--seed", "1", *args, "--json")
        assert created.returncode == 0, created.stderr
        job_id = json.loads(created.stdout)["id"]
        watch = served.qerl("jobs", "watch", job_id, "--interval", "1", timeout=700)
        assert watch.returncode == 0, (watch.stdout[-3000:], served.log_tail())
        url = f"{served.url}/v1/fine_tuning/jobs/{job_id}"
        job = httpx.get(url, headers=served.headers).json()
        assert job["status"] == "succeeded" and job["qerl"]["spec"]["rollout"]["backend"] == "vllm"
        events = httpx.get(f"{url}/events", params={"limit": 1000}, headers=served.headers).json()["data"]
        starts = [e for e in events if (e.get("data") or {}).get("rollout_backend")]
        assert starts and all(e["data"]["rollout_backend"] == "vllm" for e in starts), events
        metrics = httpx.get(f"{url}/metrics", headers=served.headers).json()["data"]
        steps = [m for m in metrics if "reward_mean" in m["values"]]
        assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
        for m in steps:
            v = m["values"]
            assert v["rollout_tokens_per_s"] > 0 and v["completion_len_mean"] > 0
            # vLLM's log-probs against the learner's on the same tokens (k3 KL): bf16 vs NVFP4-in-bf16
            # kernels, plus AQN noise from step 2 on; a wrong distribution would be far above this
            assert v["updates_skipped"] == 0 and math.isfinite(v["kl_sampler"]) and v["kl_sampler"] < 0.05, v
        print("vllm job metrics:", [{k: round(m["values"][k], 4) for k in ("kl_sampler", "aqn_sigma",
                                     "rollout_tokens_per_s", "reward_mean")} for m in steps])
        assert job["qerl"]["adapter_id"]
    finally:
        stop_server(served)
