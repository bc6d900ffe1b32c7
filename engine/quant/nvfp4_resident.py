"""The compressed-tensors NVFP4 buffers recovered from the kernel operand.

On the GPU an NVFP4 layer keeps one copy of its weight: the kernel operand
(``engine.kernels.nvfp4_layout.repack``). ``unrepack`` inverts that repack, so a state dict, an
export or a dequantization can still be made from it: the codes are read back through the same
bit map, the scales from their e5m3 bytes. For scales as quantizers write them (finite, positive,
non-zero) the result equals the original buffers bit for bit; a zero or negative block scale
(which the repack folds into zeroed or sign-flipped codes) comes back as an equivalent pair that
dequantizes to the same weights.
"""
from __future__ import annotations

import torch

from engine.kernels import nvfp4_layout as layout
from engine.quant.nvfp4 import pack_codes

_BITS = ((3, 15), (2, 8), (1, 7), (0, 6))  # (code bit, bf16 bit of its half) as repack places them


def unrepack(wq: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """wq int32 [N_pad/16, K_pad/256, 576] -> (weight_packed uint8 [n, k/2], weight_scale e4m3 [n, k/16])."""
    words, sq = layout._ungroup(wq)  # (nt, kc, 32, 4 words), (nt, kc, 32) int16
    nt, kc = words.shape[0], words.shape[1]
    if nt * layout.TILE < n or kc * layout.CHUNK < k:
        raise ValueError(f"operand of {nt * layout.TILE} x {kc * layout.CHUNK} cannot hold a {n} x {k} weight")
    q = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.zeros(*q.shape, 4, 2, dtype=torch.int64, device=wq.device)  # (nt, kc, lane, j, i, e)
    for i in range(4):
        for e in range(2):
            for bit, pos in _BITS:
                codes[..., i, e] |= ((q >> layout._SOURCE[(i, pos + 16 * e)]) & 1) << bit
    # (tile, chunk, g, t, j, pr, hr, e) -> (tile, hr, g, chunk, t, j, pr, e): rows, then inputs
    codes = codes.view(nt, kc, 8, 4, 4, 2, 2, 2).permute(0, 6, 2, 1, 3, 4, 5, 7)
    codes = codes.reshape(nt * layout.TILE, kc * layout.CHUNK)[:n, :k].to(torch.uint8)

    s = sq.to(torch.int64) & 0xFFFF
    byte = torch.stack((s & 0xFF, s >> 8), dim=-1)  # (nt, kc, lane, hr)
    byte = byte.view(nt, kc, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(nt * layout.TILE, kc * 4)[:n, : k // 16]
    # e5m3 with bias 9: (1 + m/8) * 2^(e - 9); byte 0 is 2^-9 (zero blocks carry zero codes)
    scale = (1.0 + (byte & 7).double() / 8.0) * torch.exp2((byte >> 3).double() - 9.0)
    return pack_codes(codes).contiguous(), scale.to(torch.float8_e4m3fn).contiguous()
