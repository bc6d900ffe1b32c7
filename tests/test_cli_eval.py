"""`qerl eval`: a trained adapter scored on a test file, beside its base alone. On the held-out rows
of a real training run it must give exactly the run's own held-out evaluation: the adapter's
numbers those of the final evaluation, the base's those of the evaluation at step 0 (when the
LoRA's B is zero), on the CPU and (skipped without one) on a GPU, where both run the CUDA-graph
engine; and its rows are checked before any model loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.metrics import mean
from qerl.cli import app

GRADER = {"type": "text_similarity", "name": "similar", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"}
METRICS = ("accuracy", "reward_mean", "reward_std", "completion_len_mean", "truncated_frac", "reward/similar")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def trained(request, tiny_model_dir, tmp_path_factory):
    """(adapter dir, the run's result, its held-out rows as a JSONL file, the device): 4 steps on
    the tiny model with 4 prompts held out, graded by text similarity to a fixed answer."""
    from engine import NullReporter, train
    from engine.data import load_examples
    from engine.spec import TrainSpec

    root = tmp_path_factory.mktemp("eval")
    rows = root / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Say e {i}", "answer": "e e e e"}) + "\n" for i in range(16)))
    spec = TrainSpec.from_dict({
        "model": "tiny", "quantization": "nvfp4", "device": request.param, "seed": 3, "grader": GRADER,
        "data": {"train_file": str(rows), "eval_size": 4, "max_prompt_tokens": 256},
        "lora": {"r": 4}, "rollout": {"num_generations": 4, "max_new_tokens": 8},
        "rl": {"mask_truncated": False}, "optim": {"lr": 5e-2, "warmup_ratio": 0.0},
        "steps": 4, "prompts_per_step": 2, "micro_batch_size": 4, "checkpoint_interval": 0})
    result = train(spec, workdir=root / f"run-{request.param}", reporter=NullReporter(), should_stop=lambda: False)
    _, held_out = load_examples(spec.data, spec.seed)
    test = root / "held_out.jsonl"
    test.write_text("".join(json.dumps(ex.item) + "\n" for ex in held_out))
    return result.adapter_dir, result, test, request.param


def _flat(output: str) -> str:
    """A message as said, without the box typer draws around it and its line breaks."""
    return " ".join(output.replace("│", " ").split())


def _eval(*args: str, device: str = "cpu") -> dict:
    run = CliRunner().invoke(app, ["eval", *args, "--device", device, "--json"])
    assert run.exit_code == 0, run.output
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_eval_on_the_held_out_rows_gives_the_runs_own_evaluation(trained, tmp_path):
    adapter, result, test, device = trained
    rows = tmp_path / "rows.jsonl"
    got = _eval(str(adapter), "--file", str(test), "--output", str(rows), device=device)  # the grader from the manifest
    assert got["rows"] == 4 and got["model"] == "tiny" and got["quantization"] == "nvfp4" and got["grader"] == "similar"
    assert got["max_new_tokens"] == 8
    for key in METRICS:
        assert got["fine_tuned"][key] == pytest.approx(result.metrics[f"eval/{key}"], abs=1e-9), key
        assert got["base"][key] == pytest.approx(result.metrics[f"eval_initial/{key}"], abs=1e-9), key
    assert got["fine_tuned"]["reward_mean"] != got["base"]["reward_mean"]  # training moved it
    per_row = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["line"] for r in per_row] == [1, 2, 3, 4]
    assert mean(r["reward"] for r in per_row) == pytest.approx(got["fine_tuned"]["reward_mean"])
    assert mean(r["base_reward"] for r in per_row) == pytest.approx(got["base"]["reward_mean"])
    assert all(r["messages"][-1]["content"].startswith("Say e ") and len(r["messages"]) > 1 for r in per_row)  # framed

    exact = dict(GRADER, type="string_check", operation="eq", name="exact")  # another grader, given on the line
    exact.pop("evaluation_metric")
    (tmp_path / "exact.json").write_text(json.dumps(exact))
    strict = _eval(str(adapter), "--file", str(test), "--grader", str(tmp_path / "exact.json"), "--limit", "2",
                   "--no-compare", device=device)
    assert strict["rows"] == 2 and strict["grader"] == "exact" and strict["base"] is None
    want = [float(r["completion"] == "e e e e") for r in per_row[:2]]
    assert strict["fine_tuned"]["reward_mean"] == pytest.approx(mean(want))

    shown = CliRunner().invoke(app, ["eval", str(adapter), "--file", str(test), "--device", device])
    assert shown.exit_code == 0, shown.output
    assert "accuracy" in shown.stdout and "base alone" in shown.stdout and "graded by similar" in shown.stdout


def test_eval_checks_its_input_before_a_model_loads(trained, tmp_path, monkeypatch):
    import engine.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(engine.model, "load_model", no_model)
    adapter, _, _, device = trained
    if device != "cpu":
        pytest.skip("checked once, on the CPU run's adapter")
    runner = CliRunner()
    typo = tmp_path / "typo.jsonl"
    typo.write_text('{"prompt": "a", "answer": "e"}\n{"prompt": "b", "answr": "e"}\n')
    missing = runner.invoke(app, ["eval", str(adapter), "--file", str(typo), "--device", "cpu"])
    assert missing.exit_code == 2, missing.output
    assert "item.answer is in 1 of 2 rows (the first without it: line 2)" in _flat(missing.output), missing.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "e"}\n{"text": "b"}\n')
    bad_line = runner.invoke(app, ["eval", str(adapter), "--file", str(bad), "--device", "cpu"])
    assert bad_line.exit_code == 2 and "line 2: missing 'prompt' or 'messages'" in _flat(bad_line.output)
    (tmp_path / "g.json").write_text(json.dumps({"type": "string_check", "input": "{{sample.output_text}}",
                                                 "reference": "x", "operation": "nope"}))
    bad_grader = runner.invoke(app, ["eval", str(adapter), "--file", str(typo), "--grader", str(tmp_path / "g.json")])
    assert bad_grader.exit_code == 2 and "grader.operation" in _flat(bad_grader.output)

    bare = tmp_path / "bare"  # an adapter whose manifest records no grader
    bare.mkdir()
    for f in Path(adapter).iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((bare / "qerl_manifest.json").read_text())
    del manifest["grader"]
    (bare / "qerl_manifest.json").write_text(json.dumps(manifest))
    no_grader = runner.invoke(app, ["eval", str(bare), "--file", str(typo), "--device", "cpu"])
    assert no_grader.exit_code == 2 and "records no grader" in _flat(no_grader.output)


def test_several_adapters_side_by_side(trained, tmp_path):
    """Two adapters in one call score as each does alone, the base alone once; adapters trained with
    different graders, or on different bases, are refused with the fix."""
    adapter, _, test, device = trained
    if device != "cpu":
        pytest.skip("checked once, on the CPU run's adapter")
    other = tmp_path / "other"  # the same LoRA scaled: another adapter on the same base
    other.mkdir()
    for f in Path(adapter).iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "adapter_model.safetensors"))
    save_file({k: v * 3 if "lora_B" in k else v for k, v in weights.items()}, str(other / "adapter_model.safetensors"))
    rows = tmp_path / "rows.jsonl"
    run = CliRunner().invoke(app, ["eval", str(adapter), str(other), "--file", str(test), "--device", "cpu", "--json",
                                   "--output", str(rows)])
    assert run.exit_code == 0, run.output
    both = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [b["ref"] for b in both] == [str(adapter), str(other)]
    for b in both:
        one = _eval(b["ref"], "--file", str(test))
        assert (one["fine_tuned"], one["base"]) == (b["fine_tuned"], b["base"])
    assert both[0]["fine_tuned"] != both[1]["fine_tuned"]
    assert [json.loads(line)["adapter"] for line in rows.read_text().splitlines()] == [str(adapter)] * 4 + [str(other)] * 4
    table = CliRunner().invoke(app, ["eval", str(adapter), str(other), "--file", str(test), "--device", "cpu"])
    assert table.exit_code == 0 and "2 adapters" in _flat(table.stdout) and "base alone" in table.stdout

    manifest = json.loads((other / "qerl_manifest.json").read_text())
    (other / "qerl_manifest.json").write_text(json.dumps({**manifest, "grader": {**manifest["grader"], "name": "x"}}))
    graders = CliRunner().invoke(app, ["eval", str(adapter), str(other), "--file", str(test), "--device", "cpu"])
    assert graders.exit_code == 2 and "trained with different graders" in _flat(graders.output)
    (other / "qerl_manifest.json").write_text(json.dumps({**manifest, "quantization": "bf16"}))
    bases = CliRunner().invoke(app, ["eval", str(adapter), str(other), "--file", str(test), "--device", "cpu"])
    assert bases.exit_code == 2 and "tiny (bf16)); score them one base at a time" in _flat(bases.output), bases.output
    nothing = CliRunner().invoke(app, ["eval", "--file", str(test)])
    assert nothing.exit_code == 2 and "give an ADAPTER" in _flat(nothing.output)


def test_fresh_questions_of_the_task_an_adapter_trained_on(tiny_model_dir, tmp_path):
    """--task: questions of a reasoning-gym task as test rows, asked as training asked them (its
    system turn and worked example), graded by the task's own scorer from the manifest; those the
    adapter trained on are left out, also when asked for with the training's own seed."""
    from engine import NullReporter, train
    from engine.data.builtin import reasoning_gym_entries
    from engine.spec import TrainSpec
    from tests._worker_fixtures import tiny_spec

    spec = TrainSpec.from_dict(tiny_spec("tiny", steps=1, seed=5))
    result = train(spec, workdir=tmp_path / "run", reporter=NullReporter(), should_stop=lambda: False)
    trained_on = {e["question"] for e in reasoning_gym_entries(spec.data.dataset, spec.seed)[0]}
    manifest = json.loads((result.adapter_dir / "qerl_manifest.json").read_text())
    assert manifest["dataset"] == spec.data.dataset and len(trained_on) == 16

    rows = tmp_path / "rows.jsonl"
    got = _eval(str(result.adapter_dir), "--task", "products", "--size", "6", "--output", str(rows))
    assert (got["rows"], got["task"], got["file"], got["grader"]) == (6, "products", None, "task")
    asked = [json.loads(line) for line in rows.read_text().splitlines()]
    assert all(r["messages"][:-1] == manifest["prompt_framing"] for r in asked)
    questions = [r["messages"][-1]["content"] for r in asked]
    assert len(set(questions)) == 6 and not set(questions) & trained_on

    again = tmp_path / "again.jsonl"  # the training's own seed: its questions come first, and are left out
    run = CliRunner().invoke(app, ["eval", str(result.adapter_dir), "--task", "products", "--size", "4", "--seed",
                                   str(spec.seed), "--device", "cpu", "--no-compare", "--output", str(again)])
    assert run.exit_code == 0, run.output
    assert "16 that the adapter trained on left out" in _flat(run.stdout), run.stdout
    assert not {json.loads(line)["messages"][-1]["content"] for line in again.read_text().splitlines()} & trained_on

    small = json.loads((result.adapter_dir / "qerl_manifest.json").read_text())  # trained on all ~100 questions
    small["dataset"] = {**small["dataset"], "size": 400,
                        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    tight = tmp_path / "tight"
    tight.mkdir()
    for f in result.adapter_dir.iterdir():
        (tight / f.name).write_bytes(f.read_bytes())
    (tight / "qerl_manifest.json").write_text(json.dumps(small))
    none_left = CliRunner().invoke(app, ["eval", str(tight), "--task", "products", "--device", "cpu"])
    assert none_left.exit_code == 2 and "too few questions to hold any out" in _flat(none_left.output), none_left.output
    for args, said in ((["--task", "products", "--file", str(rows)], "give the test rows"), ([], "give the test rows"),
                       (["--task", "no_such_task"], "'no_such_task' is not a reasoning-gym task")):
        bad = CliRunner().invoke(app, ["eval", str(result.adapter_dir), *args, "--device", "cpu"])
        assert bad.exit_code == 2 and said in _flat(bad.output), bad.output
