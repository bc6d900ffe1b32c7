"""Reward curves of the demo job: QeRL (NVFP4 base + LoRA + AQN) against bf16-LoRA and NF4-LoRA.

Runs engine.data.demo.DEMO_SPEC once per method on the same seed, data and hyper-parameters
(only the base format and AQN differ) and prints mean reward per block of steps, greedy eval
accuracy before/after, and speed. On two CPU cores each method takes ~10 minutes.

    .venv/bin/python benchmarks/demo_curve.py                 # all three methods
    .venv/bin/python benchmarks/demo_curve.py --methods nvfp4-aqn --steps 10
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

from engine import NullReporter, TrainSpec, train
from engine.data.demo import DEMO_SPEC

METHODS = {
    "nvfp4-aqn": {"quantization": "nvfp4", "aqn": {"enabled": True}},  # the demo job (QeRL)
    "nvfp4": {"quantization": "nvfp4", "aqn": {"enabled": False}},
    "bf16": {"quantization": "bf16", "aqn": {"enabled": False}},  # plain LoRA
    "nf4": {"quantization": "nf4", "aqn": {"enabled": False}},  # QLoRA
}


def method_spec(name: str, steps: int | None, seed: int) -> TrainSpec:
    spec = copy.deepcopy(DEMO_SPEC)
    for key, value in METHODS[name].items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    if steps is not None:
        spec["steps"] = steps
    spec["seed"] = seed
    spec["checkpoint_interval"] = 0
    return TrainSpec.from_dict(spec)


def run(name: str, steps: int | None, seed: int, workdir: Path) -> dict:
    spec = method_spec(name, steps, seed)
    rep = NullReporter()
    t0 = time.monotonic()
    result = train(spec, workdir=workdir / name, reporter=rep, should_stop=lambda: False)
    seconds = time.monotonic() - t0
    steps_m = [m for _, m in rep.steps if "reward_mean" in m]
    print(f"{name}: {result.steps} steps in {seconds:.0f} s", flush=True)
    return {
        "rewards": [m["reward_mean"] for m in steps_m],
        "accuracy": [m["accuracy"] for m in steps_m],
        "eval_before": result.metrics.get("eval_initial/accuracy", float("nan")),
        "eval_after": result.metrics.get("eval/accuracy", float("nan")),
        "seconds": seconds,
        "step_s": sum(m["step_s"] for m in steps_m) / max(len(steps_m), 1),
        "tokens_per_s": sum(m["rollout_tokens_per_s"] for m in steps_m) / max(len(steps_m), 1),
    }


def table(results: dict[str, dict], block: int) -> str:
    names = list(results)
    n = max(len(r["rewards"]) for r in results.values())
    lines = ["| steps | " + " | ".join(f"{k} reward" for k in names) + " |",
             "|---|" + "---|" * len(names)]
    for s in range(0, n, block):
        cells = []
        for k in names:
            chunk = results[k]["rewards"][s:s + block]
            cells.append(f"{sum(chunk) / len(chunk):.3f}" if chunk else "")
        lines.append(f"| {s + 1}-{min(s + block, n)} | " + " | ".join(cells) + " |")
    for label, key, fmt in (("eval acc before", "eval_before", "{:.3f}"), ("eval acc after", "eval_after", "{:.3f}"),
                            ("s / step", "step_s", "{:.1f}"), ("rollout tok/s", "tokens_per_s", "{:.0f}"),
                            ("total s", "seconds", "{:.0f}")):
        lines.append(f"| {label} | " + " | ".join(fmt.format(results[k][key]) for k in names) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="nvfp4-aqn,bf16,nf4", help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--steps", type=int, default=None, help="override the demo's step count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block", type=int, default=5, help="steps per row of the table")
    ap.add_argument("--workdir", type=Path, default=None, help="keep runs here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw curves here")
    args = ap.parse_args()
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method {unknown[0]!r}; pick from {', '.join(METHODS)}")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        results = {name: run(name, args.steps, args.seed, workdir) for name in names}
    print(table(results, args.block))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
