"""The training loop on a tiny random model (CPU): what changes, stopping, errors, learning.

The tiny model's lm_head is scaled up 4x so its next-token distribution is peaked (entropy
~5 nats instead of ~10.8 for a uniform vocabulary): a random model then has a few likely
tokens per position, which gives rewards a variance to learn from.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import NullReporter, TrainError, TrainSpec, train
from engine.checkpoint import list_checkpoints, load_checkpoint
from engine.manifest import MANIFEST, sha256_file, verify_adapter

E_SIMILARITY = {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
                "evaluation_metric": "fuzzy_match"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from engine.model.tiny import make_tiny_model

    out = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tie_word_embeddings=False)
    weights = out / "model.safetensors"
    sd = load_file(str(weights))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 4.0
    save_file(sd, str(weights), metadata={"format": "pt"})
    return out


def write_rows(path: Path, n: int = 12, answer: str = "e" * 16) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Say e {i}", "answer": answer}) + "\n" for i in range(n)))
    return path


def make_spec(model_dir: Path, data_file: Path, **over) -> TrainSpec:
    spec = {
        "model": str(model_dir), "quantization": "nvfp4", "grader": E_SIMILARITY,
        "data": {"train_file": str(data_file), "eval_size": 2, "one_shot": False, "system_prompt": "",
                 "max_prompt_tokens": 64},
        "lora": {"r": 4, "alpha": 8},
        "aqn": {"enabled": True, "sigma_start": 1e-2, "sigma_end": 1e-3, "stages": 2},
        "rollout": {"num_generations": 4, "max_new_tokens": 6, "max_batch": 16},
        "rl": {"mask_truncated": False},  # a random model never ends a sample: train on truncated ones
        "optim": {"lr": 1e-2, "warmup_ratio": 0.0},
        "steps": 2, "prompts_per_step": 2, "micro_batch_size": 3, "checkpoint_interval": 0, "seed": 0,
        "device": "cpu",
    }
    for key, value in over.items():
        if isinstance(value, dict):
            spec[key] = {**spec.get(key, {}), **value}
        else:
            spec[key] = value
    return TrainSpec.from_dict(spec)


def test_updates_change_the_adapter_only(tiny_dir, tmp_path):
    from engine.lora import adapter_params
    from engine.train_loop import _Run

    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"), steps=4, rl={"mu": 2, "kl_coef": 0.05})
    run = _Run(spec, tmp_path / "run", NullReporter(), lambda: False)
    run._setup()
    trainable = {id(p) for p in run.model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in adapter_params(run.model)}
    adapter_names = {n for n, p in run.model.named_parameters() if id(p) in trainable}
    before = {k: v.detach().clone() for k, v in run.model.state_dict().items()}

    sigmas = [run._rollout_step()["aqn_sigma"] for _ in range(2)]  # 2 rollouts x mu=2 updates
    assert run.step == 4 and sigmas[0] == 0.0 and sigmas[1] == pytest.approx(1e-2)
    after = run.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "no weight changed"
    assert changed <= adapter_names, f"base tensors changed: {sorted(changed - adapter_names)[:3]}"
    assert any(k.endswith("lora_B") for k in changed)
    assert all(n.noise is None for n in run.model.aqn_norms())  # AQN noise never outlives a step
    from engine.quant.base import FrozenLinear

    frozen = [m for m in run.model.modules() if isinstance(m, FrozenLinear)]
    assert frozen and not any("_matmul" in m.__dict__ or "_matmul_t" in m.__dict__ for m in frozen)


def test_micro_batching_keeps_the_full_batch_gradient(tiny_dir, tmp_path):
    """The loss denominator spans the whole rollout batch: 8 micro-batches of 1 sequence give the
    gradient of 1 micro-batch of 8 (a per-micro-batch mean would give 8x)."""
    from engine.train_loop import _Run

    grads = {}
    for size in (1, 8):
        spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"), steps=1, micro_batch_size=size,
                         optim={"grad_clip": 0.0}, aqn={"enabled": False}, data={"eval_size": 0},
                         rl={"kl_coef": 0.05, "algorithm": "dapo"})
        run = _Run(spec, tmp_path / f"run{size}", NullReporter(), lambda: False)
        run._setup()
        captured = []
        step = run.optimizer.step

        def capture(*args, _step=step, _out=captured, _run=run, **kwargs):
            _out.append([p.grad.detach().clone() for p in _run.params])
            return _step(*args, **kwargs)

        run.optimizer.step = capture
        run._rollout_step()
        grads[size] = captured[0]
    g1, g8 = (torch.cat([g.flatten() for g in grads[k]]) for k in (1, 8))
    assert float(g8.norm()) > 0
    # bf16 activations round differently with and without padding: compare whole vectors
    rel = float((g1 - g8).norm() / g8.norm())
    assert rel < 0.05 and abs(float(g1.norm() / g8.norm()) - 1.0) < 0.05, (rel, float(g1.norm()), float(g8.norm()))


def test_resume_is_bit_identical(tiny_dir, tmp_path):
    """4 steps straight == 2 steps, stop inside the 3rd rollout, restart from the checkpoint, 2 more."""
    data = write_rows(tmp_path / "d.jsonl")
    over = dict(steps=4, checkpoint_interval=2, lora={"r": 4, "alpha": 8, "dropout": 0.1},
                rl={"kl_coef": 0.05}, aqn={"apply_in_training": True})
    straight = NullReporter()
    res_a = train(make_spec(tiny_dir, data, **over), workdir=tmp_path / "a", reporter=straight,
                  should_stop=lambda: False)

    first = NullReporter()
    calls = {"n": 0}

    def stop_in_third_rollout() -> bool:
        if sum("reward_mean" in m for _, m in first.steps) < 2:
            return False
        calls["n"] += 1
        return calls["n"] > 1  # the step-boundary check passes; generate's poll stops

    res_b1 = train(make_spec(tiny_dir, data, **over), workdir=tmp_path / "b", reporter=first,
                   should_stop=stop_in_third_rollout)
    assert res_b1.stopped and res_b1.steps == 2
    ckpt_dir = tmp_path / "b" / "checkpoints" / "step-000002"
    assert load_checkpoint(ckpt_dir).step == 2

    torch.manual_seed(1234)  # a new process starts from other random states
    torch.randn(100)
    second = NullReporter()
    res_b2 = train(make_spec(tiny_dir, data, **over), workdir=tmp_path / "b", reporter=second,
                   should_stop=lambda: False, resume_from=ckpt_dir)
    assert not res_b2.stopped and res_b2.steps == 4
    assert any("Resumed from checkpoint step 2" in msg for _, msg, _ in second.events)

    wa = load_file(str(res_a.adapter_dir / "adapter_model.safetensors"))
    wb = load_file(str(res_b2.adapter_dir / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # each checkpoint holds its step's LoRA as a PEFT adapter: the last one is the final adapter
    last = tmp_path / "a" / "checkpoints" / "step-000004" / "adapter"
    wc = load_file(str(last / "adapter_model.safetensors"))
    assert wc.keys() == wa.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)
    assert (last / "adapter_config.json").read_text() == (res_a.adapter_dir / "adapter_config.json").read_text()
    early = json.loads((ckpt_dir / "adapter" / "qerl_manifest.json").read_text())
    assert early["steps"] == 2 and early["stopped_early"] is True
    assert not any(torch.equal(wa[k], v) for k, v in load_file(str(ckpt_dir / "adapter" /
                                                                    "adapter_model.safetensors")).items()
                   if k.endswith("lora_B.weight"))  # step 2's LoRA, not step 4's
    steps_a = {s: m for s, m in straight.steps if "reward_mean" in m}
    steps_b = {s: m for s, m in second.steps if "reward_mean" in m}
    assert sorted(steps_b) == [3, 4]
    for s in (3, 4):
        assert steps_a[s]["reward_mean"] == steps_b[s]["reward_mean"]
        assert steps_a[s]["loss"] == steps_b[s]["loss"]


def test_training_further_starts_from_the_given_adapter(tiny_dir, tmp_path):
    """init_adapter: a new run's LoRA starts as the given PEFT adapter, bit for bit; a LoRA shape
    other than the adapter's is refused naming the field and the value to use."""
    from engine.lora import adapter_state_dict
    from engine.train_loop import _Run

    data = write_rows(tmp_path / "d.jsonl")
    first = train(make_spec(tiny_dir, data), workdir=tmp_path / "a", reporter=NullReporter(), should_stop=lambda: False)
    trained = load_file(str(first.adapter_dir / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in trained.items())

    reporter = NullReporter()
    run = _Run(make_spec(tiny_dir, data, init_adapter=str(first.adapter_dir), seed=5), tmp_path / "b", reporter,
               lambda: False)
    run._setup()
    now = adapter_state_dict(run.model)
    assert now.keys() == trained.keys() and all(torch.equal(now[k].float(), trained[k].float()) for k in now)
    assert any("Starting from the LoRA" in msg for _, msg, _ in reporter.events)
    further = train(make_spec(tiny_dir, data, init_adapter=str(first.adapter_dir)), workdir=tmp_path / "c",
                    reporter=NullReporter(), should_stop=lambda: False)
    assert not further.stopped and further.steps == 2
    # its greedy evaluation before training is the first run's after it (and not a fresh LoRA's)
    assert further.metrics["eval_initial/reward_mean"] == first.metrics["eval/reward_mean"]
    assert first.metrics["eval/reward_mean"] != first.metrics["eval_initial/reward_mean"]

    for over, field in (({"lora": {"r": 8, "alpha": 8}}, "lora.r=4"), ({"lora": {"alpha": 4}}, "lora.alpha=8"),
                        ({"lora": {"target_modules": ["q_proj"]}}, "lora.target_modules")):
        with pytest.raises(TrainError) as bad:
            train(make_spec(tiny_dir, data, init_adapter=str(first.adapter_dir), **over), workdir=tmp_path / "d",
                  reporter=NullReporter(), should_stop=lambda: False)
        assert bad.value.code == "invalid_spec" and field in str(bad.value), str(bad.value)
    with pytest.raises(TrainError) as missing:
        train(make_spec(tiny_dir, data, init_adapter=str(tmp_path / "nowhere")), workdir=tmp_path / "e",
              reporter=NullReporter(), should_stop=lambda: False)
    assert missing.value.code == "invalid_spec" and "not a PEFT LoRA directory" in str(missing.value)


def test_early_stop_ends_the_run_when_the_held_out_reward_plateaus(tiny_dir, tmp_path):
    """early_stop_patience=2 with an evaluation every step: a run that cannot learn (lr 1e-12, so every
    greedy evaluation scores what the start did) ends after the second evaluation that is no
    better, a finished run with its adapter, saying why; the count survives a resume (a run stopped
    after step 1's evaluation and resumed ends at the same step); without it every step runs."""
    data = write_rows(tmp_path / "d.jsonl")
    flat = dict(steps=6, eval_interval=1, early_stop_patience=2, aqn={"enabled": False},
                optim={"lr": 1e-12, "warmup_ratio": 0.0, "weight_decay": 0.0}, checkpoint_interval=1)
    rep = NullReporter()
    res = train(make_spec(tiny_dir, data, **flat), workdir=tmp_path / "a", reporter=rep, should_stop=lambda: False)
    assert not res.stopped and res.steps == 2 and verify_adapter(res.adapter_dir)["steps"] == 2
    rewards = [m["eval/reward_mean"] for _, m in rep.steps if "eval/reward_mean" in m]
    assert len(rewards) == 3 and len(set(rewards)) == 1  # step 0, 1 and 2: no better than the start
    said = [msg for _, msg, _ in rep.events if msg.startswith("Stopping early")]
    assert said == [f"Stopping early at step 2/6: 2 evaluations since step 0 scored no higher than its held-out "
                    f"reward {rewards[0]:.3f} (early_stop_patience=2)"], rep.events
    assert any(msg.startswith("Training finished: 2 steps of 6 (stopped early)") for _, msg, _ in rep.events)

    first = NullReporter()
    stopped = train(make_spec(tiny_dir, data, **flat), workdir=tmp_path / "b", reporter=first,  # after step 1's eval
                    should_stop=lambda: any(s == 1 and "eval/reward_mean" in m for s, m in first.steps))
    assert stopped.stopped and stopped.steps == 1
    again = NullReporter()
    resumed = train(make_spec(tiny_dir, data, **flat), workdir=tmp_path / "b", reporter=again,
                    should_stop=lambda: False, resume_from=tmp_path / "b" / "checkpoints")
    assert not resumed.stopped and resumed.steps == 2
    assert any(msg.startswith("Stopping early at step 2/6") for _, msg, _ in again.events)

    cut = NullReporter()  # stopped during step 1's evaluation: the resumed run evaluates step 1 first
    stopped = train(make_spec(tiny_dir, data, **flat), workdir=tmp_path / "e", reporter=cut,
                    should_stop=lambda: any(s == 1 and "reward_mean" in m for s, m in cut.steps))
    assert stopped.stopped and stopped.steps == 1
    assert [s for s, m in cut.steps if "eval/reward_mean" in m] == [0]
    assert load_checkpoint(tmp_path / "e" / "checkpoints").state["eval_due"] == 1
    redo = NullReporter()
    resumed = train(make_spec(tiny_dir, data, **flat), workdir=tmp_path / "e", reporter=redo,
                    should_stop=lambda: False, resume_from=tmp_path / "e" / "checkpoints")
    assert not resumed.stopped and resumed.steps == 2
    assert [s for s, m in redo.steps if "eval/reward_mean" in m] == [1, 2]
    assert [m for _, m, _ in redo.events if m.startswith("Stopping early")] == [
        m for _, m, _ in rep.events if m.startswith("Stopping early")]

    patient = train(make_spec(tiny_dir, data, **{**flat, "steps": 3, "early_stop_patience": 0}),
                    workdir=tmp_path / "c", reporter=NullReporter(), should_stop=lambda: False)
    assert patient.steps == 3
    for bad in ({"eval_interval": 0}, {"data": {"eval_size": 0}}):
        with pytest.raises(ValueError, match="early_stop_patience counts evaluations"):
            make_spec(tiny_dir, data, **{**flat, **bad})


def test_stop_at_a_step_boundary_saves_a_checkpoint(tiny_dir, tmp_path):
    rep = NullReporter()
    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"), steps=3)
    res = train(spec, workdir=tmp_path / "run", reporter=rep,
                should_stop=lambda: any("reward_mean" in m for _, m in rep.steps))
    assert res.stopped and res.steps == 1
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-000001"]
    assert rep.checkpoints == [(1, tmp_path / "run" / "checkpoints" / "step-000001")]
    manifest = verify_adapter(res.adapter_dir)
    assert manifest["steps"] == 1 and manifest["stopped_early"] is True
    assert manifest["base_model"]["weights_sha256"]["model.safetensors"] == sha256_file(tiny_dir / "model.safetensors")
    config = json.loads((res.adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_dir) and config["r"] == 4


def test_bad_rows_name_their_line(tiny_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "e"}\n{"prompt": "b", "answer": "e"}\n{"prompt": 3}\n')
    with pytest.raises(TrainError, match="line 3") as err:
        train(make_spec(tiny_dir, bad), workdir=tmp_path / "r1", reporter=NullReporter(), should_stop=lambda: False)
    assert err.value.code == "invalid_dataset"

    long = write_rows(tmp_path / "long.jsonl", n=6)
    lines = long.read_text().splitlines()
    lines[3] = json.dumps({"prompt": "word " * 200, "answer": "e"})
    long.write_text("\n".join(lines) + "\n")
    with pytest.raises(TrainError, match=r"line 4 \((training|eval) split\): .*max_prompt_tokens=64") as err:
        train(make_spec(tiny_dir, long), workdir=tmp_path / "r2", reporter=NullReporter(), should_stop=lambda: False)
    assert err.value.code == "invalid_dataset"


def test_rows_without_a_field_the_grader_reads_fail_before_the_model_loads(tiny_dir, tmp_path, monkeypatch):
    """A grader reading {{item.answer}} over rows some of which lack it would end the job at the
    first rollout that draws one; the job fails at once instead, naming the file, how many rows have
    the field, the first line without it and the fields the rows do have (a typo shows), before any
    weights load; a validation file is checked on its own."""
    import engine.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the rows were checked")

    monkeypatch.setattr(engine.model, "load_model", no_model)
    lines = write_rows(tmp_path / "d.jsonl").read_text().splitlines()
    for i in (6, 9):  # lines 7 and 10
        lines[i] = json.dumps({"prompt": f"Say e {i}", "answr": "e"})
    (tmp_path / "typo.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TrainError) as err:
        train(make_spec(tiny_dir, tmp_path / "typo.jsonl"), workdir=tmp_path / "r1", reporter=NullReporter(),
              should_stop=lambda: False)
    assert err.value.code == "invalid_dataset"
    assert str(err.value).startswith("data.train_file: the grader reads fields every row must have: item.answer "
                                     "is in 10 of 12 rows (the first without it: line 7); the rows' fields are "
                                     "answer, answr, prompt."), err.value
    spec = make_spec(tiny_dir, write_rows(tmp_path / "ok.jsonl"), data={"validation_file": str(tmp_path / "typo.jsonl")})
    with pytest.raises(TrainError, match=r"^data\.validation_file: .*item\.answer is in [0-9]+ of 2 rows") as err:
        train(spec, workdir=tmp_path / "r2", reporter=NullReporter(), should_stop=lambda: False)


def test_rows_a_reasoning_gym_grader_cannot_score_fail_before_the_model_loads(tiny_dir, tmp_path, monkeypatch):
    """A reasoning_gym grader without a task scores each row by the task the row names: a row that
    names none, or a task reasoning-gym does not have, fails the job before any weights load,
    naming its line, inside a multi grader too; rows that all name a task train."""
    import engine.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the rows were checked")

    monkeypatch.setattr(engine.model, "load_model", no_model)
    rows = [{"prompt": f"What is {i} times 3?", "answer": str(3 * i), "task": "products"} for i in range(12)]
    rows[4] = {k: v for k, v in rows[4].items() if k != "task"}  # line 5: no task
    rows[8]["task"] = "productz"  # line 9: a task reasoning-gym lacks
    graders = [{"type": "reasoning_gym"},
               {"type": "multi", "calculate_output": "0.1 * f + a",
                "graders": {"f": {"type": "format", "pattern": "answer"}, "a": {"type": "reasoning_gym"}}}]
    for k, grader in enumerate(graders):
        data = tmp_path / f"d{k}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(TrainError) as err:
            train(dataclasses.replace(make_spec(tiny_dir, data), grader=grader), workdir=tmp_path / f"r{k}",
                  reporter=NullReporter(), should_stop=lambda: False)
        assert err.value.code == "invalid_dataset"
        assert str(err.value).startswith("data.train_file line 5: reasoning_gym grader: the dataset row names no "
                                         "task; set grader.task"), err.value
        rows_ok = rows[:4] + rows[5:]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows_ok))
        with pytest.raises(TrainError, match=r"^data\.train_file line 8: unknown reasoning-gym task 'productz'"):
            train(dataclasses.replace(make_spec(tiny_dir, data), grader=grader), workdir=tmp_path / f"s{k}",
                  reporter=NullReporter(), should_stop=lambda: False)
        rows_ok = rows_ok[:7] + [{**rows_ok[7], "task": "products"}] + rows_ok[8:]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows_ok))
        with pytest.raises(AssertionError, match="the model was loaded"):  # the rows passed
            train(dataclasses.replace(make_spec(tiny_dir, data), grader=grader), workdir=tmp_path / f"t{k}",
                  reporter=NullReporter(), should_stop=lambda: False)


def test_max_runtime_checkpoints_then_fails(tiny_dir, tmp_path):
    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"), max_runtime_s=1e-3, data={"eval_size": 0})
    with pytest.raises(TrainError) as err:
        train(spec, workdir=tmp_path / "run", reporter=NullReporter(), should_stop=lambda: False)
    assert err.value.code == "max_runtime_exceeded" and "max_runtime_s" in str(err.value)
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-000000"]


def test_max_gpu_memory_gib_is_checked():
    assert TrainSpec().max_gpu_memory_gib is None
    assert TrainSpec.from_dict({"max_gpu_memory_gib": 0.5}).max_gpu_memory_gib == 0.5
    for bad, says in ((0, "must be in (0, 100000]; got 0"), (-1, "must be in (0, 100000]; got -1"),
                      ("8", "must be a number; got '8'"), (True, "must be a number; got True")):
        with pytest.raises(ValueError) as err:  # a JSON body: the type is checked first
            TrainSpec.from_dict({"max_gpu_memory_gib": bad})
        assert str(err.value).startswith(f"max_gpu_memory_gib {says}"), err.value
        with pytest.raises(ValueError, match=r"^max_gpu_memory_gib must be (a number )?in \(0, 100000\]"):
            TrainSpec(max_gpu_memory_gib=bad)


def test_a_gpu_memory_cap_does_not_apply_on_cpu(tiny_dir, tmp_path):
    """The cap limits torch's CUDA allocator (tests/test_gpu_path.py); a CPU job runs uncapped and says so once."""
    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"), steps=1, data={"eval_size": 0},
                     max_gpu_memory_gib=0.01)
    rep = NullReporter()
    res = train(spec, workdir=tmp_path / "run", reporter=rep, should_stop=lambda: False)
    assert res.steps == 1 and not res.stopped
    notes = [(level, m, d) for level, m, d in rep.events if "max_gpu_memory_gib" in m]
    assert notes == [("warn", "max_gpu_memory_gib=0.01 does not apply on cpu: the job runs without a memory cap",
                      {"max_gpu_memory_gib": 0.01, "applied": False})], rep.events
    start = next(d for _, m, d in rep.events if m.startswith("Training"))
    assert start["device"] == "cpu" and "max_gpu_memory_gib" not in start
    end = next(m for _, m, _ in rep.events if m.startswith("Training finished"))  # nothing held out: no nan
    assert end.endswith("; no held-out evaluation (data.eval_size is 0 and there is no validation_file)"), end


def test_the_gpu_memory_cap_with_torch_cuda_faked(tiny_dir, tmp_path, monkeypatch):
    """What tests/test_gpu_path.py checks on a real GPU, with torch.cuda's calls faked around a CPU
    job: the cap is set as a fraction of the device's memory and shown in the start event, lifted in
    close() also when the job fails, and named in the out-of-memory message; a cap above the
    device's memory fails ``invalid_spec`` before the device is touched."""
    from types import SimpleNamespace

    from engine.train_loop import _Run
    from engine.types import OOM_ADVICE

    calls = []

    def set_fraction(fraction, device):  # as torch's: a device index (torch.device("cuda") is refused)
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=16 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    real = _Run._cap_gpu_memory

    def on_a_fake_gpu(self):
        self.device = torch.device("cuda")  # as a job's device is: no index
        try:
            real(self)
        finally:
            self.device = torch.device("cpu")

    monkeypatch.setattr(_Run, "_cap_gpu_memory", on_a_fake_gpu)

    class ExhaustedGPU(NullReporter):
        def event(self, level, message, data=None):
            super().event(level, message, data)
            if message.startswith("Training"):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    rep = ExhaustedGPU()
    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"), steps=1, data={"eval_size": 0},
                     max_gpu_memory_gib=4)
    with pytest.raises(TrainError) as err:
        train(spec, workdir=tmp_path / "r1", reporter=rep, should_stop=lambda: False)
    assert err.value.code == "out_of_memory" and str(err.value) == (
        OOM_ADVICE + " This job was capped at 4 GiB by max_gpu_memory_gib; raise it if the GPU has room."), err.value
    assert calls == [(0.25, 0), (1.0, 0), "empty_cache"]
    (message, start), = [(m, d) for _, m, d in rep.events if m.startswith("Training")]
    assert start["max_gpu_memory_gib"] == 4 and "memory capped at 4 GiB (max_gpu_memory_gib)" in message

    calls.clear()
    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"), max_gpu_memory_gib=16.5)
    with pytest.raises(TrainError) as err:
        train(spec, workdir=tmp_path / "r2", reporter=NullReporter(), should_stop=lambda: False)
    assert err.value.code == "invalid_spec" and str(err.value) == (
        "max_gpu_memory_gib=16.5 is more than cuda:0 has (16.0 GiB); lower max_gpu_memory_gib to at most the "
        "device's memory or leave it unset"), err.value
    assert calls == []


def test_reward_rises_on_a_learnable_task(tiny_dir, tmp_path):
    """GRPO on 'write text that looks like eeee...' (continuous fuzzy-match reward).

    Seeds 0-3 rose by 0.37, 0.30, 0.19, 0.11 (mean of the last 3 steps minus the first 3)."""
    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl", n=8), steps=10, prompts_per_step=2,
                     rollout={"num_generations": 8, "max_new_tokens": 8}, micro_batch_size=16,
                     optim={"lr": 5e-2, "schedule": "constant", "grad_clip": 1.0, "weight_decay": 0.0},
                     aqn={"enabled": False}, data={"eval_size": 0})
    rep = NullReporter()
    train(spec, workdir=tmp_path / "run", reporter=rep, should_stop=lambda: False)
    rewards = [m["reward_mean"] for _, m in rep.steps if "reward_mean" in m]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, f"reward did not rise: {[round(r, 3) for r in rewards]}"


def test_cli_train_holds_out_a_quarter_of_a_small_set(tmp_path):
    """`qerl train` on a spec without data.eval_size holds out what a job through the service would:
    a quarter of the distinct questions of fewer than 128 (it had been 32 whatever the file, an error
    for any file of 32 questions or fewer); an eval_size given, or a validation file, is kept."""
    from qerl.cli_engine import _load_spec

    rows = "".join(json.dumps({"prompt": f"Say e {i % 10}", "answer": "e"}) + "\n" for i in range(30))
    (tmp_path / "d.jsonl").write_text(rows)
    grader = {"type": "string_check", "operation": "eq", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}"}

    def held(data: dict) -> int:
        (tmp_path / "spec.json").write_text(json.dumps({"grader": grader, "data": data}))
        return _load_spec(tmp_path / "spec.json").data.eval_size

    assert held({"train_file": str(tmp_path / "d.jsonl")}) == 2  # 10 distinct questions in 30 rows
    assert held({"train_file": str(tmp_path / "d.jsonl"), "eval_size": 5}) == 5
    assert held({"train_file": str(tmp_path / "d.jsonl"), "validation_file": str(tmp_path / "d.jsonl")}) == 32
    assert held({"dataset": {"source": "reasoning_gym", "task": "products", "size": 20}}) == 5
    assert held({"dataset": {"source": "reasoning_gym", "task": "products"}}) == 32  # 200 by default


def test_cli_train_and_quantize(tiny_dir, tmp_path):
    import typer
    from typer.testing import CliRunner

    from engine.model import load_model
    from qerl.cli_engine import register

    app = typer.Typer()
    register(app)
    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"), steps=1)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(tmp_path / "spec.json"), "--workdir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "finished after 1 steps" in result.output
    assert (tmp_path / "run" / "adapter" / MANIFEST).is_file()
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {(x["step"], x["kind"]) for x in samples} >= {(1, "train")}
    assert all({"prompt", "completion", "reward", "scores", "finish_reason", "tokens"} <= set(x) for x in samples)

    bad = runner.invoke(app, ["train", str(tmp_path / "d.jsonl")])
    assert bad.exit_code != 0

    result = runner.invoke(app, ["quantize", str(tiny_dir), str(tmp_path / "nvfp4")])
    assert result.exit_code == 0, result.output
    model, _ = load_model(str(tmp_path / "nvfp4"), quantization="nvfp4")
    assert model.model.layers[0].self_attn.q_proj.fmt == "nvfp4"
    again = runner.invoke(app, ["quantize", str(tiny_dir), str(tmp_path / "nvfp4")])
    assert again.exit_code == 2 and "not empty" in again.output


def test_graph_rollout_engine_trains_like_the_eager_one(tiny_dir, tmp_path, monkeypatch):
    """The native backend on the CUDA-graph engine (what a GPU job uses; here it runs eagerly on
    CPU with torch ops) serves the job's rollouts and evals: with the same seed its first step
    samples the same tokens as the eager sampler (same rewards), with log-probs within bf16
    rounding of them (fused projections round differently; the loss's sampler correction sees
    that), and the run completes with finite metrics."""
    import math

    from engine.rollout import cuda_graph
    from engine.rollout.backend import native_engine

    calls = []
    real = cuda_graph.generate
    monkeypatch.setattr(cuda_graph, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    data = write_rows(tmp_path / "d.jsonl")
    steps = {}
    for engine in ("eager", "graph"):
        monkeypatch.setenv("QERL_ROLLOUT_ENGINE", engine)
        rep = NullReporter()
        train(make_spec(tiny_dir, data), workdir=tmp_path / engine, reporter=rep, should_stop=lambda: False)
        steps[engine] = {s: m for s, m in rep.steps if "reward_mean" in m}
        if engine == "eager":
            assert not calls
    assert len(calls) == 4  # eval at the start, two rollouts, eval at the end
    first_a, first_b = steps["eager"][1], steps["graph"][1]
    for key in ("reward_mean", "completion_len_mean"):
        assert first_a[key] == first_b[key], key
    assert abs(first_a["loss"] - first_b["loss"]) < 0.01
    assert abs(first_a["kl_sampler"] - first_b["kl_sampler"]) < 0.01
    assert sorted(steps["graph"]) == [1, 2]
    assert all(math.isfinite(v) for m in steps["graph"].values() for v in m.values())

    class On:  # a stand-in for a model's device
        def __init__(self, kind: str) -> None:
            self.device = torch.device(kind)

    monkeypatch.setenv("QERL_ROLLOUT_ENGINE", "auto")
    assert (native_engine(On("cpu")), native_engine(On("cuda"))) == ("eager", "graph")
    monkeypatch.setenv("QERL_ROLLOUT_ENGINE", "fast")
    with pytest.raises(ValueError, match="QERL_ROLLOUT_ENGINE"):
        native_engine(On("cpu"))


def test_cpu_without_fast_bf16_trains_bf16_values_in_fp32(tiny_dir, tmp_path, monkeypatch):
    """Where the CPU has no bf16 matmul fast path, the job holds the bf16 model's values in fp32
    (same NVFP4 codes), says so in its start event, and trains its adapter."""
    from engine.lora import adapter_params
    from engine.train_loop import _Run

    spec = make_spec(tiny_dir, write_rows(tmp_path / "d.jsonl"))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # whatever this CPU has
    fast = _Run(spec, tmp_path / "fast", NullReporter(), lambda: False)
    fast._setup()  # the same job where bf16 is fast: its untrained model
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    events = NullReporter()
    run = _Run(spec, tmp_path / "slow", events, lambda: False)
    result = run.run(None)
    assert result.steps == spec.steps and not result.stopped
    assert fast.model.dtype == torch.bfloat16 and run.model.dtype == torch.float32
    trained = run.model.state_dict()
    for k, v in fast.model.state_dict().items():
        if "lora_" in k:
            continue
        assert torch.equal(v.float(), trained[k]) if v.dtype == torch.bfloat16 else torch.equal(v, trained[k]), k
    assert any(not torch.equal(a, b) for a, b in zip(adapter_params(fast.model), adapter_params(run.model)))
    message, data = next((m, d) for _, m, d in events.events if m.startswith("Training"))
    assert data["compute_dtype"] == "float32" and "computed in fp32" in message


def test_a_gpu_memory_cap_fits_an_in_process_vllm_share_to_it():
    """rollout.gpu_memory_utilization is a share of the whole GPU: under max_gpu_memory_gib the
    default share becomes GPU_MEMORY_UTILIZATION of the cap, a share larger than the cap is refused
    naming both fields, and jobs without a cap, with a KV-cache size or on the native backend keep
    their rollout settings as given."""
    from types import SimpleNamespace

    from engine.rollout.vllm_engine import GPU_MEMORY_UTILIZATION
    from engine.train_loop import _Run

    def run(cap, **rollout):
        spec = TrainSpec.from_dict({"rollout": {"backend": "vllm", **rollout}, "max_gpu_memory_gib": cap})
        fake = SimpleNamespace(spec=spec, gpu_memory_cap_gib=cap, _gpu_total=64 * 2**30, device=torch.device("cuda", 0))
        return spec, _Run._rollout_spec(fake)

    spec, r = run(16)
    assert r.gpu_memory_utilization == pytest.approx(GPU_MEMORY_UTILIZATION * 0.25)
    assert spec.rollout.gpu_memory_utilization is None and r.max_batch == spec.rollout.max_batch
    assert run(16, gpu_memory_utilization=0.2)[1].gpu_memory_utilization == 0.2
    with pytest.raises(TrainError) as err:
        run(16, gpu_memory_utilization=0.5)
    assert err.value.code == "invalid_spec" and str(err.value) == (
        "rollout.gpu_memory_utilization=0.5 asks vLLM for 32.0 GiB of cuda:0, more than max_gpu_memory_gib=16; "
        "lower it to at most 0.250 (leaving the trainer room), set rollout.kv_cache_memory_bytes instead, or "
        "raise max_gpu_memory_gib"), err.value
    for spec, r in (run(None), run(16, kv_cache_memory_bytes=2**30),
                    run(16, backend="native", gpu_memory_utilization=0.9)):
        assert r is spec.rollout


def test_final_adapter_best_eval_keeps_the_best_evaluated_steps_lora(tiny_model_dir, tmp_path):
    """final_adapter=best_eval: the job's adapter is the LoRA of the evaluated step with the highest
    held-out reward (the later one on a tie), the same weights as that step's checkpoint, with
    that step's metrics; a pause and resume in between keeps the choice."""
    from tests._worker_fixtures import tiny_spec

    grader = {"type": "text_similarity", "name": "sim", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}} is the answer", "evaluation_metric": "fuzzy_match"}
    for seed in range(1, 7):  # the first seed whose best step is not the last, so the swap is exercised
        raw = tiny_spec(str(tiny_model_dir), steps=4, seed=seed, eval_interval=1, grader=grader, optim={"lr": 0.05},
                        rl={"algorithm": "grpo", "mask_truncated": False}, data={"eval_size": 2},
                        final_adapter="best_eval", keep_checkpoint_adapters=True)
        spec = TrainSpec.from_dict(raw)
        rep, work = NullReporter(), tmp_path / f"run-{seed}"
        result = train(spec, workdir=work, reporter=rep, should_stop=lambda: False)
        evals = [(step, v["eval/reward_mean"]) for step, v in rep.steps if "eval/reward_mean" in v]
        assert [s for s, _ in evals] == [0, 1, 2, 3, 4]
        best = max(evals, key=lambda e: (e[1], e[0]))
        if best[0] < 4:
            break
    assert best[0] < 4 and len({r for _, r in evals}) > 1, evals  # the LoRA moved the answers
    assert result.metrics["final_adapter_step"] == best[0] and result.metrics["eval/reward_mean"] == best[1]
    manifest = json.loads((work / "adapter" / MANIFEST).read_text())
    assert manifest["steps"] == best[0] and manifest["metrics"]["eval/reward_mean"] == best[1]
    mine = load_file(str(work / "adapter" / "adapter_model.safetensors"))
    kept = load_file(str(work / "checkpoint-adapters" / f"step-{best[0]:06d}" / "adapter_model.safetensors"))
    assert mine.keys() == kept.keys() and all(torch.equal(mine[k], kept[k]) for k in mine)
    assert not (work / "best-adapters").exists()
    assert any(f"adapter is the LoRA of step {best[0]}" in m for _, m, _ in rep.events)
    end = next(m for _, m, _ in rep.events if m.startswith("Training finished"))
    first = next(v["eval/accuracy"] for step, v in rep.steps if step == 0 and "eval/accuracy" in v)
    assert end.endswith(f"; held-out accuracy {first:.3f} -> {result.metrics['eval/accuracy']:.3f}"), end

    # stopped after step 2 and resumed: the same choice (the best so far travels in the checkpoint)
    def stop_after_two() -> bool:
        return len([1 for s, v in rep2.steps if "reward_mean" in v]) >= 2

    rep2, work2 = NullReporter(), tmp_path / "run2"
    stopped = train(spec, workdir=work2, reporter=rep2, should_stop=stop_after_two)
    assert stopped.stopped and stopped.steps == 2
    again = train(spec, workdir=work2, reporter=NullReporter(), should_stop=lambda: False,
                  resume_from=work2 / "checkpoints" / "step-000002")
    assert again.metrics["final_adapter_step"] == best[0]
    resumed = load_file(str(work2 / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(resumed[k], mine[k]) for k in mine)

    with pytest.raises(ValueError, match="final_adapter=best_eval .* set data.eval_size above 0"):
        TrainSpec.from_dict(raw | {"data": raw["data"] | {"eval_size": 0}})  # nothing held out: nothing to pick by
    with pytest.raises(ValueError, match="final_adapter must be one of last, best_eval"):
        TrainSpec.from_dict(raw | {"final_adapter": "best"})
