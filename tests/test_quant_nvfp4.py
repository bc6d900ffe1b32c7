"""NVFP4 codes, scales and dequantization against compressed-tensors' own functions."""
from __future__ import annotations

import importlib
import sys
import types
import zlib

import pytest
import torch

from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from engine.quant import FORMATS, NVFP4Linear, global_scale_for, quantize_linear
from engine.quant import nvfp4
from engine.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4, unpack_codes

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])


def ct_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """llm-compressor: one absmax over the fused group, then generate_gparam."""
    amax = torch.stack([w.abs().amax() for w in weights]).amax().reshape(1)
    return generate_gparam(-amax, amax)


def ct_compress(weight: torch.Tensor, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The observer's qparams (calculate_qparams) + the nvfp4-pack-quantized compressor."""
    groups = weight.unflatten(-1, (-1, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.compress(state, SCHEME)


def ct_decompress(packed, scale, global_scale) -> torch.Tensor:
    state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.decompress(state, SCHEME)["weight"]


def random_weight(shape, dtype, seed, *, outliers=0, zero_rows=(), zero_blocks=()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    flat = w.view(-1)
    for i in torch.randint(0, flat.numel(), (outliers,), generator=g).tolist():
        flat[i] = flat[i].sign() * (1.0 + 40 * torch.rand((), generator=g))
    for r in zero_rows:
        w[r] = 0
    for r, b in zero_blocks:
        w[r, 16 * b : 16 * b + 16] = 0
    return w.to(dtype)


CASES = [
    ((1, 16), {}),
    ((7, 32), {}),
    ((33, 48), {"outliers": 3}),
    ((64, 256), {"outliers": 5, "zero_rows": (3,), "zero_blocks": ((5, 2), (6, 0))}),
    ((129, 80), {"outliers": 1, "zero_rows": (0, 128)}),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape,kw", CASES)
def test_codes_and_scales_equal_compressed_tensors(shape, kw, dtype):
    w = random_weight(shape, dtype, seed=zlib.crc32(f"{shape}{dtype}".encode()), **kw)
    packed, scale, gs = quantize_nvfp4(w)
    ref_gs = ct_global_scale([w])
    ref = ct_compress(w, ref_gs)
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert torch.equal(gs, ref_gs)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (shape[0], shape[1] // 16)
    assert torch.equal(scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
    assert torch.equal(packed, ref["weight_packed"])
    # dequantization is the same function of the same bits
    for out_dtype in (torch.bfloat16, torch.float32):
        ours = dequantize_nvfp4(packed, scale, gs, out_dtype)
        theirs = ct_decompress(ref["weight_packed"], ref["weight_scale"], ref_gs).to(torch.float32)
        if out_dtype == torch.bfloat16:
            assert torch.equal(ours, ct_decompress(ref["weight_packed"], ref["weight_scale"], ref_gs))
        else:  # fp32 output: e2m1 * (scale / gs) with no final rounding
            m, n = packed.shape[0], packed.shape[1] * 2
            exact = unpack_fp4_from_uint8(packed, m, n, torch.float32).unflatten(-1, (-1, 16))
            exact = (exact * (scale.float() / gs).unsqueeze(-1)).flatten(-2)
            assert torch.equal(ours, exact)
            assert torch.allclose(ours, theirs, rtol=2**-8, atol=0)


def test_quantization_error_is_small_and_outliers_survive():
    w = random_weight((64, 128), torch.float32, seed=1, outliers=2)
    deq = dequantize_nvfp4(*quantize_nvfp4(w), torch.float32)
    big = w.abs() > 0.5
    assert torch.allclose(deq[big], w[big], rtol=0.1)  # an outlier is its block's max
    rel = (deq - w).norm() / w.norm()
    assert rel < 0.12, rel


def test_ties_round_to_even_index():
    # block amax 6 and global scale 1 make the block scale exactly 1, so x is quantized as is
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    row = torch.cat([ties, -ties])  # 16 elements, one block
    packed, scale, _ = quantize_nvfp4(row[None], global_scale=torch.ones(1))
    assert scale.float().item() == 1.0
    expected = [0, 2, 2, 4, 4, 6, 6, 7]  # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert unpack_codes(packed)[0].tolist() == expected + [8 | c for c in expected]
    assert torch.equal(packed, ct_compress(row[None], torch.ones(1))["weight_packed"])


def test_signed_zero_small_values_and_tiny_blocks_match_compressed_tensors():
    w = random_weight((8, 64), torch.float32, seed=3)
    w[0, :16] = -0.0
    w[1, 16:32] = 1e-4 * w[1, 16:32]  # block scale near fp8's smallest step
    w[2, 32:48] = 1e-9  # block scale underflows fp8 -> compressed-tensors' 0.125
    w[3, 5] = 30.0  # one outlier sets the global scale
    gs = ct_global_scale([w])
    ref = ct_compress(w, gs)
    packed, scale, ours_gs = quantize_nvfp4(w)
    assert torch.equal(ours_gs, gs)
    assert torch.equal(scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert torch.equal(packed, ref["weight_packed"])
    assert scale[2, 2].float().item() == 0.125


def test_all_zero_weight():
    w = torch.zeros(4, 32, dtype=torch.bfloat16)
    packed, scale, gs = quantize_nvfp4(w)
    ref_gs = ct_global_scale([w])
    ref = ct_compress(w, ref_gs)
    assert torch.equal(gs, ref_gs) and gs.item() == 1.0
    assert torch.equal(packed, ref["weight_packed"]) and not packed.any()
    assert torch.equal(scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert not dequantize_nvfp4(packed, scale, gs).any()


def test_shared_global_scale_for_fused_group():
    q, k, v = (random_weight((n, 64), torch.bfloat16, seed=s) for n, s in ((64, 10), (32, 11), (32, 12)))
    k = k * 3  # k has the largest amax, so the smallest scale
    shared = global_scale_for([q, k, v])
    assert torch.equal(shared, ct_global_scale([q, k, v]))
    assert torch.equal(shared, torch.cat([global_scale_for([t]) for t in (q, k, v)]).amin().reshape(1))
    for w in (q, k, v):
        packed, scale, gs = quantize_nvfp4(w, shared)
        ref = ct_compress(w, shared)
        assert torch.equal(gs, shared)
        assert torch.equal(packed, ref["weight_packed"])
        assert torch.equal(scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))


def test_chunked_quantization_equals_one_pass():
    w = random_weight((37, 96), torch.bfloat16, seed=5, outliers=2)
    whole = quantize_nvfp4(w, chunk_elements=1 << 30)
    chunked = quantize_nvfp4(w, chunk_elements=96 * 5)  # 5 rows per chunk, ragged last chunk
    for a, b in zip(whole, chunked):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(*whole, chunk_elements=96 * 4), dequantize_nvfp4(*whole))


def test_in_features_not_multiple_of_16_names_the_fix():
    with pytest.raises(ValueError, match="divisible by 16.*bf16"):
        quantize_linear(torch.randn(8, 40), None, "nvfp4")


def test_linear_forward_backward_and_buffers(monkeypatch):
    monkeypatch.setattr(nvfp4, "use_kernels", False)
    w = random_weight((24, 48), torch.bfloat16, seed=7)
    bias = torch.randn(24, dtype=torch.bfloat16)
    layer = quantize_linear(w, bias, "nvfp4")
    assert isinstance(layer, NVFP4Linear) and layer.fmt == "nvfp4" and "nvfp4" in FORMATS
    assert {n: b.dtype for n, b in layer.named_buffers()} == {
        "bias": torch.bfloat16,
        "weight_packed": torch.uint8,
        "weight_scale": torch.float8_e4m3fn,
        "weight_global_scale": torch.float32,
    }
    x = torch.randn(2, 5, 48, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    wd = layer.dequantize(torch.bfloat16)
    assert torch.equal(y, torch.matmul(x, wd.t()) + bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, torch.matmul(dy, wd))
    # casting the model must not round the global scale nor reinterpret the codes
    gs = layer.weight_global_scale.clone()
    layer.to(torch.float16)
    assert layer.weight_global_scale.dtype == torch.float32 and torch.equal(layer.weight_global_scale, gs)
    assert layer.weight_scale.dtype == torch.float8_e4m3fn and layer.bias.dtype == torch.float16
    assert torch.equal(layer.dequantize(torch.bfloat16), wd)
    # the state dict uses compressed-tensors' names, so it round-trips
    sd = layer.state_dict()
    again = NVFP4Linear(sd["weight_packed"], sd["weight_scale"], sd["weight_global_scale"])
    assert torch.equal(again.dequantize(), wd)


def test_kernel_hook_is_used_when_available(monkeypatch):
    """The GPU kernel package plugs in through engine.kernels.nvfp4_available/nvfp4_matmul."""
    calls = []
    fake = types.ModuleType("engine.kernels")
    fake.nvfp4_available = lambda x: x.dtype == torch.bfloat16
    fake.nvfp4_matmul = lambda x, layer: calls.append("fwd") or torch.matmul(x, layer.dequantize(x.dtype).t())
    monkeypatch.setitem(sys.modules, "engine.kernels", fake)
    assert importlib.import_module("engine.kernels") is fake
    layer = quantize_linear(random_weight((16, 32), torch.float32, seed=8), None, "nvfp4")
    x = torch.randn(3, 32, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # no nvfp4_matmul_t: backward falls back to the reference path
    assert calls == ["fwd"] and x.grad is not None
    layer(x.float().detach())  # nvfp4_available says no -> reference path
    assert calls == ["fwd"]
    monkeypatch.setattr(nvfp4, "use_kernels", False)
    layer(x.detach())
    assert calls == ["fwd"]
