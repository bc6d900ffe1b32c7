"""A fine-tuning job through the real service on the GPU: the embedded server (SQLite, in-process
worker) trains the tiny model on CUDA, the NVFP4 kernels and the CUDA-graph rollout engine doing
the work, and the adapter it publishes downloads (sha256 checked) and loads in PEFT, and an evaluation of it
through the service (POST /v1/evaluations) scores it on the GPU as engine.score does in the test's
process. Before it, a
job capped below the model's size (``qerl.max_gpu_memory_gib``) fails ``out_of_memory`` in the
same worker process, which must not leave the cap on the next job. Skipped without a CUDA GPU."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from tests._client_server import TRAIN_ROWS, start_server, stop_server
from tests.conftest import jsonl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

JOB_TIMEOUT_S = 600.0


def _job_body(file_id: str, **qerl: object) -> dict:
    """A 3-step job of the tiny model on CUDA; ``qerl`` adds to or replaces its qerl fields."""
    return {
        "model": "tiny", "training_file": file_id, "suffix": "gpu", "seed": 0,
        "method": {"type": "reinforcement", "reinforcement": {"grader": {
            "type": "text_similarity", "name": "similarity", "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"}}},
        "qerl": {"device": "cuda", "quantization": "nvfp4", "steps": 3, "prompts_per_step": 2,
                 "micro_batch_size": 4, "checkpoint_interval": 1, "lora": {"r": 4},
                 "rollout": {"num_generations": 4, "max_new_tokens": 8}, "rl": {"mask_truncated": False},
                 "data": {"eval_size": 2}, **qerl}}


def _finished(client, served, job: dict) -> dict:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job not done in {JOB_TIMEOUT_S:.0f} s:\n{served.log_tail()}"
        time.sleep(0.5)
        job = client.job(job["id"])
    return job


def test_a_service_job_trains_on_the_gpu(tmp_path: Path, tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qerl.client import Client

    served = start_server(tmp_path / "serve")
    try:
        client = Client(base_url=served.url, api_key=served.api_key)
        (tmp_path / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
        file_id = client.upload_file(tmp_path / "train.jsonl")["id"]

        # 0.001 GiB (1 MiB) is less than the tiny model's bf16 embedding (49152 x 64 x 2 bytes = 6 MiB)
        # and than one 2 MiB block of torch's allocator: a real CUDA OOM while the model loads
        capped = _finished(client, served, client.create_job(_job_body(file_id, max_gpu_memory_gib=0.001)))
        assert capped["status"] == "failed", (capped, served.log_tail())
        assert capped["error"]["code"] == "out_of_memory", capped["error"]
        assert "capped at 0.001 GiB by max_gpu_memory_gib" in capped["error"]["message"], capped["error"]

        # the next job in the same worker process has the whole GPU again
        job = _finished(client, served, client.create_job(_job_body(file_id)))
        assert job["status"] == "succeeded", (job.get("error"), served.log_tail())

        # it ran on the GPU, its rollouts on the graph engine, and every step's metrics are finite
        start = [e for e in client.events(job["id"]) if (e.get("data") or {}).get("device")]
        assert start and start[0]["data"]["device"].startswith("cuda"), start
        assert start[0]["data"]["rollout_backend"] == "native"
        steps = [m for m in client.metrics(job["id"]) if "reward_mean" in m["values"]]
        assert [m["step"] for m in steps] == [1, 2, 3]
        assert all(math.isfinite(v) for m in steps for v in m["values"].values())
        assert len(client.checkpoints(job["id"])) >= 1

        # the adapter downloads with its sha256 checked and PEFT loads it on the base model
        out = client.download_adapter(job["qerl"]["adapter_id"], tmp_path / "adapter")
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
        model = PeftModel.from_pretrained(base, out)
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            tuned = model(ids).logits
            with model.disable_adapter():
                plain = model(ids).logits
        assert torch.isfinite(tuned).all()
        assert (tuned - plain).abs().max() > 1e-6, "the trained adapter does not change the base model's logits"

        # an evaluation through the service scores it on the GPU as engine.score scores it here, on the same GPU
        from engine.score import evaluate_adapter, read_test_rows

        (tmp_path / "test.jsonl").write_bytes(jsonl(TRAIN_ROWS[:4]))
        ev = client.post("/v1/evaluations", {"model": job["id"], "file": client.upload_file(tmp_path / "test.jsonl")["id"]})
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while ev["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"evaluation not done in {JOB_TIMEOUT_S:.0f} s:\n{served.log_tail()}"
            time.sleep(0.5)
            ev = client.get(f"/v1/evaluations/{ev['id']}")
        assert ev["status"] == "succeeded", (ev.get("error"), served.log_tail())
        assert ev["result"]["device"].startswith("cuda") and ev["result"]["rows"] == 4, ev["result"]
        here = evaluate_adapter(out, read_test_rows(tmp_path / "test.jsonl"), device="cuda")
        assert here is not None and here.base is not None
        for side, ours in (("fine_tuned", here.fine_tuned), ("base", here.base)):
            theirs = ev["result"][side]
            assert set(theirs) == {k.removeprefix("eval/") for k in ours}, (side, theirs, ours)
            assert all(abs(theirs[k.removeprefix("eval/")] - v) <= 1e-9 for k, v in ours.items()), (side, theirs, ours)
    finally:
        stop_server(served)
