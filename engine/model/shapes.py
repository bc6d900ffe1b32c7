"""Qwen2.5 model shapes and a builder of random-weight models in those shapes, on the GPU.

Speed and memory depend on the shapes, not the weight values, and the GPU machine cannot
download checkpoints; so benchmarks build each architecture from its public config facts with
random weights. Each decoder layer is drawn directly on the target device and quantized there
before the next one is drawn: a 72B model never exists in bf16 at once (peak: the quantized
layers so far plus one layer in bf16).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.model.build import make_frozen
from engine.model.config import ModelConfig
from engine.model.decoder import CausalLM, Decoder
from engine.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from engine.quant.nvfp4 import global_scale_for


def _qwen25(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> ModelConfig:
    return ModelConfig(arch="qwen2", vocab_size=152064, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=intermediate,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=True,
                       max_position_embeddings=32768)


# config.json of Qwen/Qwen2.5-{7B,14B,32B,72B}(-Instruct): hidden, layers, heads, kv heads, intermediate
SHAPES: dict[str, ModelConfig] = {
    "qwen2.5-7b": _qwen25(3584, 28, 28, 4, 18944),
    "qwen2.5-14b": _qwen25(5120, 48, 40, 8, 13824),
    "qwen2.5-32b": _qwen25(5120, 64, 40, 8, 27648),
    "qwen2.5-72b": _qwen25(8192, 80, 64, 8, 29568),
}
ALIASES = {"7b": "qwen2.5-7b", "14b": "qwen2.5-14b", "32b": "qwen2.5-32b", "72b": "qwen2.5-72b"}


def shape_config(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a named shape ("7b" or "qwen2.5-7b"), optionally with fields replaced
    (e.g. ``num_layers=2`` for a quick run)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(sorted(ALIASES))}")
    return replace(SHAPES[key], **overrides)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Weights of the decoder projections (quantized), of embeddings + head (bf16), in total."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2
    mlp = 3 * h * cfg.intermediate_size
    proj = cfg.num_layers * (attn + mlp)
    emb = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return {"projections": proj, "embeddings": emb, "total": proj + emb}


def _normal(shape: tuple[int, ...], std: float, *, device, dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)


@torch.no_grad()
def build_random_model(cfg: ModelConfig | str, *, quantization: str = "nvfp4", device: str | torch.device = "cuda",
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02,
                       name: str = "") -> CausalLM:
    """A CausalLM of ``cfg``'s shape with N(0, std) weights, every decoder projection in
    ``quantization`` ("nvfp4" | "nf4" | "bf16"); q/k/v and gate/up share a global scale as in
    engine.model.build. Norm weights are 1 + N(0, 0.1), biases N(0, std)."""
    if isinstance(cfg, str):
        name = name or cfg
        cfg = shape_config(cfg)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim
    outs = {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d, "v_proj": cfg.num_kv_heads * d}

    def norm(width: int) -> RMSNorm:
        return RMSNorm(1.0 + _normal((width,), 0.1, device=device, dtype=dtype, gen=gen), cfg.rms_norm_eps)

    def group(shapes: dict[str, tuple[int, int]], bias: bool) -> dict[str, object]:
        ws = {n: _normal(s, std, device=device, dtype=dtype, gen=gen) for n, s in shapes.items()}
        gs = global_scale_for(list(ws.values())) if quantization == "nvfp4" else None
        out = {}
        for n, w in ws.items():
            b = _normal((w.shape[0],), std, device=device, dtype=dtype, gen=gen) if bias else None
            out[n] = make_frozen(w, b, quantization, dtype=dtype, global_scale=gs)
        del ws
        return out

    layers = []
    for _ in range(cfg.num_layers):
        qkv = group({n: (o, h) for n, o in outs.items()}, cfg.attention_bias)
        o = group({"o_proj": (h, cfg.num_heads * d)}, cfg.o_bias)
        gu = group({"gate_proj": (cfg.intermediate_size, h), "up_proj": (cfg.intermediate_size, h)}, cfg.mlp_bias)
        down = group({"down_proj": (h, cfg.intermediate_size)}, cfg.mlp_bias)
        qn = kn = None
        if cfg.qk_norm:
            qn, kn = norm(d), norm(d)
        attn = Attention(cfg, qkv["q_proj"], qkv["k_proj"], qkv["v_proj"], o["o_proj"], q_norm=qn, k_norm=kn)
        mlp = MLP(gu["gate_proj"], gu["up_proj"], down["down_proj"])
        layers.append(DecoderLayer(norm(h), attn, norm(h), mlp))
    embed = _normal((cfg.vocab_size, h), std, device=device, dtype=dtype, gen=gen)
    head = None if cfg.tie_word_embeddings else _normal((cfg.vocab_size, h), std, device=device, dtype=dtype, gen=gen)
    model = CausalLM(cfg, Decoder(embed, layers, norm(h)), head, name_or_path=name or "random")
    model.inv_freq = model.inv_freq.to(device)
    model.eos_token_ids = []
    model.model_dir = None
    return model.eval()


class NumberTokenizer:
    """The tokenizer of a random-weight model: a token's text is its id, space-separated.
    Enough for the sampler (pad id, decode for stop strings and Completion.text)."""

    pad_token_id = 0
    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(i)}" for i in ids)
