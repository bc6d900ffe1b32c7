"""`qerl generate`: a fine-tuned adapter answering prompts on its base, checked against peft on
transformers (the same adapter on the same base, float64 logits along our tokens), and on an
adapter a real training run wrote (its manifest names the base and the NVFP4 format)."""
from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from engine.lora import adapter_params, save_peft_adapter
from engine.model import load_model
from engine.model.tiny import make_tiny_model
from engine.spec import LoraSpec
from qerl.cli import app
from tests._worker_fixtures import tiny_spec

PROMPTS = ["What is 12 times 7?", "Name a prime number larger than 20."]


def _run(*args: str) -> list[dict]:
    result = CliRunner().invoke(app, ["generate", *args, "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _greedy_along(model, prompt_ids: list[int], tokens: list[int]) -> None:
    """Each of ``tokens`` is the reference's greedy choice (or within a rounding tie of it)."""
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1: -1].double()
    for i, t in enumerate(tokens):
        best = int(logits[i].argmax())
        gap = float(logits[i, best] - logits[i, t])
        assert t == best or gap < 1e-2 * float(logits[i].abs().max()), (i, t, best, gap)


@pytest.fixture(scope="module")
def random_adapter(tmp_path_factory):
    """A tiny llama base and a LoRA with random non-zero weights, written as `qerl adapters
    download` extracts one (PEFT files and a manifest naming the base, trained on bf16)."""
    root = tmp_path_factory.mktemp("generate")
    base = make_tiny_model(root / "base", arch="llama", seed=21)
    model, _ = load_model(str(base), quantization="bf16", dtype=torch.float32,
                          lora=LoraSpec(r=8, alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for p in adapter_params(model):
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    out = save_peft_adapter(model, root / "adapter", base_model_name_or_path=str(base))
    (out / "qerl_manifest.json").write_text(json.dumps({"base_model": {"name": str(base)}, "quantization": "bf16"}))
    return base, out


def test_generate_matches_peft_on_transformers(random_adapter):
    base, adapter = random_adapter
    rows = _run(str(adapter), *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "12")
    assert [r["messages"][-1]["content"] for r in rows] == PROMPTS
    assert {(r["model"], r["quantization"]) for r in rows} == {(str(base), "bf16")}
    tok = AutoTokenizer.from_pretrained(base)
    ref_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64), str(adapter))
    differ = 0
    for r in rows:
        text = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        tuned, alone = r["token_ids"], r["base_token_ids"]
        assert r["tokens"] == len(tuned) == 12 and r["finish_reason"] == "length"
        assert r["completion"] == tok.decode(tuned, skip_special_tokens=True)
        _greedy_along(ref, prompt_ids, tuned)  # the adapter on its base
        _greedy_along(ref_base, prompt_ids, alone)  # the base alone
        differ += tuned != alone
    assert differ  # the adapter changes the answers


def test_generate_reads_a_trained_adapters_manifest(tiny_model_dir, tmp_path):
    """An adapter from a real (short) training run on an NVFP4 base: generate finds the base and
    the format in its manifest, and the same seed gives the same sampled answers."""
    from engine import NullReporter, train
    from engine.spec import TrainSpec

    spec = TrainSpec.from_dict(tiny_spec("tiny", steps=2))
    result = train(spec, workdir=tmp_path / "run", reporter=NullReporter(), should_stop=lambda: False,
                   resume_from=None)
    adapter = str(result.adapter_dir)
    args = (adapter, "--prompt", PROMPTS[0], "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "5")
    first = _run(*args)
    assert [(r["model"], r["quantization"]) for r in first] == [("tiny", "nvfp4")]
    assert _run(*args) == first


def test_generate_refuses_bad_input_naming_the_fix(random_adapter, tmp_path):
    base, adapter = random_adapter
    runner = CliRunner()
    not_an_adapter = runner.invoke(app, ["generate", str(tmp_path), "--prompt", "hi"])
    assert not_an_adapter.exit_code == 2 and "adapter_config.json" in not_an_adapter.output
    no_prompt = runner.invoke(app, ["generate", str(adapter)])
    assert no_prompt.exit_code == 2 and "--prompt" in no_prompt.output
    bad_format = runner.invoke(app, ["generate", str(adapter), "--prompt", "hi", "--quantization", "int8"])
    assert bad_format.exit_code == 2 and "nvfp4, nf4, bf16" in bad_format.output
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    bad_line = runner.invoke(app, ["generate", str(adapter), "--prompts-file", str(lines)])
    assert bad_line.exit_code == 2 and "line 2" in bad_line.output
