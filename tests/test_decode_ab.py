"""benchmarks/decode_ab.py: its variants (module and class attributes set to literals and
environment variables, put back after), and a functional dry run on CPU with a tiny shape."""
from __future__ import annotations

import argparse
import os

import pytest

import engine.rollout.cuda_graph as cg
from benchmarks import decode_ab
from engine.rollout.fused_ops import CudaOps


def test_variants_set_module_and_class_attributes_and_put_them_back():
    name, sets = decode_ab.parse_variant(
        "v:engine.rollout.cuda_graph.QKV_EPILOGUE_ROWS=3,engine.rollout.fused_ops.CudaOps.name='x'")
    assert name == "v" and [(o, a, v) for o, a, v in sets] == [(cg, "QKV_EPILOGUE_ROWS", 3), (CudaOps, "name", "x")]
    before = cg.QKV_EPILOGUE_ROWS
    with decode_ab.applied(sets):
        assert cg.QKV_EPILOGUE_ROWS == 3 and CudaOps.name == "x"
    assert cg.QKV_EPILOGUE_ROWS == before and CudaOps.name == "cuda"
    with pytest.raises(RuntimeError), decode_ab.applied(sets):
        raise RuntimeError("a failed run")
    assert cg.QKV_EPILOGUE_ROWS == before and CudaOps.name == "cuda"
    assert decode_ab.parse_variant("base:") == ("base", [])
    _, sets = decode_ab.parse_variant("d:engine.rollout.fused_ops.CudaOps.name=('a', 'b'),"
                                      "engine.rollout.cuda_graph.QKV_EPILOGUE_ROWS=2")  # commas inside a literal
    assert [(a, v) for _, a, v in sets] == [("name", ("a", "b")), ("QKV_EPILOGUE_ROWS", 2)]


def test_variants_set_environment_variables_and_put_them_back(monkeypatch):
    monkeypatch.delenv("QERL_SHRINK_CLUSTER", raising=False)
    monkeypatch.setenv("QERL_PDL", "1")
    name, sets = decode_ab.parse_variant("c:env.QERL_SHRINK_CLUSTER=1,env.QERL_PDL=0,"
                                         "engine.rollout.cuda_graph.QKV_EPILOGUE_ROWS=3")
    assert name == "c" and [(a, v) for _, a, v in sets] == [("QERL_SHRINK_CLUSTER", "1"), ("QERL_PDL", "0"),
                                                             ("QKV_EPILOGUE_ROWS", 3)]
    before = cg.QKV_EPILOGUE_ROWS
    with pytest.raises(RuntimeError), decode_ab.applied(sets):
        assert os.environ["QERL_SHRINK_CLUSTER"] == "1" and os.environ["QERL_PDL"] == "0"
        assert cg.QKV_EPILOGUE_ROWS == 3
        raise RuntimeError("a failed run")
    assert "QERL_SHRINK_CLUSTER" not in os.environ and os.environ["QERL_PDL"] == "1"
    assert cg.QKV_EPILOGUE_ROWS == before


@pytest.mark.parametrize(("parse", "text", "message"), [
    (decode_ab.parse_variant, ":engine.rollout.cuda_graph.QKV_EPILOGUE_ROWS=3", "give it a name"),
    (decode_ab.parse_variant, "v:engine.rollout.cuda_graph.QKV_EPILOGUE_ROWS", "is not path=value"),
    (decode_ab.parse_variant, "v:engine.rollout.cuda_graph.QKV_EPILOGUE_ROWS=eight", "is not a Python literal"),
    (decode_ab.parse_variant, "v:engine.rollout.cuda_graph.NO_SUCH_KNOB=1", "has no attribute 'NO_SUCH_KNOB'"),
    (decode_ab.parse_variant, "v:nosuchpackage.knob=1", "no importable module"),
    (decode_ab.kernels_variant, "prev", "write name=path"),  # --kernels
    (decode_ab.kernels_variant, "=engine/kernels/nvfp4_gemm.cu", "write name=path"),
    (decode_ab.kernels_variant, "prev=no/such/nvfp4_gemm.cu", "did not build"),
])
def test_bad_variants_name_the_problem(parse, text, message):
    with pytest.raises(ValueError, match=message):
        parse(text)


def test_dry_run_on_cpu_alternates_the_variants():
    args = argparse.Namespace(
        size="7b", method="nvfp4", batches="1,2", rounds=2, rank=4, prompt=6, gen=3, device="cpu",
        variant=["base:", "qkv1:engine.rollout.cuda_graph.QKV_EPILOGUE_ROWS=1"], kernels=[],
        shape="hidden_size=64,num_layers=1,num_heads=2,num_kv_heads=1,head_dim=32,intermediate_size=128,"
              "vocab_size=256")
    before = cg.QKV_EPILOGUE_ROWS
    rows = decode_ab.run(args)
    assert [(r["batch"], r["variant"]) for r in rows] == [(1, "base"), (1, "qkv1"), (2, "base"), (2, "qkv1")]
    assert all(len(r["runs"]) == 2 and r["ms_per_step"] > 0 for r in rows)
    assert rows[0]["delta_ms"] == 0 and rows[2]["delta_ms"] == 0
    assert cg.QKV_EPILOGUE_ROWS == before


def test_gemm_benchmark_refuses_bad_kernels_before_timing(monkeypatch):
    """benchmarks/gemm_nvfp4.py --kernels takes decode_ab's name=path form and rejects a bad one
    with its message before it touches a GPU."""
    import sys

    from benchmarks import gemm_nvfp4

    for text, message in (("prev", "write name=path"), ("prev=no/such/nvfp4_gemm.cu", "did not build")):
        monkeypatch.setattr(sys, "argv", ["gemm_nvfp4.py", "--kernels", text])
        with pytest.raises(ValueError, match=message):
            gemm_nvfp4.main()
    # --variant takes decode_ab's name:module.attr=value form, checked the same way
    for text, message in ((":engine.kernels.nvfp4_gemm._WS_DIRECT_MAX=0", "give it a name"),
                          ("staged:engine.kernels.nvfp4_gemm._WS_DIRECT_MAX=zero", "not a Python literal")):
        monkeypatch.setattr(sys, "argv", ["gemm_nvfp4.py", "--variant", text])
        with pytest.raises(ValueError, match=message):
            gemm_nvfp4.main()


def test_rollout_step_overhead_dry_run_on_cpu():
    """benchmarks/rollout.py --profile's step timing (replays, and replays with the sampler
    between them) on CPU: in a rollout's run, and asked for more replays than the cache has
    columns left (it stops at the cache's end: past it the positions leave the RoPE tables)."""
    from benchmarks import rollout
    from engine.model.shapes import NumberTokenizer, build_random_model, shape_config
    from engine.rollout import SamplingParams
    from engine.rollout.cuda_graph import GraphRollout

    model = build_random_model(shape_config("7b", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                            head_dim=32, intermediate_size=128, vocab_size=256),
                               quantization="nvfp4", device="cpu")
    rollout.set_lora(model, 4)
    args = argparse.Namespace(prompt=6, gen=3, repeats=1, device="cpu", bandwidth=False, profile=True)
    row = rollout.run_config(model, "nvfp4", "7b", 4, 1, args, lambda r: None)
    over = row["step_overhead"]
    assert set(over) == {"replay", "replay+sample"} and all(v > 0 for v in over.values())
    eng = GraphRollout(model, max_batch=2, max_len=16)
    eng.generate(NumberTokenizer(), [[5, 6, 7]] * 2, SamplingParams(max_new_tokens=2, temperature=1.0,
                                                                     eos_token_ids=[-1]))
    over = rollout.step_overhead(eng, 2, 6, replays=128)
    assert all(v > 0 for v in over.values()) and int(eng.slot) == 15 and eng.pos.max() == 15


@pytest.mark.parametrize("branch", ["on", "off"])
def test_learner_dry_run_on_cpu(monkeypatch, branch):
    """benchmarks/learner.py on CPU with a tiny shape, the LoRA branch as bf16 pieces ("on": the
    GPU's way, emulated) and in fp32: one timed micro-batch of ragged rows."""
    import engine.lora
    from benchmarks import learner

    monkeypatch.setattr(engine.lora, "SPLIT_BRANCH", branch)  # what learner.main sets from --lora-branch
    args = argparse.Namespace(
        layers=1, micro_batch=3, prompt=5, gen=6, rank=4, chunk=7, repeats=1, ragged=True, profile=False, top=5,
        device="cpu", lora_branch=branch, branch_add="addmm",
        shape="hidden_size=64,num_heads=2,num_kv_heads=1,head_dim=32,intermediate_size=128,vocab_size=256")
    row = learner.one("7b", "nvfp4", args)
    assert row["tokens"] == 33 and row["ms"] > 0 and row["lora_branch"] == branch
