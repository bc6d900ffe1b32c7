"""The memory plan's held terms against what the engine really allocates (on the CPU here; the GPU
peaks are checked in tests/test_memory_plan_gpu.py), and how ``fit`` picks batch sizes."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine import memory_plan as mp
from engine.lora import adapter_params, apply_lora
from engine.model import ModelConfig
from engine.model.shapes import build_random_model, shape_config
from engine.spec import LoraSpec, RolloutSpec, TrainSpec

# Qwen2.5's layout (q/k/v bias, untied head) at a size the CPU builds in a moment; widths that are
# not multiples of the GPU operand's tiles, so padding would show
SMALL = dict(hidden_size=192, intermediate_size=400, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=32,
             vocab_size=1000)


def _bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("quantization", ["nvfp4", "nf4", "bf16"])
@pytest.mark.parametrize("tied", [False, True])
def test_base_bytes_are_what_the_model_holds(quantization, tied):
    cfg = shape_config("7b", **SMALL, tie_word_embeddings=tied)
    model = build_random_model(cfg, quantization=quantization, device="cpu", seed=1)
    rope = model.inv_freq.numel() * model.inv_freq.element_size()  # not a weight: a few hundred bytes
    assert _bytes(model) - rope == mp.base_bytes(cfg, quantization, operand=False)
    if quantization == "nvfp4":  # the GPU operand pads to whole tiles: more, never less
        assert mp.base_bytes(cfg, quantization) > mp.base_bytes(cfg, quantization, operand=False)


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "down_proj"]])
def test_adapter_numel_is_what_apply_lora_makes(targets):
    cfg = shape_config("7b", **SMALL)
    model = build_random_model(cfg, quantization="bf16", device="cpu")
    apply_lora(model, LoraSpec(r=8, target_modules=targets))
    assert sum(p.numel() for p in adapter_params(model)) == mp.adapter_numel(cfg, 8, targets)


@pytest.mark.parametrize("batch,longest,new", [(4, 100, 60), (1, 3, 1), (8, 256, 256)])
def test_kv_cache_bytes_are_what_the_rollout_engine_allocates(batch, longest, new):
    from engine.rollout.cuda_graph import GraphRollout

    cfg = shape_config("7b", **SMALL)
    model = build_random_model(cfg, quantization="bf16", device="cpu")
    max_len = mp.rollout_max_len(longest, new)
    assert max_len % 256 == 0 and max_len >= longest + new
    eng = GraphRollout(model, max_batch=batch, max_len=max_len)
    held = sum(t.numel() * t.element_size() for t in (eng.kc, eng.vc, eng.valid, eng.rope_cos, eng.rope_sin))
    assert held == mp.kv_cache_bytes(cfg, batch, max_len)


def _spec(**over) -> TrainSpec:
    return dataclasses.replace(TrainSpec(quantization="nvfp4", lora=LoraSpec(r=16), prompts_per_step=8,
                                         micro_batch_size=8,
                                         rollout=RolloutSpec(num_generations=8, max_new_tokens=1024, max_batch=64)),
                               **over)


INPUTS = mp.PlanInputs(longest_prompt=256, rollout_rows=64, eval_rows=32, eight_bit=True)


def test_the_plan_grows_with_each_batch_and_the_base():
    cfg, spec = shape_config("32b"), _spec()
    p = mp.plan(cfg, spec, INPUTS)
    assert p.rollout_batch == 64 and p.micro_batch == 8 and p.max_len == 1280 and p.seq_len == 1280
    assert p.held["KV cache"] == mp.kv_cache_bytes(cfg, 64, 1280)
    assert mp.plan(cfg, spec, INPUTS, rollout_batch=32).peak < p.peak
    assert mp.plan(cfg, spec, INPUTS, micro_batch=4).peak < p.peak
    assert mp.plan(cfg, _spec(quantization="bf16"), INPUTS).peak > p.peak + 40 * mp.GIB  # 2 bytes a weight
    # without checkpointing the learner keeps every layer's activations
    assert mp.plan(cfg, _spec(gradient_checkpointing=False), INPUTS).learner_pass > 4 * p.learner_pass
    # a step decodes no more sequences than it has: 8 x 2 rows and 4 held out take a 16-row engine
    few = mp.PlanInputs(longest_prompt=256, rollout_rows=16, eval_rows=4)
    assert mp.plan(cfg, spec, few).rollout_batch == 16


def test_fit_keeps_what_fits_then_the_largest_rollout_batch_then_the_largest_micro_batch():
    cfg, spec = shape_config("32b"), _spec()
    asked = mp.plan(cfg, spec, INPUTS)
    same = mp.fit(cfg, spec, INPUTS, limit=asked.peak)
    assert (same.rollout_batch, same.micro_batch, same.notes) == (64, 8, [])

    m2 = mp.plan(cfg, spec, INPUTS, micro_batch=2)
    p = mp.fit(cfg, spec, INPUTS, limit=m2.peak)
    assert (p.rollout_batch, p.micro_batch) == (64, 2)
    assert "micro_batch_size 8 -> 2" in p.notes[0] and "rollout" not in p.notes[0]

    # 32 sequences with micro-batches of 4 fit where 64 with 1 do not: the rollout's batch goes down
    # first only as far as it must, and the micro-batch stays as large as fits beside it
    r32 = mp.plan(cfg, spec, INPUTS, rollout_batch=32, micro_batch=4)
    assert r32.peak < mp.plan(cfg, spec, INPUTS, rollout_batch=64, micro_batch=1).peak
    assert r32.peak < mp.plan(cfg, spec, INPUTS, rollout_batch=32, micro_batch=8).peak
    p = mp.fit(cfg, spec, INPUTS, limit=r32.peak)
    assert (p.rollout_batch, p.micro_batch) == (32, 4) and p.peak <= r32.peak
    assert "micro_batch_size 8 -> 4" in p.notes[0] and "rollout sub-batches 64 -> 32" in p.notes[0]

    r16 = mp.plan(cfg, spec, INPUTS, rollout_batch=16, micro_batch=1)
    p = mp.fit(cfg, spec, INPUTS, limit=r16.peak)
    assert (p.rollout_batch, p.micro_batch) == (16, 1)
    lowered = mp.with_batches(spec, p)
    assert (lowered.micro_batch_size, lowered.rollout.max_batch) == (1, 16)
    assert lowered.rollout.max_new_tokens == spec.rollout.max_new_tokens and lowered.lora == spec.lora


def test_what_fits_nowhere_is_refused_with_its_plan_and_the_fields_to_change():
    cfg, spec = shape_config("72b"), _spec(quantization="bf16")
    with pytest.raises(mp.DoesNotFit) as err:
        mp.fit(cfg, spec, INPUTS, limit=80 * mp.GIB)
    text = str(err.value)
    assert "80.0 GiB" in text and "base 1" in text  # 72B's bf16 weights: over a hundred GiB
    for field in ("quantization nvfp4", "rollout.max_new_tokens", "data.max_prompt_tokens", "max_gpu_memory_gib"):
        assert field in text
    # the same job on the NVFP4 base fits the 80 GiB
    assert mp.fit(cfg, _spec(), INPUTS, limit=80 * mp.GIB).fits


def test_a_measured_base_replaces_the_arithmetic():
    cfg, spec = shape_config("7b"), _spec()
    p = mp.plan(cfg, spec, INPUTS, base=7 * mp.GIB)
    assert p.held["model as loaded"] == 7 * mp.GIB and "base" not in p.held
    q = mp.plan(cfg, spec, INPUTS)
    assert q.held["base"] == mp.base_bytes(cfg, "nvfp4") and q.held["LoRA weights"] > 0
    assert set(p.as_dict()) >= {"KV cache", "optimizer", "peak", "rollout_batch", "micro_batch_size"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["nvfp4", "bf16"])
def test_the_plan_bounds_a_measured_rl_step_on_the_gpu(method):
    """benchmarks/rl_step.py's step (rollout in sub-batches on the graph engine, learner micro-batches
    with checkpointing, 8-bit or plain AdamW) on six 7B-shaped layers: torch's peak of the step is
    within the plan's tensors and no less than 70% of them; what torch reserved is within the plan."""
    from types import SimpleNamespace

    from benchmarks import rl_step

    args = SimpleNamespace(prompts=4, samples=4, prompt=200, gen=300, rank=16, rollout_batch=16, micro_batch=4,
                           chunk=512, layers=6)
    row = rl_step.one_step("7b", method, args)
    tensors = (row["plan_gb"] * mp.GIB - mp.FIXED) / (1 + mp.SLACK) / mp.GIB
    assert 0.7 * tensors <= row["step_peak_gb"] <= tensors, (row["step_peak_gb"], tensors, row["plan"])
    assert row["step_reserved_gb"] <= row["plan_gb"], (row["step_reserved_gb"], row["plan"])


# -- `qerl plan` -------------------------------------------------------------------------------
QWEN25_72B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 8192, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 29568,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}  # its config.json


def _plan_cli(tmp_path, *args, spec=None):
    from typer.testing import CliRunner

    from qerl.cli import app

    body = spec or {"model": "smollm2-135m-instruct", "prompts_per_step": 8,
                    "rollout": {"num_generations": 8, "max_new_tokens": 1024},
                    "data": {"max_prompt_tokens": 256, "eval_size": 32,
                             "dataset": {"source": "reasoning_gym", "task": "products"}}}
    (tmp_path / "spec.json").write_text(json.dumps(body))
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_72B))
    return CliRunner().invoke(app, ["plan", str(tmp_path / "spec.json"), *args], terminal_width=200)


def test_qerl_plan_gives_a_72b_jobs_batches_for_an_80_gib_card(tmp_path):
    """The 72B job as asked (micro-batches of 8, 64 sequences decoded together) needs ~100 GiB; the
    plan for an 80 GiB card lowers it to 32 sequences and micro-batches of 4, the settings its RL step
    was measured with on an H100 80GB (66.7 GiB allocated, 70.0 reserved: benchmarks/RESULTS.md)."""
    res = _plan_cli(tmp_path, "--model", str(tmp_path / "config.json"), "--gpu-gib", "80", "--no-eight-bit")
    assert res.exit_code == 0, res.output
    cfg = ModelConfig.from_hf_dict(QWEN25_72B)
    spec = TrainSpec.from_dict(json.loads((tmp_path / "spec.json").read_text()))
    p = mp.fit(cfg, spec, mp.PlanInputs(longest_prompt=256, rollout_rows=64, eval_rows=32), limit=80 * mp.GIB)
    assert (p.rollout_batch, p.micro_batch) == (32, 4)
    out = " ".join(res.output.split())
    assert "fits 80 GiB with micro_batch_size 4 and rollouts of 32 sequences at a time" in out, out
    assert "micro_batch_size 8 -> 4, rollout sub-batches 64 -> 32" in out, out
    assert f"KV cache │ {p.held['KV cache'] / mp.GIB:.2f}" in out and f"{p.peak / mp.GIB:.2f}" in out, out
    by_name = _plan_cli(tmp_path, "--model", "qwen2.5-72b", "--gpu-gib", "80", "--no-eight-bit")  # offline
    assert by_name.exit_code == 0 and "qwen2.5-72b: nvfp4 base" in by_name.output, by_name.output
    assert "qwen2.5-72b: nvfp4 base, LoRA r=16, 64 rollouts of 256 + 1024 tokens a step" in \
        by_name.output.splitlines(), by_name.output  # one line, not wrapped at the table's width
    assert by_name.output[by_name.output.index("┏"):] == res.output[res.output.index("┏"):]  # the same plan


def test_qerl_plan_says_what_does_not_fit_and_what_it_needs(tmp_path):
    res = _plan_cli(tmp_path, "--model", str(tmp_path / "config.json"), "--gpu-gib", "40")
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and "does not fit" in out and "40.0 GiB" in out and "base 41.47" in out, out
    res = _plan_cli(tmp_path, "--model", str(tmp_path / "nowhere"), "--gpu-gib", "80")
    assert res.exit_code == 2 and "--model" in res.output, res.output
    if not torch.cuda.is_available():
        res = _plan_cli(tmp_path, "--model", str(tmp_path / "config.json"))
        assert res.exit_code == 2 and "--gpu-gib" in res.output, res.output


def test_qerl_plan_reads_a_model_directory_and_the_longest_prompt(tmp_path):
    from engine.model.tiny import make_tiny_model

    try:
        model_dir = make_tiny_model(tmp_path / "tiny", arch="qwen2", hidden=64, layers=2)
    except ValueError as exc:  # no SmolLM2 tokenizer here
        pytest.skip(str(exc))
    from engine.data import load_examples
    from engine.model.tokenizer import load_tokenizer
    from engine.train_batch import encode_prompts

    given = _plan_cli(tmp_path, "--model", str(model_dir), "--gpu-gib", "8", "--prompt-tokens", "40")
    read = _plan_cli(tmp_path, "--model", str(model_dir), "--gpu-gib", "8")
    cfg = ModelConfig.from_dir(model_dir)
    spec = TrainSpec.from_dict(json.loads((tmp_path / "spec.json").read_text()))
    # the job's own prompts through the model's tokenizer, as the job encodes them
    train, held_out = load_examples(spec.data, spec.seed)
    tok = load_tokenizer(model_dir)
    longest = max(len(ids) for ids in encode_prompts(tok, train + held_out, 256, "all"))
    assert 40 < longest < 256
    # with only a config.json (no tokenizer beside it) the prompts are taken at data.max_prompt_tokens
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((model_dir / "config.json").read_text())
    bare = _plan_cli(tmp_path, "--model", str(tmp_path / "cfg" / "config.json"), "--gpu-gib", "8")
    for res, prompt in ((given, 40), (read, longest), (bare, 256)):
        assert res.exit_code == 0, res.output
        out = " ".join(res.output.split())  # the table's title wraps
        p = mp.plan(cfg, spec, mp.PlanInputs(longest_prompt=prompt, rollout_rows=64, eval_rows=32))
        assert f"{p.peak / mp.GIB:.2f}" in out and f"64 rollouts of {prompt} + 1024" in out, out
    assert "the job's longest prompt" in read.output and "data.max_prompt_tokens" in bare.output


def test_qerl_plan_takes_a_job_body_as_the_service_would_run_it(tmp_path):
    """A job body (as `qerl jobs create` sends it) plans as the TrainSpec the service builds from it:
    hyperparameters.batch_size is prompts_per_step, qerl's fields the spec's; a local JSONL path as
    training_file is read for its longest prompt, the same plan as the TrainSpec with that file; an
    uploaded file's id cannot be read, so the prompts are taken at data.max_prompt_tokens, said so;
    a fine-tuned model and a field the API refuses are errors naming the field."""
    from engine.model.tiny import make_tiny_model

    try:
        model_dir = make_tiny_model(tmp_path / "tiny", arch="qwen2", hidden=64, layers=2)
    except ValueError as exc:  # no SmolLM2 tokenizer here
        pytest.skip(str(exc))
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "Add " + " and ".join(str(i) for i in range(n)), "answer": "x"}) + "\n"
                            for n in range(2, 40)))
    grader = {"type": "string_check", "name": "exact", "operation": "eq", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}"}
    body = {"model": "smollm2-135m-instruct", "training_file": str(rows),
            "method": {"type": "reinforcement", "reinforcement": {"grader": grader,
                                                                   "hyperparameters": {"batch_size": 4}}},
            "qerl": {"rollout": {"num_generations": 8, "max_new_tokens": 512}, "data": {"eval_size": 4}}}
    spec = {"model": "smollm2-135m-instruct", "prompts_per_step": 4, "grader": grader,
            "rollout": {"num_generations": 8, "max_new_tokens": 512},
            "data": {"train_file": str(rows), "eval_size": 4}}

    from typer.testing import CliRunner

    from qerl.cli import app

    def plan(doc, name):
        (tmp_path / name).write_text(json.dumps(doc))
        return CliRunner().invoke(app, ["plan", str(tmp_path / name), "--model", str(model_dir), "--gpu-gib", "8"],
                                  terminal_width=200)

    as_body, as_spec = plan(body, "body.json"), plan(spec, "spec.json")
    assert as_body.exit_code == 0 and as_spec.exit_code == 0, (as_body.output, as_spec.output)
    assert as_body.output == as_spec.output and "the job's longest prompt" in as_body.output, as_body.output
    assert "32 rollouts of" in " ".join(as_body.output.split()), as_body.output  # 4 prompts x 8 samples

    uploaded = plan(body | {"training_file": "file-abc123"}, "uploaded.json")
    out = " ".join(uploaded.output.split())
    assert uploaded.exit_code == 0 and "file-abc123 is not a file here" in out, out
    assert f"32 rollouts of {TrainSpec().data.max_prompt_tokens} + 512" in out, out  # the field's default

    # the local file is counted as an upload is: a quarter of its 38 prompts held out unless set, and a
    # grader reading a field some rows lack refused as the API refuses it
    from qerl.cli_plan import spec_from_body

    assert spec_from_body(body | {"qerl": {}}).data.eval_size == 9
    (tmp_path / "typo.jsonl").write_text(rows.read_text().replace('"answer"', '"answr"', 1))
    with pytest.raises(ValueError, match="training_file: .* item.answer is in 37 of 38 rows"):
        spec_from_body(body | {"training_file": str(tmp_path / "typo.jsonl")})
    for doc, field in ((body | {"model": "ft:smollm2-135m-instruct:acme:abc123"}, "model"),
                       (body | {"surprise": 1}, "surprise"),
                       (body | {"method": {"type": "supervised"}}, "method.type")):
        res = plan(doc, "bad.json")
        assert res.exit_code == 2 and field in res.output, res.output
