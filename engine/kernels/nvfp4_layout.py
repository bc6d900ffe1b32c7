"""NVFP4 weights repacked once for the fused GEMM, and the same dequantization in plain torch.

Input (compressed-tensors ``nvfp4-pack-quantized``): ``weight_packed`` uint8 [N, K/2] (element
2j in the low nibble), ``weight_scale`` float8_e4m3fn [N, K/16], ``weight_global_scale`` fp32
[1]; W = e2m1 * scale / global_scale.

Output, N padded to 64 rows and K to 256 inputs (zero codes): ``wq`` int32 [N/16, K/256, 576],
one contiguous 2304-byte record per 16-row tile and "group" of 4 chunks of 64 inputs: the four
chunks' weights (4 x 32 lanes x 16 bytes), then each lane's 8 bytes of scales (one 16-bit pair per
chunk). Within a chunk:

- weights: 16 bytes per lane of a warp. Lane (g, t) = (lane // 4, lane % 4) holds rows g and g+8 and inputs
  16t..16t+15 of the chunk (block-scale group t). Word j holds inputs 4j..4j+3 of those rows as
  four bf16 pairs R0 = (row g, 4j..4j+1), R1 = (row g+8, same), R2 = (row g, 4j+2..4j+3),
  R3 = (row g+8, same): the A fragment of an m16n8k16 MMA once the MMA's inputs are permuted
  inside the chunk (the kernel reads activations with the same permutation).
- The 4-bit code of each element is spread so that a shift and an and give a bf16 pair: the
  sign lands on bit 15, the three magnitude bits on bits 6..8 of each half, i.e. the e2m1 value
  times 2^-126. ``_SOURCE`` says which bit of the word feeds each output bit: R0 = q & mask,
  R1 = (q << 4) & mask, R2 = rotr(q, 6) & mask, R3 = ((q << 6) & 0x80C080C0) | ((q >> 2) &
  0x01000100) (two left shifts, which the GPU can run off its integer ALU pipe).
- scales: lane (g, t)'s two scales, row g in the low byte, row g+8 in the
  high one, as an e5m3 byte (bias 9) that covers every e4m3 value including subnormals: byte*16 +
  (237 << 7) is the bf16 of scale * 2^119 (one integer multiply-add in the kernel). Zero-scale
  blocks get zero codes; negative scales flip their block's code signs.
- ``alpha`` = 2^7 / global_scale: the kernel's bf16 weights are e2m1 * scale * 2^-7 (exact).
"""
from __future__ import annotations

import torch

CHUNK = 64  # inputs per chunk (4 block-scale groups)
GROUP = 256  # inputs per record (4 chunks)
TILE = 16  # rows per MMA tile
ROW_PAD = 64  # rows padded so every warp holds whole groups of up to 4 tiles
WEIGHT_EXP2 = 7  # kernel weights are e2m1 * scale * 2^-WEIGHT_EXP2
_SCALE_BIAS = 237 << 7
_MASK = 0x81C081C0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _source_bits() -> dict[tuple[int, int], int]:
    """(output register 0..3, output bit) -> bit of the packed word it is read from."""
    src = {}
    for half in (0, 16):
        for p in (6, 7, 8, 15):
            b = p + half
            src[(0, b)] = b
            src[(1, b)] = b - 4
            src[(2, b)] = (b + 6) % 32
            src[(3, b)] = b + 2 if p == 8 else b - 6
    assert sorted(src.values()) == list(range(32)), "bit map must be a permutation"
    return src


_SOURCE = _source_bits()


def unpack_codes(weight_packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K] (element 2j from the low nibble)."""
    lo = weight_packed & 0x0F
    hi = weight_packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _scale_bytes(weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 [N, G] -> (e5m3 byte int32, block is zero, block is negative)."""
    s = weight_scale.float()
    if torch.isnan(s).any():
        raise ValueError("weight_scale holds NaN: re-quantize the layer (NVFP4 scales must be finite)")
    neg = s < 0
    a = s.abs()
    zero = a == 0
    mant, exp = torch.frexp(torch.where(zero, torch.ones_like(a), a))  # a = mant * 2^exp, mant in [0.5, 1)
    e = exp.to(torch.int32) - 1 + 9
    m = torch.round((mant * 2 - 1) * 8).to(torch.int32)
    if (e < 0).any() or (e > 17).any():
        raise ValueError("weight_scale outside the float8_e4m3fn range: store scales as float8_e4m3fn")
    byte = torch.where(zero, torch.zeros_like(e), e * 8 + m)
    return byte, zero, neg


def repack(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 buffers -> wq int32 [N/16, K/256, 576] on the same device."""
    n, half_k = weight_packed.shape
    k = 2 * half_k
    if k % 16 or tuple(weight_scale.shape) != (n, k // 16):
        raise ValueError(f"weight_scale must be [N, K/16] = [{n}, {k // 16}], got {tuple(weight_scale.shape)}")
    codes = unpack_codes(weight_packed).to(torch.int64)  # (N, K)
    byte, zero, neg = _scale_bytes(weight_scale)
    zero_e = zero.repeat_interleave(16, dim=1)
    neg_e = neg.repeat_interleave(16, dim=1)
    codes = torch.where(zero_e, torch.zeros_like(codes), codes)
    codes = torch.where(neg_e, codes ^ 8, codes)

    n_pad = -(-n // ROW_PAD) * ROW_PAD
    k_pad = -(-k // GROUP) * GROUP
    nt, kc = n_pad // TILE, k_pad // CHUNK
    codes = torch.nn.functional.pad(codes, (0, k_pad - k, 0, n_pad - n))
    byte = torch.nn.functional.pad(byte, (0, k_pad // 16 - k // 16, 0, n_pad - n))

    # codes[row = 16*tile + 8*hr + g, k = 64*chunk + 16*t + 4*j + 2*pr + e]
    c = codes.view(nt, 2, 8, kc, 4, 4, 2, 2)  # tile hr g chunk t j pr e
    c = c.permute(0, 3, 2, 4, 5, 6, 1, 7)  # tile chunk g t j pr hr e ; register i = 2*pr + hr
    c = c.reshape(nt, kc, 32, 4, 4, 2)  # tile chunk lane j i e
    word = torch.zeros(c.shape[:4], dtype=torch.int64, device=codes.device)
    for i in range(4):
        for e in range(2):
            code = c[..., i, e]
            half = 16 * e
            for bit, pos in ((3, 15), (2, 8), (1, 7), (0, 6)):
                word |= ((code >> bit) & 1) << _SOURCE[(i, pos + half)]
    wq = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()

    b = byte.view(nt, 2, 8, kc, 4).permute(0, 3, 2, 4, 1).reshape(nt, kc, 32, 2).to(torch.int64)
    s16 = b[..., 0] | (b[..., 1] << 8)
    sq = torch.where(s16 >= 2**15, s16 - 2**16, s16).to(torch.int16)
    return _group(wq, sq)


def _group(wq: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    """Per-chunk words [nt, kc, 32, 4] and scales [nt, kc, 32] -> records [nt, kc/4, 576]."""
    nt, kc = wq.shape[:2]
    w = wq.reshape(nt, kc // 4, 512)
    s = sq.reshape(nt, kc // 4, 4, 32).transpose(2, 3).contiguous().view(torch.int32).reshape(nt, kc // 4, 64)
    return torch.cat((w, s), dim=-1).contiguous()


def _ungroup(wq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nt, kg = wq.shape[:2]
    w = wq[..., :512].reshape(nt, kg * 4, 32, 4)
    s = wq[..., 512:].contiguous().view(torch.int16).reshape(nt, kg, 32, 4).transpose(2, 3).reshape(nt, kg * 4, 32)
    return w, s


def _rotr(q: torch.Tensor, s: int) -> torch.Tensor:
    return ((q >> s) | (q << (32 - s))) & 0xFFFFFFFF


def _bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 holding 16-bit patterns -> float32 of those bf16 values (exact)."""
    signed = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
    return signed.view(torch.bfloat16).float()


def dequantize(wq: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The kernel's weights, e2m1 * scale * 2^-7 as bf16 [n, k], by the kernel's own bit operations."""
    wq, sq = _ungroup(wq)
    nt, kc = wq.shape[0], wq.shape[1]
    q = wq.to(torch.int64) & 0xFFFFFFFF  # (nt, kc, 32, 4 words)
    outs = torch.stack(
        (
            q & _MASK,
            (q << 4) & _MASK,
            _rotr(q, 6) & _MASK,
            ((q << 6) & 0x80C080C0) | ((q >> 2) & 0x01000100),
        ),
        dim=-1,
    )  # (nt, kc, 32, j, i)
    vals = _bf16_from_bits(torch.stack((outs & 0xFFFF, outs >> 16), dim=-1))  # (..., j, i, e)
    s = sq.to(torch.int64) & 0xFFFF
    mult = _bf16_from_bits(torch.stack((s & 0xFF, s >> 8), dim=-1) * 16 + _SCALE_BIAS)  # (..., hr)
    hr = torch.tensor([0, 1, 0, 1], device=wq.device)
    vals = vals * mult[..., None, hr, None]  # register i uses row g (i even) or g+8 (i odd)
    vals = vals.view(nt, kc, 8, 4, 4, 2, 2, 2)  # tile chunk g t j pr hr e
    w = vals.permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(nt * TILE, kc * CHUNK)
    return w[:n, :k].to(torch.bfloat16)


def reference_dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """bf16(e2m1 * e4m3 scale) [N, K] from the original buffers (no global scale): exact in bf16."""
    table = torch.tensor(_E2M1, dtype=torch.float32, device=weight_packed.device)
    vals = table[unpack_codes(weight_packed).long()]
    return (vals * weight_scale.float().repeat_interleave(16, dim=1)).to(torch.bfloat16)
