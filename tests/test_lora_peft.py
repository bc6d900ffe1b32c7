"""LoRA: PEFT-format round trip against peft on transformers (bf16 and NVFP4 bases), the
disabled switch, state dicts, init, and what is trainable."""
from __future__ import annotations

import json
import math

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine.lora import (adapter_params, adapter_state_dict, apply_lora, load_adapter_state_dict, load_peft_adapter,
                         lora_disabled, lora_modules, save_peft_adapter)
from engine.model import load_model
from engine.model.tiny import make_tiny_model
from engine.spec import LoraSpec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"llama": make_tiny_model(root / "llama", arch="llama", seed=11),
            "qwen3": make_tiny_model(root / "qwen3", arch="qwen3", seed=12)}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(seed))


def _randomize(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_params(model):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids)).float()


@pytest.mark.parametrize("arch,dtype,rslora", [("llama", torch.float32, False), ("qwen3", torch.float32, True),
                                               ("llama", torch.bfloat16, False)])
def test_peft_round_trip_dense_base(tiny, tmp_path, arch, dtype, rslora):
    d = tiny[arch]
    spec = LoraSpec(r=4, alpha=8, use_rslora=rslora, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    ours, _ = load_model(str(d), quantization="bf16", dtype=dtype, lora=spec)
    _randomize(ours)
    out = save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path="org/base")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["use_rslora"] is rslora
    assert cfg["base_model_name_or_path"] == "org/base" and cfg["peft_type"] == "LORA"
    assert sorted(cfg["target_modules"]) == sorted(spec.target_modules)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d, dtype=dtype), str(out))
    ids = _ids(1)
    with torch.no_grad():
        want = ref(ids).logits.float()
    got = _logits(ours, ids)
    with lora_disabled(ours):
        base = _logits(ours, ids)
    assert (got - base).abs().max() > 0.05  # the adapter matters
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-5)
    else:
        assert (got - want).abs().max() < 0.2 and (got - want).abs().mean() < 0.02


def test_peft_round_trip_nvfp4_base(tiny, tmp_path):
    """Our NVFP4 model == peft applied on transformers' model whose projections hold our
    dequantized weights."""
    d = tiny["qwen3"]
    ours, _ = load_model(str(d), quantization="nvfp4", dtype=torch.float32, lora=LoraSpec(r=8, alpha=16))
    _randomize(ours, 1)
    save_peft_adapter(ours, tmp_path / "a", base_model_name_or_path=str(d))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        for name, m in lora_modules(ours).items():
            hf.get_submodule(name).weight.copy_(m.base.dequantize(torch.float32))
    ref = PeftModel.from_pretrained(hf, str(tmp_path / "a"))
    ids = _ids(2)
    with torch.no_grad():
        want = ref(ids).logits
        with ref.disable_adapter():
            want_base = ref(ids).logits
    torch.testing.assert_close(_logits(ours, ids), want, atol=3e-5, rtol=1e-5)
    with lora_disabled(ours):
        torch.testing.assert_close(_logits(ours, ids), want_base, atol=3e-5, rtol=1e-5)


def test_lora_disabled_and_fresh_adapter_give_the_base_exactly(tiny):
    base, _ = load_model(str(tiny["llama"]), quantization="nvfp4")
    ids = _ids(3)
    ref = _logits(base, ids)
    apply_lora(base, LoraSpec(r=4), seed=0)
    assert torch.equal(_logits(base, ids), ref)  # B = 0: a fresh adapter is the base
    _randomize(base)
    assert not torch.equal(_logits(base, ids), ref)
    with lora_disabled(base):
        assert torch.equal(_logits(base, ids), ref)
        with lora_disabled(base):
            pass
        assert torch.equal(_logits(base, ids), ref)  # nesting keeps it off
    assert not torch.equal(_logits(base, ids), ref)  # back on after the block


def test_init_trainable_params_and_dropout(tiny):
    m, _ = load_model(str(tiny["llama"]), quantization="bf16", lora=LoraSpec(r=8, dropout=0.5, target_modules=["q_proj", "gate_proj"]))
    mods = lora_modules(m)
    assert sorted({n.rsplit(".", 1)[1] for n in mods}) == ["gate_proj", "q_proj"]
    assert len(mods) == 2 * m.config.num_layers
    for mod in mods.values():
        bound = 1 / math.sqrt(mod.in_features)  # kaiming_uniform(a=sqrt(5)), PEFT's default
        assert mod.lora_A.dtype == torch.float32 and mod.lora_A.abs().max() <= bound
        assert mod.lora_A.std() > 0.3 * bound and torch.equal(mod.lora_B, torch.zeros_like(mod.lora_B))
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in adapter_params(m)}
    _randomize(m)
    ids = _ids(4)
    m.eval()
    assert torch.equal(_logits(m, ids), _logits(m, ids))
    m.train()
    assert not torch.equal(_logits(m, ids), _logits(m, ids))  # dropout only in training mode


def test_state_dict_round_trip_and_mismatch_errors(tiny, tmp_path):
    spec = LoraSpec(r=4)
    a, _ = load_model(str(tiny["qwen3"]), quantization="bf16", lora=spec)
    _randomize(a, 5)
    sd = adapter_state_dict(a)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in sd
    b, _ = load_model(str(tiny["qwen3"]), quantization="bf16", lora=spec)
    load_adapter_state_dict(b, sd)
    ids = _ids(6)
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    save_peft_adapter(a, tmp_path / "p", base_model_name_or_path="x")
    c, _ = load_model(str(tiny["qwen3"]), quantization="bf16")
    load_peft_adapter(c, tmp_path / "p")
    assert torch.equal(_logits(a, ids), _logits(c, ids))
    wrong, _ = load_model(str(tiny["qwen3"]), quantization="bf16", lora=LoraSpec(r=2))
    with pytest.raises(ValueError, match="shape"):
        load_adapter_state_dict(wrong, sd)
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(a, spec)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("add", ["addmm", "add"])
@pytest.mark.parametrize("t,k,n", [(37, 64, 96), (5, 200, 24), (300, 512, 1536)])
def test_split_branch_matches_the_fp32_branch(monkeypatch, device, add, t, k, n):
    """The LoRA branch as bf16-piece GEMMs (what a GPU runs; on the CPU with fp32 sums in their
    place) against the plain fp32 branch, forward and backward, on fresh random data with a delta
    as large as the base output: every output within one bf16 step of the fp32 formula's (of
    |y| + |delta|: the "addmm" epilogue may round the delta before adding it), and with "add" all
    but a few equal (those whose sum lies within the pieces' ~2^-16 of a rounding boundary); dL/dx
    within one bf16 step of its largest value (the base's and the branch's parts are rounded, then
    added); dL/dA and dL/dB to ~2^-16 (fp32: 2^-24)."""
    import engine.lora as lora
    from engine.quant.base import BF16Linear

    g = torch.Generator().manual_seed(t + k + n)
    base = BF16Linear((0.05 * torch.randn(n, k, generator=g)).to(torch.bfloat16), None).to(device)
    m = lora.LoRALinear(base, LoraSpec(r=16, alpha=32), generator=g)
    with torch.no_grad():
        m.lora_B.copy_(0.05 * torch.randn(n, 16, generator=g))
    x0 = torch.randn(2, t, k, generator=g).to(torch.bfloat16).to(device)
    gy = torch.randn(2, t, n, generator=g).to(torch.bfloat16).to(device)
    monkeypatch.setattr(lora, "BRANCH_ADD", add)
    res = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(lora, "SPLIT_BRANCH", mode)
        assert lora._split_branch(x0, x0, m.lora_A, m.lora_B) == (mode == "on")
        x = x0.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        y = m(x)
        (y.float() * gy.float()).sum().backward()
        res[mode] = [y.detach().float(), x.grad.float(), m.lora_A.grad.clone(), m.lora_B.grad.clone()]
    ref, got = res["off"], res["on"]
    with torch.no_grad():
        y_base = base(x0).float()
        scale = y_base.abs() + (ref[0] - y_base).abs()  # |y| + |delta|, to within rounding
    diff = (got[0] - ref[0]).abs()
    assert bool((diff <= scale * 2.0**-7 + 1e-30).all()), (diff / scale).max()  # a bf16 step: 2^-8..2^-7
    if add == "add":
        assert (diff > 0).float().mean() < 0.02, (diff > 0).float().mean()
    diff = (got[1] - ref[1]).abs()
    assert diff.max() <= ref[1].abs().max() * 2.0**-7, diff.max()
    for i in (2, 3):
        assert ((got[i] - ref[i]).abs().max() / ref[i].abs().max()) < 4e-5


def test_split_branch_adds_into_the_base_output(monkeypatch):
    """The "addmm" join adds the delta into the base output's own memory (no copy of it is made):
    the values are those of the out-of-place sum of the same pieces, and gradients flow through."""
    import engine.lora as lora
    from engine.quant.base import BF16Linear

    t, k, n, r = 24, 64, 96, 16
    g = torch.Generator().manual_seed(11)
    base = BF16Linear((0.05 * torch.randn(n, k, generator=g)).to(torch.bfloat16), None)
    m = lora.LoRALinear(base, LoraSpec(r=r, alpha=32), generator=g)
    with torch.no_grad():
        m.lora_B.copy_(0.05 * torch.randn(n, r, generator=g))
    x0 = torch.randn(2, t, k, generator=g).to(torch.bfloat16)
    made = []
    real = base.forward
    monkeypatch.setattr(base, "forward", lambda x: made.append(real(x)) or made[-1])
    monkeypatch.setattr(lora, "SPLIT_BRANCH", "on")
    monkeypatch.setattr(lora, "BRANCH_ADD", "addmm")
    x = x0.clone().requires_grad_(True)
    y = m(x)
    assert y.data_ptr() == made[0].data_ptr()
    with torch.no_grad():
        ap, bp = m._pieces()
        us = lora._halves_sum(lora._mm_f32(x0.reshape(-1, k), ap[:2 * r].t()), 1) * m.scaling
        expect = torch.addmm(real(x0).reshape(-1, n), lora._pairs(us, 1), bp.t())
    assert torch.equal(y.detach().reshape(-1, n), expect)
    y.float().sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all()) and m.lora_B.grad.abs().sum() > 0
    # a base output laid out otherwise (not contiguous) gets the sum in new memory, the same values
    monkeypatch.setattr(base, "forward", lambda x: real(x).transpose(0, 1).contiguous().transpose(0, 1))
    y = m(x0.clone().requires_grad_(True))
    assert torch.equal(y.detach().reshape(-1, n), expect)


def _checkpointed_lora_model(seed: int):
    """A 2-layer NVFP4 model in 7B's proportions with a random rank-4 adapter, checkpointed layers."""
    from engine.model.shapes import build_random_model, shape_config

    cfg = shape_config("7b", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                       intermediate_size=128, vocab_size=256)
    model = build_random_model(cfg, quantization="nvfp4", device="cpu", seed=seed)
    apply_lora(model, LoraSpec(r=4), seed=seed)
    _randomize(model, seed=seed)
    model.gradient_checkpointing = True
    return model


def test_split_branch_through_a_checkpointed_model(monkeypatch):
    """A bf16 model's learner pass (checkpointed layers recomputed in backward, ragged rows) with
    the branch as bf16 pieces against the fp32 branch: the same log-probs to bf16 rounding through
    two layers, the same LoRA gradients to about a part in a thousand."""
    import engine.lora as lora

    model = _checkpointed_lora_model(3)
    ids = torch.randint(1, 256, (3, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    res = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(lora, "SPLIT_BRANCH", mode)
        logp, _ = model.token_logprobs(ids, mask, chunk_size=5, from_position=2)
        (logp * mask[:, 1:]).sum().backward()
        res[mode] = logp.detach(), torch.cat([p.grad.flatten() for p in adapter_params(model)])
        model.zero_grad(set_to_none=True)
    (ref_lp, ref_g), (lp, g) = res["off"], res["on"]
    real = mask[:, 1:].bool()
    real[:, :2] = False
    assert (lp - ref_lp)[real].abs().max() < 0.02
    assert torch.nn.functional.cosine_similarity(g, ref_g, dim=0) > 0.9999
    assert (g.norm() / ref_g.norm() - 1).abs() < 3e-3


def test_held_pieces_are_made_once_and_give_the_same_pass(monkeypatch):
    """held_pieces (a step's micro-batches): the same log-probs and LoRA gradients, bit for bit, as
    making the pieces in every forward pass, with each adapter's pieces made once over two
    checkpointed micro-batches (three forward passes each way: the pass and its recompute); none
    kept after the block; an adapter weight changed in place inside the block gets new pieces."""
    import engine.lora as lora

    model = _checkpointed_lora_model(4)
    monkeypatch.setattr(lora, "SPLIT_BRANCH", "on")
    made = []
    real_pieces = lora._pieces
    monkeypatch.setattr(lora, "_pieces", lambda t, dim: made.append(t.shape) or real_pieces(t, dim))
    ids = torch.randint(1, 256, (2, 3, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 0, 7:] = 0
    mods = list(lora_modules(model).values())

    def passes(bump: bool = False):
        out = []
        for i in range(2):
            if bump and i == 1:
                with torch.no_grad():
                    mods[0].lora_B.mul_(0.5)  # a new version of one weight
            logp, _ = model.token_logprobs(ids[i], mask[i], chunk_size=4, from_position=2)
            (logp * mask[i, :, 1:]).sum().backward()
            out.append(logp.detach())
        grads = torch.cat([p.grad.flatten() for p in adapter_params(model)])
        model.zero_grad(set_to_none=True)
        return torch.cat(out), grads

    ref = passes()
    per_pass = len(made)
    assert per_pass == 2 * len(mods) * 2 * 2  # A and B, 2 micro-batches x (pass + recompute)
    made.clear()
    with lora.held_pieces(model):
        got = passes()
        assert all(m._held is not None for m in mods)
    assert len(made) == 2 * len(mods)  # once each
    assert all(m._held is None and not m._hold for m in mods)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])

    b0 = mods[0].lora_B.detach().clone()
    ref = passes(bump=True)
    with torch.no_grad():
        mods[0].lora_B.copy_(b0)
    made.clear()
    with lora.held_pieces(model):
        got = passes(bump=True)
    assert len(made) == 2 * len(mods) + 2  # the changed adapter's A and B made again
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_the_fp32_product_check_lets_out_of_memory_through(monkeypatch):
    """The device check behind the split branch is cached per process: a CUDA out-of-memory error
    (a job at its max_gpu_memory_gib) propagates instead of caching "no fp32 product" for every
    later job; a device without the product still answers False."""
    from engine import lora

    def out_of_memory(*_):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    def unsupported(*_):
        raise RuntimeError("no kernel for this dtype")

    lora._mm_f32_works.cache_clear()
    try:
        monkeypatch.setattr(lora, "_mm_f32", out_of_memory)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            lora._mm_f32_works("cpu")
        monkeypatch.setattr(lora, "_mm_f32", unsupported)
        assert lora._mm_f32_works("cpu") is False
    finally:
        lora._mm_f32_works.cache_clear()
