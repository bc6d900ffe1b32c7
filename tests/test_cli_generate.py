"""`qerl generate`: a fine-tuned adapter answering prompts on its base, checked against peft on
transformers (the same adapter on the same base, float64 logits along our tokens), and on an
adapter a real training run wrote (its manifest names the base and the NVFP4 format). On a GPU
(skipped without one) generate samples on the CUDA-graph engine and must give the CPU's greedy
answers, parting from them only where the reference's top two logits are within bf16 rounding."""
from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from engine.lora import adapter_params, load_peft_adapter, lora_disabled, peft_lora_spec, save_peft_adapter
from engine.model import load_model
from engine.model.tiny import make_tiny_model
from engine.spec import LoraSpec
from engine.train_batch import apply_chat_template
from qerl.cli import app
from tests._worker_fixtures import tiny_spec

PROMPTS = ["What is 12 times 7?", "Name a prime number larger than 20."]


def _run(*args: str, device: str = "cpu") -> list[dict]:
    result = CliRunner().invoke(app, ["generate", *args, "--json", "--device", device])
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
    return _write_random_adapter(tmp_path_factory.mktemp("generate"))


def _write_random_adapter(root, *, quantization: str = "bf16", hidden: int = 64, std: float = 0.2,
                          targets: tuple[str, ...] = ("q_proj", "v_proj", "up_proj", "down_proj")):
    """(base dir, adapter dir): a tiny llama base (seed 21) and a r=8 LoRA drawn with ``std``
    (seed 22), its manifest naming the base and ``quantization``."""
    base = make_tiny_model(root / "base", arch="llama", hidden=hidden, seed=21)
    model, _ = load_model(str(base), quantization=quantization, dtype=torch.float32,
                          lora=LoraSpec(r=8, alpha=16, target_modules=list(targets)))
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for p in adapter_params(model):
            p.copy_(std * torch.randn(p.shape, generator=g))
    out = save_peft_adapter(model, root / "adapter", base_model_name_or_path=str(base))
    (out / "qerl_manifest.json").write_text(json.dumps({"base_model": {"name": str(base)},
                                                        "quantization": quantization}))
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
    from engine.data import load_examples
    from engine.spec import TrainSpec

    spec = TrainSpec.from_dict(tiny_spec("tiny", steps=2))
    result = train(spec, workdir=tmp_path / "run", reporter=NullReporter(), should_stop=lambda: False,
                   resume_from=None)
    adapter = str(result.adapter_dir)
    args = (adapter, "--prompt", PROMPTS[0], "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "5")
    first = _run(*args)
    assert [(r["model"], r["quantization"]) for r in first] == [("tiny", "nvfp4")]
    assert _run(*args) == first
    # a plain prompt is asked as training asked its questions: after the turns its manifest records,
    # which are those every training prompt came after (the format instruction and a worked example)
    framing = json.loads((result.adapter_dir / "qerl_manifest.json").read_text())["prompt_framing"]
    trained_on, _ = load_examples(spec.data, spec.seed)
    assert [m["role"] for m in framing] == ["system", "user", "assistant"]
    assert all(ex.messages[:-1] == framing for ex in trained_on)
    user = {"role": "user", "content": PROMPTS[0]}
    assert first[0]["messages"] == [*framing, user]
    assert _run(*args, "--no-framing")[0]["messages"] == [user]
    shown = CliRunner().invoke(app, ["generate", *args, "--device", "cpu", "--no-compare"])  # into a pipe
    rule = next((line for line in shown.stdout.splitlines() if "prompt 1" in line), "")
    assert shown.exit_code == 0 and len(rule) == 80 and rule.strip("─ ") == "prompt 1", shown.stdout
    assert _run(*args, "--system", "Be brief.")[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                                                  *framing[1:], user]


def test_generate_refuses_bad_input_naming_the_fix(random_adapter, tmp_path):
    base, adapter = random_adapter
    runner = CliRunner()
    not_an_adapter = runner.invoke(app, ["generate", str(tmp_path), "--prompt", "hi"])
    assert not_an_adapter.exit_code == 2 and "adapter_config.json" in not_an_adapter.output
    no_prompt = runner.invoke(app, ["generate", str(adapter)])
    assert no_prompt.exit_code == 2 and "--prompt" in no_prompt.output
    a_dir = runner.invoke(app, ["generate", str(adapter), "--prompt", "hi", "--checkpoint", "2"])
    assert a_dir.exit_code == 2 and "--checkpoint picks a checkpoint of a job on" in a_dir.output
    bad_format = runner.invoke(app, ["generate", str(adapter), "--prompt", "hi", "--quantization", "int8"])
    assert bad_format.exit_code == 2 and "nvfp4, nf4, bf16" in bad_format.output
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    bad_line = runner.invoke(app, ["generate", str(adapter), "--prompts-file", str(lines)])
    assert bad_line.exit_code == 2 and "line 2" in bad_line.output


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPU_PROMPTS = [*PROMPTS, "Write a haiku about rain."]
# Two greedy runs in bf16 may part where the reference's top two logits are closer than bf16's
# rounding through the model moves them: on this model (hidden 128, 2 layers, logits up to ~5)
# bf16 against the fp32 reference moved a logit by up to 3% of the position's largest |logit|.
BF16_TOL = 0.05


def _first_parting(want: list[int], got: list[int]) -> int | None:
    """The first position where two completions differ (None if they are the same)."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def _gaps(ref, prompt_ids: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, tolerance) of ``ref`` (the engine's CPU model in fp32) at each of ``tokens``."""
    with torch.no_grad():
        logits = ref.logits(ref(torch.tensor([prompt_ids + tokens])))[0, len(prompt_ids) - 1: -1].double()
    return logits, BF16_TOL * logits.abs().max(-1).values


def _agree(ref, prompt_ids: list[int], cpu: list[int], gpu: list[int]) -> int | None:
    """The GPU's greedy tokens are the CPU's; where they part, the reference's top two logits there
    are within bf16 tolerance of each other, and from there on each GPU token is within it of the
    reference's greedy choice along the GPU's own path. Returns where they part (None: nowhere)."""
    k = _first_parting(cpu, gpu)
    if k is None:
        return None
    assert k < len(cpu) and k < len(gpu), (k, cpu, gpu)  # one ended (eos) where the other did not
    logits, tol = _gaps(ref, prompt_ids, gpu)
    for i in range(k, len(gpu)):
        gap = float(logits[i].max() - logits[i, gpu[i]])
        assert gap <= tol[i], f"GPU token {i} ({gpu[i]}) is {gap:.4f} below the reference's best ({float(tol[i]):.4f})"
    top2 = logits[k].topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin <= tol[k], f"parted at {k} where the reference's top-2 margin is {margin:.4f} > {float(tol[k]):.4f}"
    cpu_gap = float(logits[k].max() - logits[k, cpu[k]])  # the same prefix up to k
    assert cpu_gap <= tol[k], f"CPU token {k} ({cpu[k]}) is {cpu_gap:.4f} below the reference's best"
    return k


def check_generate_agrees_with_the_cpu(root, quantization: str, device: str) -> dict:
    """generate on ``device`` and on the CPU for the same adapter and prompts (greedy, the base
    alone too); returns what was compared (for the caller's checks)."""
    from engine.rollout import cuda_graph

    base, adapter = _write_random_adapter(root, quantization=quantization, hidden=128, std=0.1,
                                          targets=ALL_PROJECTIONS)
    args = (str(adapter), *[a for p in GPU_PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "24")
    calls = []
    real = cuda_graph.generate
    cuda_graph.generate = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        on_device = _run(*args, device=device)
        graph_calls = len(calls)
        on_cpu = _run(*args, device="cpu")
    finally:
        cuda_graph.generate = real
    assert graph_calls == 2  # the adapter's answers and the base's, on the CUDA-graph engine
    assert [(r["model"], r["quantization"]) for r in on_device] == [(str(base), quantization)] * len(GPU_PROMPTS)

    ref, tok = load_model(str(base), quantization=quantization, lora=peft_lora_spec(adapter), device="cpu",
                          dtype=torch.float32, source_dtype=torch.bfloat16)
    load_peft_adapter(ref, adapter)
    ref.eval()
    parted = {"tuned": [], "alone": []}
    for d, c in zip(on_device, on_cpu):
        assert d["messages"] == c["messages"]
        prompt_ids = apply_chat_template(tok, c["messages"])
        assert d["completion"] == tok.decode(d["token_ids"], skip_special_tokens=True)
        parted["tuned"].append(_agree(ref, prompt_ids, c["token_ids"], d["token_ids"]))
        with lora_disabled(ref):
            parted["alone"].append(_agree(ref, prompt_ids, c["base_token_ids"], d["base_token_ids"]))
        # the adapter changes every answer beyond bf16's reach, so an adapter that did not reach the
        # device's engine (the base's tokens) would fail the check above
        k = _first_parting(c["token_ids"], c["base_token_ids"])
        assert k is not None and k < len(c["token_ids"]), "the adapter does not change this answer"
        logits, tol = _gaps(ref, prompt_ids, c["base_token_ids"][:k + 1])
        gap = float(logits[k].max() - logits[k, c["base_token_ids"][k]])
        assert gap > tol[k], f"the base's token at {k} is within bf16 tolerance of the adapter's ({gap:.4f})"
    return {"parted": parted, "device": on_device, "cpu": on_cpu}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_generate_on_the_gpu_matches_the_cpu(quantization, tmp_path, monkeypatch):
    """`qerl generate --device cuda` (the CUDA-graph sampler; NVFP4 kernels for nvfp4) against
    `--device cpu`: the same greedy tokens, with and without the adapter, except where the fp32
    reference's top two logits lie within bf16 tolerance."""
    monkeypatch.delenv("QERL_ROLLOUT_ENGINE", raising=False)
    seen = check_generate_agrees_with_the_cpu(tmp_path, quantization, "cuda")
    print(quantization, "parted at", seen["parted"])
