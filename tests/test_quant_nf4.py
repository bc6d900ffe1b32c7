"""NF4 (bitsandbytes format) against an independent float64 re-implementation."""
from __future__ import annotations

import sys

import pytest
import torch

from engine.quant import NF4Linear, nf4, quantize_linear
from engine.quant.nf4 import NF4_THRESHOLDS, NF4_VALUES, dequantize_nf4, quantize_nf4


def nf4_table_float64() -> torch.Tensor:
    """QLoRA's NormalFloat4 from its definition (bitsandbytes create_normal_map): 8 positive
    and 7 negative N(0,1) quantiles at evenly spaced probabilities, a zero, scaled to [-1, 1]."""
    offset = 0.9677083
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)]).sort().values
    return values / values.max()


def reference_nf4(weight: torch.Tensor, blocksize: int = 64):
    """float64: per 64-element block of the flattened weight, nearest NF4 value of x/absmax."""
    flat = weight.reshape(-1).to(torch.float64)
    table = nf4_table_float64()
    codes, absmax, margin = [], [], []
    for b in range(0, flat.numel(), blocksize):
        block = flat[b : b + blocksize]
        am = block.abs().max()
        scaled = block / am if am > 0 else block
        dist = (scaled[:, None] - table[None, :]).abs()
        codes.append(dist.argmin(-1))
        two = dist.topk(2, largest=False).values
        margin.append(two[:, 1] - two[:, 0])  # distance from a tie between two codes
        absmax.append(am)
    return torch.cat(codes), torch.stack(absmax), torch.cat(margin)


def unpack_bnb(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack((packed >> 4, packed & 0xF), -1).reshape(-1)[:n].to(torch.int64)


def test_table_matches_normalfloat_definition():
    table = nf4_table_float64()
    assert NF4_VALUES.shape == (16,) and NF4_VALUES[7] == 0 and NF4_VALUES[0] == -1 and NF4_VALUES[15] == 1
    torch.testing.assert_close(NF4_VALUES.double(), table, rtol=0, atol=2e-7)
    midpoints = (table[1:] + table[:-1]) / 2  # bitsandbytes' decision thresholds
    torch.testing.assert_close(NF4_THRESHOLDS.double(), midpoints, rtol=0, atol=2e-7)


@pytest.mark.parametrize(
    "shape,dtype",
    [((16, 64), torch.float32), ((7, 96), torch.bfloat16), ((3, 21), torch.float32), ((33, 50), torch.float16)],
)
def test_codes_absmax_and_dequant_match_float64_reference(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 131 + shape[1])
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    w.view(-1)[5] = 2.0  # outlier
    w.view(-1)[64:128] = 0  # an all-zero block (when there is a second block)
    n = w.numel()
    packed, absmax = quantize_nf4(w)
    assert packed.dtype == torch.uint8 and packed.shape == ((n + 1) // 2,)
    assert absmax.dtype == torch.float32 and absmax.shape == (-(-n // 64),)
    ref_codes, ref_absmax, margin = reference_nf4(w)
    assert torch.equal(absmax.double(), ref_absmax)
    codes = unpack_bnb(packed, n)
    clear = margin > 1e-6  # float32 vs float64 can only disagree at a near-tie
    assert clear.float().mean() > 0.99
    assert torch.equal(codes[clear], ref_codes[clear])
    assert ((codes - ref_codes).abs() <= 1).all()
    deq = dequantize_nf4(packed, absmax, shape, torch.float32)
    exact = (nf4_table_float64()[codes] * ref_absmax.repeat_interleave(64)[:n]).reshape(shape)
    torch.testing.assert_close(deq.double(), exact, rtol=1e-6, atol=0)
    assert torch.equal(dequantize_nf4(packed, absmax, shape, torch.bfloat16), deq.to(torch.bfloat16))
    if n > 128:
        assert (codes[64:128] == 7).all() and not deq.view(-1)[64:128].any()


def test_packing_order_is_high_nibble_first():
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1], w[0, 2] = 1.0, -1.0, 0.5
    packed, absmax = quantize_nf4(w)
    assert absmax.tolist() == [1.0]
    assert packed[0].item() == 0xF0  # code 15 (+1.0) high, code 0 (-1.0) low
    assert packed[1].item() >> 4 == 12 and packed[1].item() & 0xF == 7  # 0.5 -> 0.4407 (nearer than 0.5626), zero


def test_nf4_linear_forward_backward_and_dtype_cast():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    bias = torch.randn(24).to(torch.bfloat16)
    layer = quantize_linear(w, bias, "nf4")
    assert isinstance(layer, NF4Linear) and layer.fmt == "nf4"
    wd = layer.dequantize(torch.bfloat16)
    assert (wd.float() - w.float()).norm() / w.float().norm() < 0.12
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, torch.matmul(x, wd.t()) + bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, torch.matmul(dy, wd))
    layer.to(torch.float16)
    assert layer.weight_absmax.dtype == torch.float32 and layer.weight_packed.dtype == torch.uint8
    assert torch.equal(layer.dequantize(torch.bfloat16), wd)


def test_nf4_rejects_a_global_scale():
    with pytest.raises(ValueError, match="global_scale only applies to nvfp4"):
        quantize_linear(torch.randn(4, 64), None, "nf4", global_scale=torch.ones(1))
    with pytest.raises(ValueError, match="choose one of"):
        quantize_linear(torch.randn(4, 64), None, "int8")


def test_chunked_quantization_equals_one_pass(monkeypatch):
    monkeypatch.setattr(nf4, "use_bitsandbytes", False)
    w = torch.randn(7, 129, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    whole = quantize_nf4(w)
    monkeypatch.setattr(nf4, "CHUNK_BLOCKS", 3)  # 15 blocks: 5 chunks, the last block partial
    chunked = quantize_nf4(w)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_bitsandbytes_missing_says_why(monkeypatch):
    # the benchmarks skip the QLoRA baseline with this reason rather than time the torch path
    monkeypatch.setattr(nf4, "use_bitsandbytes", False)
    assert "switched off" in nf4.bitsandbytes_missing("cpu")
    monkeypatch.setattr(nf4, "use_bitsandbytes", True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # an import that fails
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    why = nf4.bitsandbytes_missing("cpu")
    assert why.startswith("bitsandbytes cannot run NF4 on cpu: ") and "Error" in why
