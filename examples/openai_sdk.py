"""Drive qerl with the official ``openai`` SDK.

qerl answers OpenAI's fine-tuning API, so the SDK works once ``base_url`` points at the server.
qerl's own options (quantization, LoRA, AQN, rollout, steps) travel in ``extra_body={"qerl": ...}``
and come back under ``job.model_extra["qerl"]``. A succeeded job's per-step metrics are its results
file (``job.result_files``: step_metrics.csv, read with ``files.content``). What the SDK has no call
for, the trained adapter itself, comes from ``qerl.client.Client``.

    qerl serve &                        # embedded mode: prints an API key and saves it locally
    python examples/openai_sdk.py       # reads the server URL and key from that local config

    # or against any deployment:
    QERL_BASE_URL=https://qerl.example.com QERL_API_KEY=sk-qerl-... python examples/openai_sdk.py --steps 30

Steps: upload a JSONL file (files.create), try the grader on a right and a wrong answer
(fine_tuning.alpha.graders.validate and run), create a reinforcement job with it
(fine_tuning.jobs.create), follow it (retrieve + list_events), list its checkpoints
(checkpoints.list), read its per-step metrics (files.content of its results file), then download
and verify the LoRA adapter, ready for
``peft.PeftModel.from_pretrained`` or vLLM's ``LoRARequest``.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from qerl.client import Client

# A prompt per line plus the fields the grader reads ({{item.answer}}).
EXAMPLE_ROWS = [{"messages": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
                 "answer": str(a + b)} for a, b in [(12, 7), (31, 4), (8, 9), (25, 25), (3, 14), (40, 2), (17, 6),
                                                    (9, 9), (11, 30), (6, 27), (22, 13), (5, 48)]]
# OpenAI's string_check grader: full reward when the completion contains the answer.
GRADER = {"type": "string_check", "name": "answer", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "like"}
TERMINAL = ("succeeded", "failed", "cancelled")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="qerl server (default: QERL_BASE_URL or the local config)")
    ap.add_argument("--api-key", help="API key (default: QERL_API_KEY or the local config)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a base model from GET /v1/models")
    ap.add_argument("--train-file", type=Path, help="JSONL training file (default: a small arithmetic set)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--qerl", default="{}", help='more qerl options as JSON, e.g. \'{"rollout": {"max_new_tokens": 32}}\'')
    ap.add_argument("--out", type=Path, default=Path("adapters"), help="where the adapter is extracted")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the job")
    args = ap.parse_args()

    qerl = Client(base_url=args.base_url, api_key=args.api_key)  # resolves the URL and key once
    sdk = OpenAI(base_url=f"{qerl.base_url}/v1", api_key=qerl.api_key, max_retries=2)

    # 1. upload the training data
    train = args.train_file
    if train is None:
        train = Path(tempfile.mkdtemp()) / "arithmetic.jsonl"
        train.write_text("".join(json.dumps(r) + "\n" for r in EXAMPLE_ROWS))
    with train.open("rb") as fh:
        file = sdk.files.create(file=fh, purpose="fine-tune")
    print(f"uploaded {file.filename} as {file.id} ({file.bytes} bytes)")

    # 2. try the grader first: on a right and a wrong answer to the first row (OpenAI's grader endpoints)
    sdk.fine_tuning.alpha.graders.validate(grader=GRADER)
    row = EXAMPLE_ROWS[0]
    for sample in (f"It is {row['answer']}.", "It is 0."):
        scored = sdk.fine_tuning.alpha.graders.run(grader=GRADER, model_sample=sample, item=row)
        print(f"grader on {sample!r}: reward {scored.reward}")

    # 3. create a reinforcement fine-tuning job; qerl's options go in extra_body
    options = {"steps": args.steps, "quantization": "nvfp4", "lora": {"r": 8},
               "aqn": {"enabled": True, "sigma_start": 1e-2, "sigma_end": 5e-4},
               "rollout": {"num_generations": 4, "max_new_tokens": 16},
               "data": {"eval_size": 4}}  # held out of the 12 rows for evaluation (the default is 32)
    options.update(json.loads(args.qerl))
    job = sdk.fine_tuning.jobs.create(
        model=args.model, training_file=file.id, seed=0, suffix="sdk-example",
        method={"type": "reinforcement",
                "reinforcement": {"grader": GRADER, "hyperparameters": {"batch_size": 2}}},
        extra_body={"qerl": options})
    total = job.model_extra["qerl"]["progress"]["total_steps"]
    print(f"created {job.id}: {job.status}, {total} steps on {job.model}")

    # 4. follow it: retrieve for the status, list_events (newest first) for what happened
    seen: set[str] = set()
    deadline = time.monotonic() + args.timeout
    while True:
        job = sdk.fine_tuning.jobs.retrieve(job.id)
        new = [e for e in sdk.fine_tuning.jobs.list_events(job.id, limit=50).data if e.id not in seen]
        for event in reversed(new):
            seen.add(event.id)
            print(f"  [{event.level}] {event.message}")
        if job.status in TERMINAL:
            break
        if time.monotonic() > deadline:
            print(f"job {job.id} still {job.status} after {args.timeout:.0f} s; cancelling it")
            sdk.fine_tuning.jobs.cancel(job.id)
            return 1
        time.sleep(2)
    if job.status != "succeeded":
        print(f"job {job.id} {job.status}: {job.error.code if job.error else ''} "
              f"{job.error.message if job.error else ''}")
        return 1
    print(f"{job.id} succeeded: {job.fine_tuned_model} ({job.trained_tokens} trained tokens)")

    # 5. checkpoints (one every qerl.checkpoint_interval steps), with the metrics of their step
    for ckpt in sdk.fine_tuning.jobs.checkpoints.list(job.id):
        reward = ckpt.metrics.model_extra.get("reward_mean") if ckpt.metrics.model_extra else None
        print(f"  checkpoint step {ckpt.step_number}: {ckpt.fine_tuned_model_checkpoint} reward={reward}")

    # 6. every step's metrics: the job's results file, a CSV (held-out scores on the steps that evaluated)
    results = sdk.files.content(job.result_files[0]).text
    for m in csv.DictReader(io.StringIO(results)):
        if m["eval/accuracy"]:
            print(f"  eval at step {m['step']}: accuracy {float(m['eval/accuracy']):.3f}, "
                  f"reward {float(m['eval/reward_mean']):.3f}")

    # 7. what the SDK does not cover: the adapter itself (sha256 verified on download)
    adapter_id = job.model_extra["qerl"]["adapter_id"]
    out = qerl.download_adapter(adapter_id, args.out / adapter_id)
    print(f"adapter {adapter_id} downloaded and verified in {out}")
    print(f"  peft.PeftModel.from_pretrained(base_model, {str(out)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
