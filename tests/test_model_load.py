"""Loading: NVFP4 wiring (shared global scales), compressed-tensors checkpoints, registry
names, atomic caching, and errors a user can act on."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from compressed_tensors.quantization.utils.helpers import generate_gparam
from safetensors import safe_open

from engine.model import load_model, resolve_model_dir
from engine.model.gguf import atomic_dir
from engine.model.tiny import make_tiny_model
from engine.quant import NVFP4Linear


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", seed=4)


def _weights(d) -> dict[str, torch.Tensor]:
    with safe_open(d / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_nvfp4_projections_share_group_global_scales(qwen2_dir):
    m, _ = load_model(str(qwen2_dir), quantization="nvfp4")
    w = _weights(qwen2_dir)
    for i, layer in enumerate(m.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for group, mods in (((attn.q_proj, attn.k_proj, attn.v_proj), ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                            ((mlp.gate_proj, mlp.up_proj), ("mlp.gate_proj", "mlp.up_proj")),
                            ((attn.o_proj,), ("self_attn.o_proj",)), ((mlp.down_proj,), ("mlp.down_proj",))):
            # compressed-tensors' own global scale per member (from bf16 weights); the group shares the min
            expected = min(generate_gparam(t.min(), t.max()).item()
                           for t in (w[p + n + ".weight"].bfloat16() for n in mods))
            for lin in group:
                assert isinstance(lin, NVFP4Linear)
                assert lin.weight_global_scale.item() == expected
        # the bias survives quantization (Qwen2 has q/k/v biases)
        torch.testing.assert_close(attn.q_proj.bias.float(), w[p + "self_attn.q_proj.bias"].bfloat16().float())
    assert m.lm_head.weight.dtype == torch.bfloat16 and m.model.norm.weight.dtype == torch.bfloat16


def test_compressed_tensors_checkpoint_loads_identically(qwen2_dir, tmp_path):
    from engine.quant.ct_io import export_compressed_tensors

    ct = export_compressed_tensors(qwen2_dir, tmp_path / "ct")
    direct, _ = load_model(str(qwen2_dir), quantization="nvfp4")
    loaded, tok = load_model(str(ct), quantization="nvfp4")
    a, b = direct.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]), k
    assert tok.eos_token_id == 2
    # asked for bf16, an NVFP4 checkpoint comes back dequantized
    dense, _ = load_model(str(ct), quantization="bf16")
    q = direct.model.layers[1].mlp.down_proj
    assert torch.equal(dense.model.layers[1].mlp.down_proj.weight, q.dequantize(torch.bfloat16))


def test_registry_name_from_qerl_models(qwen2_dir, monkeypatch):
    monkeypatch.setenv("QERL_MODELS", json.dumps({"my-tiny": str(qwen2_dir)}))
    assert resolve_model_dir("my-tiny") == qwen2_dir
    m, tok = load_model("my-tiny", quantization="bf16")
    assert m.config.arch == "qwen2" and m.config.attention_bias
    assert m.eos_token_ids == [2] and tok.pad_token_id is not None
    assert m.name_or_path == "my-tiny" and m.hub_id is None


def test_errors_name_the_fix(qwen2_dir, tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(qwen2_dir), quantization="int3")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(empty))
    other = tmp_path / "gpt2"
    shutil.copytree(qwen2_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model(str(other))


def test_atomic_dir_keeps_the_first_complete_copy(tmp_path):
    final = tmp_path / "models" / "m"

    def racing_write(tmp):  # another process finishes first while we are writing
        (tmp / "mine").write_text("loser")
        atomic_dir(final, lambda t: (t / "theirs").write_text("winner"))

    assert atomic_dir(final, racing_write) == final
    assert [p.name for p in final.iterdir()] == ["theirs"]
    assert [p.name for p in final.parent.iterdir()] == ["m"]  # no temporary left behind
    assert atomic_dir(final, lambda t: pytest.fail("must not rewrite an existing copy")) == final


@pytest.mark.parametrize("quantization", ["nvfp4", "nf4", "bf16"])
def test_bf16_values_held_in_fp32(qwen2_dir, quantization):
    """source_dtype=bf16 under dtype=fp32 (CPU jobs without a bf16 fast path): every tensor holds
    the bf16 model's value, the 4-bit codes and scales are the same bits, and the two models' logits
    differ only by bf16 vs fp32 arithmetic."""
    a, _ = load_model(str(qwen2_dir), quantization=quantization)
    b, _ = load_model(str(qwen2_dir), quantization=quantization, dtype=torch.float32, source_dtype=torch.bfloat16)
    assert b.dtype == torch.float32 and b.lm_head.weight.dtype == torch.float32
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k, va in sa.items():
        vb = sb[k]
        if va.dtype == torch.bfloat16:
            assert vb.dtype == torch.float32 and torch.equal(va.float(), vb), k
        else:
            assert vb.dtype == va.dtype and torch.equal(va.view(torch.uint8), vb.view(torch.uint8)), k
    ids = torch.randint(0, a.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    la, lb = a.logits(a(ids)).float(), b.logits(b(ids)).float()
    assert (la - lb).abs().max() < 0.05 * la.abs().max()  # bf16 vs fp32 arithmetic only


def test_compute_dtype_is_fp32_where_cpu_bf16_is_slow(monkeypatch):
    from engine.model import compute_dtype

    assert compute_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert compute_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert compute_dtype(torch.device("cpu")) == torch.float32
