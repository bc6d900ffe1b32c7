"""The demo job: SmolLM2-135M learns two-term one-digit products in 20 steps on CPU.

Chosen because the base model's mean sampled reward sits clearly between 0 and 1 with the
one-shot worked example (so GRPO groups have reward variance from step 0) and a plain GRPO run
climbs towards 1 within 20-30 steps. One-digit products have only 100 distinct questions, so the
eval split holds out 20 of them and training never sees those. Reward = 0.2 for the tag format
+ 1.0 for reasoning-gym's own score of the tagged answer.
"""
from __future__ import annotations

from typing import Any

DEMO_GRADER: dict[str, Any] = {
    "type": "multi",
    "name": "reward",
    "graders": {
        "format": {"type": "format", "pattern": r"<answer>\s*\S.*?</answer>", "match": "search"},
        "answer": {"type": "reasoning_gym", "task": "products"},
    },
    "calculate_output": "0.2 * format + answer",
}

DEMO_SPEC: dict[str, Any] = {
    "model": "smollm2-135m-instruct",
    "quantization": "nvfp4",
    "grader": DEMO_GRADER,
    "data": {
        "dataset": {"source": "reasoning_gym", "task": "products", "size": 400, "seed": 0,
                    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
        "eval_size": 20,
        "one_shot": True,
    },
    "lora": {"r": 16, "alpha": 32},
    # T=0.7: at T=1.0 the 4-bit 135M model samples far worse than its greedy answers (mean reward 0.15 vs
    # 0.68 for bf16 on the same prompts), too little signal for 20 steps.
    "rollout": {"num_generations": 4, "max_new_tokens": 64, "temperature": 0.7, "top_p": 1.0, "top_k": 0},
    "rl": {"algorithm": "dapo"},
    "optim": {"lr": 1e-4},
    "steps": 20,
    "prompts_per_step": 8,
    "micro_batch_size": 16,
    "checkpoint_interval": 10,
    "log_samples": 20,  # every held-out answer of each evaluation (the demo shows the most improved)
    "gradient_checkpointing": False,  # 135M fits; recomputation would only slow the CPU steps
    "seed": 0,
}
