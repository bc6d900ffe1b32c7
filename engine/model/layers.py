"""Decoder building blocks: RMSNorm (with AQN noise), RoPE, GQA attention, SwiGLU MLP.

Module and attribute names mirror Hugging Face's Llama/Qwen2/Qwen3 so checkpoint tensor
names and PEFT adapter keys map one to one. Every projection is a FrozenLinear (or a LoRA
wrapper around one); norms and embeddings hold plain frozen tensors.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.cache import KVCache
from engine.model.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. ``noise`` (fp32 (H,) or None) is added to the weight: AQN's
    channel-wise noise, kept in fp32 because a bf16 weight would round away sigma < ~4e-3."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps = eps
        self.noise: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * w on fp32 rows: on CUDA one fused kernel forward and one
        # backward instead of the written-out formula's chain of element-wise kernels (results
        # within an ulp of it); on the CPU the same bits as the formula
        w = self.weight.float()
        if self.noise is not None:
            w = w + self.noise
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) fp32, with linear or llama3 scaling as transformers does."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = pos[..., None].float() * inv_freq.to(pos.device)  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # (B, 1, T, D)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module,
                 o_proj: nn.Module, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, n_kv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, n_h, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, n_kv, S, D)
        o = _attention(q, k, v, mask)  # (B, n_h, T, D)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with grouped-query heads. Without a mask: causal, native GQA (flash on GPU). With
    a mask, the n_rep query heads of each kv head are folded into the query-length axis, so
    k/v are never copied and the masked (memory-efficient) kernel applies on GPU as well."""
    b, h, t, d = q.shape
    n_rep = h // k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_rep > 1)
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    qf = q.reshape(b, k.shape[1], n_rep * t, d)  # head kv*n_rep + r -> kv head kv (Hugging Face's repeat_kv)
    mf = mask.repeat(1, 1, n_rep, 1)  # (B, 1, n_rep*T, S): row r*T + t is query t
    return F.scaled_dot_product_attention(qf, k, v, attn_mask=mf).view(b, h, t, d)


class MLP(nn.Module):
    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, input_layernorm: RMSNorm, self_attn: Attention, post_attention_layernorm: RMSNorm,
                 mlp: MLP) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))
