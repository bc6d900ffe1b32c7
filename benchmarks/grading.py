"""Seconds to grade one RL step's samples with a python grader: one sandbox per sample (how the
training loop graded before graders took a step's samples together) against ``Grader.batch``
(what it does now: the samples go to the sandbox in batches of ``Limits.batch``), alone and
inside a multi grader, side by side in one run on fresh samples.

    .venv/bin/python benchmarks/grading.py                  # 8 prompts x 8 samples, 3 repeats
    .venv/bin/python benchmarks/grading.py --samples 256 --repeats 5
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.rewards import build_grader

PYTHON = {"type": "python", "name": "py", "source": (
    "def grade(sample, item):\n"
    "    words = sample['output_text'].split()\n"
    "    return float(bool(words) and words[-1].strip('.') == item['answer'])\n")}
MULTI = {"type": "multi", "name": "both", "calculate_output": "0.2 * fmt + 0.8 * py",
         "graders": {"fmt": {"type": "format", "pattern": r"^The answer is \d+\.$"}, "py": PYTHON}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=64, help="samples in the step (prompts x generations)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random()
    print(f"{'grader':8} {'samples':>7} {'per sample (s)':>15} {'batched (s)':>12} {'ratio':>7}")
    for name, cfg in (("python", PYTHON), ("multi", MULTI)):
        grader = build_grader(cfg)
        one, batched = [], []
        for _ in range(args.repeats):
            nums = [rng.randint(0, 999) for _ in range(args.samples)]
            texts = [f"The answer is {n}." for n in nums]
            items = [{"answer": str(n if rng.random() < 0.5 else n + 1)} for n in nums]
            t0 = time.perf_counter()
            singles = [grader(t, i) for t, i in zip(texts, items)]
            one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            together = grader.batch(texts, items)
            batched.append(time.perf_counter() - t0)
            assert singles == together, "batched grading must give the same scores"
        a, b = statistics.median(one), statistics.median(batched)
        print(f"{name:8} {args.samples:7d} {a:15.3f} {b:12.3f} {a / b:6.1f}x")


if __name__ == "__main__":
    main()
