"""compressed-tensors checkpoints: ours load in transformers; compressed-tensors' load in qerl."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine.quant import NVFP4Linear, global_scale_for, quantize_linear
from engine.quant.ct_io import (
    export_compressed_tensors,
    load_compressed_tensors,
    quantize_cli,
    shared_scale_groups,
)

LINEARS = re.compile(r"\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")


def tiny_llama(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)
    kw.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**kw))
    with torch.no_grad():  # non-trivial norms, and one outlier so global scales differ by layer
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        model.model.layers[1].mlp.up_proj.weight[3, 7] = 0.9
    return model.to(torch.bfloat16)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    tiny_llama(seed=0).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    return path


@pytest.fixture(scope="module")
def ct_dir(hf_dir, tmp_path_factory) -> Path:
    """The same model quantized and saved by compressed-tensors itself, calibrated the way
    llm-compressor does (fused q/k/v and gate/up absmax -> generate_gparam; calculate_qparams)."""
    path = tmp_path_factory.mktemp("ct")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    qconfig = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED
    )
    apply_quantization_config(model, qconfig)
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if hasattr(m, "quantization_scheme")]
    assert len(names) == 14 and all(LINEARS.search(n) for n in names)
    for group in shared_scale_groups(names):
        amax = torch.stack([modules[n].weight.abs().amax() for n in group]).amax().reshape(1)
        gs = generate_gparam(-amax, amax)
        for n in group:
            m = modules[n]
            blocks = m.weight.unflatten(-1, (-1, 16))
            scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
            m.weight_scale.data.copy_(scale)
            m.weight_global_scale.data.copy_(gs)
            m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, "nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


@pytest.fixture(scope="module")
def exported(hf_dir, tmp_path_factory) -> Path:
    return export_compressed_tensors(hf_dir, tmp_path_factory.mktemp("out") / "nvfp4")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update((k, h.get_tensor(k)) for k in h.keys())
    return out


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_export_equals_compressed_tensors_checkpoint(exported, ct_dir):
    ours, theirs = read_tensors(exported), read_tensors(ct_dir)
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(as_bits(ours[name]), as_bits(t)), name
    q = "model.layers.0.self_attn"
    assert torch.equal(ours[f"{q}.q_proj.weight_global_scale"], ours[f"{q}.v_proj.weight_global_scale"])
    ours_qc = json.loads((exported / "config.json").read_text())["quantization_config"]
    theirs_qc = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    ours_qc.pop("version"), theirs_qc.pop("version")
    assert ours_qc == theirs_qc
    assert (exported / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'


def test_export_loads_in_transformers_with_dequantized_logits(hf_dir, exported):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        original = reference(ids).logits
        modules = dict(reference.named_modules())
        names = [n for n in modules if LINEARS.search(n)]
        for group in shared_scale_groups(names):
            gs = global_scale_for([modules[n].weight for n in group])
            for n in group:
                layer = quantize_linear(modules[n].weight, None, "nvfp4", global_scale=gs)
                modules[n].weight.copy_(layer.dequantize(torch.bfloat16))
        expected = reference(ids).logits
        got = loaded(ids).logits
    assert loaded.dtype == torch.bfloat16
    assert not torch.allclose(original, expected, atol=1e-3)  # quantization did change the model
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_compressed_tensors_checkpoint_loads_in_qerl(ct_dir):
    config, tensors = load_compressed_tensors(ct_dir)
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    stored = read_tensors(ct_dir)
    layers = {n: t for n, t in tensors.items() if isinstance(t, NVFP4Linear)}
    assert len(layers) == 14 and all(LINEARS.search(n) for n in layers)
    for name, layer in layers.items():
        for buf in ("weight_packed", "weight_scale", "weight_global_scale"):
            assert torch.equal(as_bits(getattr(layer, buf)), as_bits(stored[f"{name}.{buf}"])), (name, buf)
        assert (layer.out_features, layer.in_features) == (stored[f"{name}.weight_packed"].shape[0],
                                                           stored[f"{name}.weight_packed"].shape[1] * 2)
    others = {n: t for n, t in tensors.items() if not isinstance(t, NVFP4Linear)}
    assert sorted(others) == sorted(n for n in stored if n.rsplit(".", 1)[0] not in layers)
    assert all(torch.equal(others[n], stored[n]) for n in others)


def test_biases_sharding_and_cli(tmp_path):
    """Qwen2-style q/k/v biases ride along in the NVFP4Linear; shards and an index are written."""
    src = tmp_path / "hf"
    model = tiny_llama(seed=2, attention_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_()
    model.save_pretrained(src)
    out = export_compressed_tensors(src, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_tensors(out))
    _, tensors = load_compressed_tensors(out)
    q = tensors["model.layers.0.self_attn.q_proj"]
    assert torch.equal(q.bias, model.model.layers[0].self_attn.q_proj.bias)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(q(x), x @ q.dequantize().t() + q.bias, rtol=0, atol=0)
    single = quantize_cli(str(src), str(tmp_path / "cli"))
    assert torch.equal(read_tensors(single)["model.layers.1.mlp.down_proj.weight_packed"],
                       tensors["model.layers.1.mlp.down_proj"].weight_packed)
    with pytest.raises(ValueError, match="not empty"):
        quantize_cli(str(src), str(tmp_path / "cli"))


def test_export_refuses_what_it_cannot_write(tmp_path, exported):
    src = tmp_path / "hf40"
    model = tiny_llama(seed=3, hidden_size=40, intermediate_size=80, num_attention_heads=2, num_key_value_heads=1)
    model.save_pretrained(src)
    with pytest.raises(ValueError, match="divisible by 16"):
        export_compressed_tensors(src, tmp_path / "out40")
    assert not (tmp_path / "out40").exists()
    with pytest.raises(ValueError, match="already quantized"):
        export_compressed_tensors(exported, tmp_path / "again")
    with pytest.raises(ValueError, match="not a compressed-tensors"):
        load_compressed_tensors(src)
