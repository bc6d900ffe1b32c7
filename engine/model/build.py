"""Build a CausalLM from checkpoint tensors, one layer at a time.

A dense checkpoint is read tensor by tensor with safetensors (no transformers model is
instantiated), and every decoder projection is quantized as soon as it is read, so peak
memory is the quantized model plus one layer in full precision. q/k/v share one NVFP4
global scale and so do gate/up (vLLM fuses them; compressed-tensors checkpoints do the same).
A compressed-tensors checkpoint hands over ready FrozenLinears instead.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.decoder import CausalLM, Decoder
from engine.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from engine.quant import BF16Linear, FrozenLinear, quantize_linear
from engine.quant.nvfp4 import global_scale_for

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLPS = ("gate_proj", "up_proj", "down_proj")
SHARED_SCALE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))


class TensorSource(Protocol):
    def tensor(self, name: str) -> torch.Tensor | None: ...

    def linear(self, module: str) -> FrozenLinear | None: ...


class SafetensorsSource:
    """Lazy reader over model.safetensors or a sharded index."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (model_dir / "model.safetensors").is_file():
            with safe_open(model_dir / "model.safetensors", "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(f"{model_dir} has no model.safetensors; give a Hugging Face directory with safetensors weights")
        self._map = weight_map
        self._files = {name: safe_open(model_dir / name, "pt") for name in set(weight_map.values())}

    def tensor(self, name: str) -> torch.Tensor | None:
        file = self._map.get(name)
        return None if file is None else self._files[file].get_tensor(name)

    def linear(self, module: str) -> FrozenLinear | None:
        return None


class DictSource:
    """Tensors and FrozenLinears already in memory (a compressed-tensors checkpoint)."""

    def __init__(self, items: dict[str, object]) -> None:
        self._items = items

    def tensor(self, name: str) -> torch.Tensor | None:
        value = self._items.get(name)
        return value if isinstance(value, torch.Tensor) else None

    def linear(self, module: str) -> FrozenLinear | None:
        for key in (module, module + ".weight"):
            value = self._items.get(key)
            if isinstance(value, FrozenLinear):
                return value
        return None


def make_frozen(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, *, dtype: torch.dtype,
                global_scale: torch.Tensor | None = None, source_dtype: torch.dtype | None = None) -> FrozenLinear:
    """A frozen projection in ``fmt`` via engine.quant.quantize_linear. The weight is cast to
    ``source_dtype`` (default: the model dtype) and quantized from there (bf16: the codes equal
    compressed-tensors' export); an unquantized base in another model dtype than bf16 holds that
    dtype (fp32 reference runs, or bf16 values held in fp32 where source_dtype is bf16)."""
    weight = weight.to(source_dtype or dtype)
    bias = None if bias is None else bias.to(source_dtype or dtype).to(dtype)
    if fmt == "bf16" and dtype != torch.bfloat16:
        return BF16Linear(weight.to(dtype), bias, dtype=dtype)
    return quantize_linear(weight, bias, fmt, global_scale=global_scale)


def build_model(cfg: ModelConfig, src: TensorSource, *, quantization: str, device: torch.device | str,
                dtype: torch.dtype, name_or_path: str = "", hub_id: str | None = None,
                source_dtype: torch.dtype | None = None) -> CausalLM:
    """``dtype``: what the model computes in. ``source_dtype`` (default ``dtype``): every tensor
    is rounded to it first and projections are quantized from it, so a bf16 source held in fp32
    has the bf16 model's values and NVFP4 codes."""
    src_dtype = source_dtype or dtype

    def get(name: str) -> torch.Tensor:
        t = src.tensor(name)
        if t is None:
            raise ValueError(f"checkpoint {name_or_path or ''} lacks tensor {name!r} expected for a {cfg.arch} model")
        return t.to(device=device, dtype=src_dtype).to(dtype)

    def norm(name: str) -> RMSNorm:
        return RMSNorm(get(name), cfg.rms_norm_eps)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        lin = _layer_linears(cfg, src, p, quantization, device, dtype, src_dtype)
        qn = kn = None
        if cfg.qk_norm:
            qn, kn = norm(p + "self_attn.q_norm.weight"), norm(p + "self_attn.k_norm.weight")
        attn = Attention(cfg, *(lin[n] for n in ATTN), q_norm=qn, k_norm=kn)
        mlp = MLP(*(lin[n] for n in MLPS))
        layers.append(DecoderLayer(norm(p + "input_layernorm.weight"), attn, norm(p + "post_attention_layernorm.weight"), mlp))
    decoder = Decoder(get("model.embed_tokens.weight"), layers, norm("model.norm.weight"))
    head = None if cfg.tie_word_embeddings else get("lm_head.weight")
    return CausalLM(cfg, decoder, head, name_or_path=name_or_path, hub_id=hub_id)


def _layer_linears(cfg: ModelConfig, src: TensorSource, prefix: str, fmt: str, device, dtype,
                   src_dtype) -> dict[str, FrozenLinear]:
    out: dict[str, FrozenLinear] = {}
    for group in SHARED_SCALE_GROUPS:
        names = {n: prefix + ("self_attn." if n in ATTN else "mlp.") + n for n in group}
        ready = {n: src.linear(m) for n, m in names.items()}
        if all(v is not None for v in ready.values()):
            out.update({n: _convert(v, fmt, device, dtype, src_dtype) for n, v in ready.items()})
            continue
        dense = {}
        for n, m in names.items():
            w = src.tensor(m + ".weight")
            if w is None:
                raise ValueError(f"checkpoint lacks {m}.weight expected for a {cfg.arch} model")
            has_bias = cfg.mlp_bias if n in MLPS else (cfg.o_bias if n == "o_proj" else cfg.attention_bias)
            b = src.tensor(m + ".bias") if has_bias else None
            dense[n] = (w.to(device), None if b is None else b.to(device))
        gs = global_scale_for([w.to(src_dtype) for w, _ in dense.values()]) if fmt == "nvfp4" else None
        for n, (w, b) in dense.items():
            out[n] = make_frozen(w, b, fmt, dtype=dtype, global_scale=gs, source_dtype=src_dtype)
    return out


def _convert(layer: FrozenLinear, fmt: str, device, dtype, src_dtype) -> FrozenLinear:
    """A pre-quantized projection kept as is, or re-expressed in another format."""
    layer = layer.to(device)
    if layer.fmt == fmt:
        return layer
    w = layer.dequantize(torch.float32)
    return make_frozen(w, layer.bias, fmt, dtype=dtype, source_dtype=src_dtype)
