"""CausalLM: the compact decoder the trainer and the native sampler share.

Padding: ``attention_mask`` (B, T) with 1 = token, 0 = pad, on either side; positions are
per sequence (cumsum of the mask), as Hugging Face computes them. With padding before or between
tokens an explicit mask keeps pads from real tokens, and pad queries attend to themselves only,
so their (unused) outputs stay finite. Where every row is right-padded the causal mask alone
does that for the real tokens (pads come after them), so no mask is built and the causal kernel
runs; the pads' own outputs (unused) then see the tokens before them.

``token_logprobs`` never materialises [B*T, V] fp32 logits: it runs the head in row chunks,
each under activation checkpointing when gradients are on, so backward recomputes one
chunk's logits at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.model.cache import KVCache
from engine.model.config import ModelConfig
from engine.model.layers import DecoderLayer, RMSNorm, rope_cos_sin, rope_inv_freq


class Decoder(nn.Module):
    """Embeddings, layers and final norm (Hugging Face's ``model.model``)."""

    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, decoder: Decoder, lm_head: torch.Tensor | None, *,
                 name_or_path: str = "", hub_id: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = decoder
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                 dtype=decoder.embed_tokens.weight.dtype, device="meta")
        if lm_head is None:  # tied
            self.lm_head.weight = decoder.embed_tokens.weight
        else:
            self.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.name_or_path = name_or_path
        self.hub_id = hub_id
        self.gradient_checkpointing = False

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def aqn_norms(self) -> list[RMSNorm]:
        """The norms feeding q/k/v and gate/up, where AQN adds its noise (not the final norm)."""
        return [n for layer in self.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(layers=c.num_layers, batch=batch, max_len=max_len, kv_heads=c.num_kv_heads,
                       head_dim=c.head_dim, dtype=self.dtype, device=self.device)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Hidden states (B, T, H) after the final norm."""
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(b, t, dtype=torch.long, device=input_ids.device)
        if cache is not None:
            pos, key_valid = cache.begin(attention_mask)
            mask = _mask(key_valid, t, cache.length)
        else:
            m = attention_mask.to(torch.bool)
            pos = (torch.cumsum(m.long(), dim=1) - 1).clamp(min=0)  # (B, T)
            # Rows whose tokens all come before their padding (right padding, as the learner's
            # batches are laid out): a query at a token sees only tokens under the causal mask
            # alone, so the causal kernel (flash on a GPU) replaces the masked one; only the pad
            # positions' outputs differ, and nothing reads them.
            mask = None if _right_padded(m) else _mask(m, t, 0)
        cos, sin = rope_cos_sin(self.inv_freq, pos, self.dtype)
        x = self.model.embed_tokens(input_ids)  # (B, T, H)
        ckpt = self.gradient_checkpointing and torch.is_grad_enabled() and cache is None
        for i, layer in enumerate(self.model.layers):
            if ckpt:
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.commit(attention_mask)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, V) in the model dtype."""
        return self.lm_head(hidden)

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                       chunk_size: int = 512, temperature: float = 1.0,
                       from_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, entropy), both (B, T-1) fp32: log p(input_ids[:, t+1] | <= t) and the entropy
        of that next-token distribution, under logits / temperature (temperature <= 0: 1).
        Columns before ``from_position`` are left 0 and cost nothing (skip the prompt)."""
        b, t = input_ids.shape
        hidden = self.forward(input_ids, attention_mask)[:, from_position:t - 1]  # (B, T', H)
        targets = input_ids[:, from_position + 1:]  # (B, T')
        h = hidden.reshape(-1, hidden.shape[-1])
        y = targets.reshape(-1)
        temp = float(temperature) if temperature and temperature > 0 else 1.0
        use_ckpt = torch.is_grad_enabled() and h.requires_grad
        outs = []
        for s in range(0, h.shape[0], chunk_size):
            args = (h[s:s + chunk_size], y[s:s + chunk_size], self.lm_head.weight, temp)
            outs.append(checkpoint(_head_logprobs, *args, use_reentrant=False) if use_ckpt else _head_logprobs(*args))
        logp = torch.cat([o[0] for o in outs]).view(b, -1)
        ent = torch.cat([o[1] for o in outs]).view(b, -1)
        if from_position > 0:
            pad = logp.new_zeros(b, from_position)
            logp, ent = torch.cat([pad, logp], dim=1), torch.cat([pad, ent], dim=1)
        return logp, ent


def _head_logprobs(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h, weight).float()  # (N, V)
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, y[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def _right_padded(valid: torch.Tensor) -> bool:
    """Whether every row of the (B, T) bool mask is its tokens then its padding (no gaps)."""
    return bool((valid[:, 1:] <= valid[:, :-1]).all())


def _mask(key_valid: torch.Tensor, t: int, start: int) -> torch.Tensor:
    """Boolean SDPA mask (B, 1, T, S): query i (slot start+i) sees valid keys j <= start+i,
    and always itself."""
    s = key_valid.shape[1]
    q_slot = torch.arange(start, start + t, device=key_valid.device)[:, None]  # (T, 1)
    k_slot = torch.arange(s, device=key_valid.device)[None, :]  # (1, S)
    allowed = (k_slot <= q_slot)[None] & key_valid[:, None, :]  # (B, T, S)
    return (allowed | (k_slot == q_slot)[None])[:, None]
