"""One copy of the NVFP4 base: the layer kept as the kernel operand only (make_resident), with the
compressed-tensors buffers rebuilt from it bit for bit (CPU; the GPU path is in test_gpu_path.py)."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import nvfp4_layout as layout
from engine.kernels import prepare_tensors
from engine.quant.nvfp4 import NVFP4Linear, dequantize_nvfp4, quantize_nvfp4
from engine.quant.nvfp4_resident import unrepack


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))  # rows of varied scale
    w[0, :16] = 0.0  # an all-zero block (compressed-tensors gives it scale 0.125)
    w[-1, -16:] *= 1e4  # an outlier block
    return w.to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), [(16, 16), (40, 48), (64, 256), (72, 4112), (1000, 1008), (136, 2000)])
def test_unrepack_returns_the_buffers_bit_for_bit(n, k):
    packed, scale, _ = quantize_nvfp4(_weight(n, k, seed=n + k))
    got_packed, got_scale = unrepack(layout.repack(packed, scale), n, k)
    assert got_packed.dtype == torch.uint8 and got_scale.dtype == torch.float8_e4m3fn
    assert torch.equal(got_packed, packed)
    assert torch.equal(got_scale.view(torch.uint8), scale.view(torch.uint8))


def test_every_e4m3_scale_and_code_survives():
    # all 16 codes against every finite positive e4m3 value, subnormals included
    bits = torch.arange(1, 127, dtype=torch.uint8)  # e4m3 0x01..0x7e
    n = bits.numel()
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, 2)  # (n, 32): two blocks per row
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.stack((bits, bits.flip(0)), dim=1).view(torch.float8_e4m3fn)
    got_packed, got_scale = unrepack(layout.repack(packed, scale), n, 32)
    assert torch.equal(got_packed, packed)
    assert torch.equal(got_scale.view(torch.uint8), scale.view(torch.uint8))


def test_zero_and_negative_scales_come_back_as_the_same_weights():
    g = torch.Generator().manual_seed(3)
    n, k = 64, 256
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // 16, generator=g) * 8 + 0.01
    s[0, 0] = 0.0
    s[1, :4] = -s[1, :4]
    scale = s.to(torch.float8_e4m3fn)
    got_packed, got_scale = unrepack(layout.repack(packed, scale), n, k)
    gs = torch.tensor([3.0])
    torch.testing.assert_close(dequantize_nvfp4(got_packed, got_scale, gs, torch.float32),
                               dequantize_nvfp4(packed, scale, gs, torch.float32), rtol=0, atol=0)


def test_resident_layer_keeps_its_state_dict_output_and_dequantization():
    w = _weight(72, 4112, seed=1)
    bias = torch.randn(72).to(torch.bfloat16)
    ref = NVFP4Linear.from_float(w, bias)
    layer = NVFP4Linear.from_float(w, bias)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.make_resident(prepare_tensors(layer.weight_packed, layer.weight_scale, layer.weight_global_scale))
    assert layer.weight_packed is None and layer.weight_scale is None  # the other copy is gone
    after = layer.state_dict()
    assert list(after) == list(before) or sorted(after) == sorted(before)
    for name, t in before.items():
        assert torch.equal(after[name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else after[name],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), name
    assert torch.equal(layer.dequantize(torch.float32), ref.dequantize(torch.float32))
    x = torch.randn(5, 4112, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = layer(x), ref(x_ref)
    assert torch.equal(y, y_ref)
    y.float().square().sum().backward()
    y_ref.float().square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_resident_layer_loads_moves_and_restores():
    w = _weight(64, 256, seed=2)
    layer = NVFP4Linear.from_float(w)
    ref_sd = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.make_resident()  # its own repack (engine.kernels.prepare)
    assert layer.resident is not None and layer.weight_packed is None
    other = NVFP4Linear.from_float(_weight(64, 256, seed=9))
    other.make_resident()
    other.load_state_dict(ref_sd)  # loading brings the buffers back and drops the stale operand
    assert other.resident is None and torch.equal(other.weight_packed, ref_sd["weight_packed"])
    layer.to(torch.float32)  # casting must not round the codes or the global scale
    assert layer.resident is None
    assert layer.weight_packed.dtype == torch.uint8 and layer.weight_global_scale.dtype == torch.float32
    assert torch.equal(layer.weight_packed, ref_sd["weight_packed"])
    with pytest.raises(ValueError, match="operand is"):
        layer.make_resident(prepare_tensors(*quantize_nvfp4(_weight(128, 256, seed=4))))
