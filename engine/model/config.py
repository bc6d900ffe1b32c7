"""ModelConfig: the few fields of a Hugging Face config.json the decoder needs.

Reads both the transformers 4.x layout (``rope_theta`` + ``rope_scaling``) and the 5.x one
(``rope_parameters``). Architectures: Llama (SmolLM2 is one), Qwen2 (q/k/v bias), Qwen3
(per-head q/k RMSNorm). Anything the decoder would silently get wrong raises ValueError.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    arch: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {} = plain RoPE
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2: always) and o (Llama's flag)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 4096
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the config.json as read

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "")
        if model_type not in ARCHS:
            raise ValueError(f"model_type {model_type!r} is not supported; qerl loads {', '.join(sorted(ARCHS))} models")
        arch = ARCHS[model_type]
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported; set use_sliding_window to false in config.json")
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        theta, scaling = _rope(d)
        attn_bias = bool(d.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attn_bias or arch == "qwen2",
            o_bias=attn_bias and arch == "llama",
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            raw=dict(d),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json; give a Hugging Face model directory")
        return cls.from_hf_dict(json.loads(path.read_text()))


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    params = d.get("rope_parameters") or {}
    if isinstance(params, dict) and params and not all(isinstance(v, dict) for v in params.values()):
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; qerl handles {', '.join(ROPE_TYPES)}")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return theta, ({"rope_type": rope_type, **scaling} if rope_type != "default" else {})
