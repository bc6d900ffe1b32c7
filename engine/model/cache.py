"""KV cache for batched decoding: preallocated per batch, left-padded, per-sequence positions.

Layout: every layer owns k/v tensors (B, n_kv, S_max, D). All rows share one write slot
``length`` (so one decode step writes column ``length`` for every row); a row's prompt is
left-padded, and ``valid`` (B, S_max) marks which slots hold real tokens. Positions are
per sequence (``next_pos``: how many real tokens each row holds), so a left-padded row gets
the same RoPE positions as it would alone. ``keep(rows)`` drops finished rows so later
decode steps cost only the live ones.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, *, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # (B, S_max)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        self.length = 0  # slots written (same for every row)
        self.max_len = max_len

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def begin(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens with ``mask`` (B, T); returns (positions (B, T),
        key_valid (B, S)) where S = length + T. Call ``commit`` once every layer has written."""
        t = mask.shape[1]
        if self.length + t > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {t} tokens > max_len {self.max_len}")
        m = mask.to(torch.bool)
        self.valid[:, self.length:self.length + t] = m
        pos = (self.next_pos[:, None] + torch.cumsum(m.long(), dim=1) - 1).clamp(min=0)  # (B, T)
        return pos, self.valid[:, :self.length + t]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, D) at the reserved slots; return all keys/values so far."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def commit(self, mask: torch.Tensor) -> None:
        self.next_pos += mask.to(torch.long).sum(dim=1)
        self.length += mask.shape[1]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (1-D index tensor), in that order."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.valid = self.valid.index_select(0, rows)
        self.next_pos = self.next_pos.index_select(0, rows)
