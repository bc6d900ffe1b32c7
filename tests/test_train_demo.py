"""The demo job runs end to end on the real SmolLM2-135M-Instruct (NVFP4 base, LoRA, AQN).

One step only (the full demo is benchmarks/demo_curve.py), a smaller eval split, a checkpoint
at step 1: this checks that the real model, tokenizer, chat template, reasoning-gym data and
grader fit together, and that the adapter it writes is a PEFT adapter of the Hub model.
25-50 s on two idle CPU cores, minutes when the machine is shared: marked slow.
"""
from __future__ import annotations

import copy
import json

import pytest

from engine import NullReporter, TrainSpec, train
from engine.data.demo import DEMO_SPEC
from engine.manifest import verify_adapter

pytestmark = pytest.mark.slow


def test_demo_spec_runs_one_step(tmp_path):
    raw = copy.deepcopy(DEMO_SPEC)
    raw.update(steps=1, checkpoint_interval=1, prompts_per_step=4, device="cpu")
    raw["data"]["eval_size"] = 4
    rep = NullReporter()
    result = train(TrainSpec.from_dict(raw), workdir=tmp_path, reporter=rep, should_stop=lambda: False)

    assert result.steps == 1 and not result.stopped
    (step, m), = [(s, m) for s, m in rep.steps if "reward_mean" in m]
    assert step == 1 and 0.0 <= m["reward_mean"] <= 1.2 and m["aqn_sigma"] == 0.0  # stage 0 is noise-free
    assert m["rollout_tokens_per_s"] > 0 and m["completion_len_mean"] > 0
    assert {"eval_initial/accuracy", "eval/accuracy", "reward/format", "reward/answer"} <= set(result.metrics)
    assert rep.checkpoints and rep.checkpoints[0][0] == 1

    manifest = verify_adapter(result.adapter_dir)
    assert manifest["quantization"] == "nvfp4"
    assert manifest["base_model"]["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert manifest["base_model"]["weights_sha256"]
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and config["r"] == 16
