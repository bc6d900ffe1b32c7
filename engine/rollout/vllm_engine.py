"""Starting and stopping the in-process vLLM engine the rollout backend samples with.

Settings that matter for RL rollouts: in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
the engine shares the trainer's process and device; compute in the trainer's dtype; LoRA at the
smallest rank slot vLLM offers that holds the job's rank, one adapter resident; prefix caching on
(sync resets it); ``logprobs_mode`` chosen so that the returned log-probs are the learner's
distribution (see engine.rollout.vllm_backend). Memory: ``rollout.kv_cache_memory_bytes`` or
``rollout.gpu_memory_utilization`` from the job; without either, 1 GiB of KV cache on CPU and 35%
of the GPU (the trainer needs the rest). On CPU, vLLM's OpenMP thread binding is off unless the
environment sets it (``VLLM_CPU_OMP_THREADS_BIND``): binding would pin the trainer's threads too,
and on a shared machine it made decoding ~40x slower here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from engine.spec import RolloutSpec

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
CPU_KV_CACHE_BYTES = 1 << 30  # default KV cache on CPU when the job sets none
GPU_MEMORY_UTILIZATION = 0.35  # default share of the GPU for vLLM: the trainer shares the device


def _logprobs_mode(spec: RolloutSpec) -> str:
    truncated = spec.top_k > 0 or spec.top_p < 1.0
    return "raw_logprobs" if truncated and spec.temperature in (0.0, 1.0) else "processed_logprobs"


def _max_lora_rank(r: int) -> int:
    for allowed in LORA_RANKS:
        if allowed >= r:
            return allowed
    raise ValueError(f"lora.r={r} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}; lower lora.r or use "
                     'rollout.backend "native"')


def start_engine(base_dir: Path, spec: RolloutSpec, model: Any, lora_spec: Any, max_model_len: int | None) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: share the trainer's device
    on_gpu = model.device.type == "cuda"
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    dtype = str(model.dtype).removeprefix("torch.")  # compute as the trainer does (engine.model.compute_dtype)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_model_len is not None and limit:
        max_model_len = min(max_model_len, int(limit))
    kwargs: dict[str, Any] = dict(model=str(base_dir), tokenizer=str(base_dir), dtype=dtype, seed=0,
                                  max_num_seqs=spec.max_batch, logprobs_mode=_logprobs_mode(spec),
                                  generation_config="vllm", enable_prefix_caching=True, max_model_len=max_model_len,
                                  enforce_eager=not on_gpu)
    if lora_spec is not None:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_max_lora_rank(lora_spec.r))
    if spec.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = spec.kv_cache_memory_bytes
    elif not on_gpu:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if spec.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
    elif on_gpu and spec.kv_cache_memory_bytes is None:
        kwargs["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
    return LLM(**kwargs)


def shutdown_engine(llm: Any) -> None:
    """Free the engine so that another can start in this process."""
    import gc

    engine = llm.llm_engine
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, engine, core
    gc.collect()
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # noqa: BLE001 - best effort: nothing was initialised
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
