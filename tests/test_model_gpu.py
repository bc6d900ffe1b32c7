"""The decoder, LoRA and the sampler on a CUDA device (skipped without one): same numbers as
on CPU within bf16 tolerance, masked GQA attention, checkpointed backward, CUDA generators."""
from __future__ import annotations

import pytest
import torch

from engine.lora import adapter_params
from engine.model import load_model
from engine.model.tiny import make_tiny_model
from engine.rollout import SamplingParams, generate
from engine.spec import LoraSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gpu") / "qwen2", arch="qwen2", hidden=128, seed=5,
                           initializer_range=0.3)


def _batch():
    ids = torch.randint(0, 49152, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, -3:] = 0
    return ids, mask


@pytest.mark.parametrize("quantization", ["bf16", "nvfp4"])
def test_cuda_logits_match_cpu(tiny_dir, quantization, monkeypatch):
    import engine.quant.nvfp4 as nvfp4

    monkeypatch.setattr(nvfp4, "use_kernels", False)  # the decoder's CUDA path; kernels are tested on their own
    cpu, _ = load_model(str(tiny_dir), quantization=quantization)
    gpu, _ = load_model(str(tiny_dir), quantization=quantization, device="cuda")
    ids, mask = _batch()
    with torch.no_grad():
        a = cpu.logits(cpu(ids, mask)).float()
        b = gpu.logits(gpu(ids.cuda(), mask.cuda())).float().cpu()
    real = mask.bool()
    assert (a - b)[real].abs().max() < 0.4 and (a - b)[real].abs().mean() < 0.03


def test_cuda_checkpointed_backward_matches(tiny_dir):
    m, _ = load_model(str(tiny_dir), quantization="nvfp4", device="cuda", lora=LoraSpec(r=8))
    with torch.no_grad():
        for p in adapter_params(m):
            p.normal_(0, 0.05)
    ids, mask = (t.cuda() for t in _batch())
    grads = []
    for ckpt in (False, True):
        m.gradient_checkpointing = ckpt
        logp, ent = m.token_logprobs(ids, mask, chunk_size=7)
        ((logp + 0.01 * ent) * mask[:, 1:]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in adapter_params(m)]))
        m.zero_grad()
    assert torch.isfinite(grads[0]).all() and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("gen_device", ["cuda", "cpu"])
def test_cuda_generate_logprobs_match_learner(tiny_dir, gen_device):
    m, tok = load_model(str(tiny_dir), quantization="nvfp4", device="cuda")
    prompts = [[1, 5, 6, 7, 8, 9], [1, 300], [1, 40, 41, 42]]
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, eos_token_ids=[-1])
    outs = generate(m, tok, prompts, params, generator=torch.Generator(device=gen_device).manual_seed(1), max_batch=2)
    plen = max(map(len, prompts))
    ids = torch.full((3, plen + 12), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for r, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o.token_ids) == 12 and o.finish_reason == "length"
        ids[r, plen - len(p):] = torch.tensor(p + o.token_ids)
        mask[r, plen - len(p):] = 1
    with torch.no_grad():
        logp, _ = m.token_logprobs(ids.cuda(), mask.cuda(), temperature=0.9, from_position=plen - 1)
    sampler = torch.stack([o.logprobs for o in outs])
    assert (logp[:, plen - 1:].cpu() - sampler).abs().max() < 0.15
