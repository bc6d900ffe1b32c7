"""The rollout backend interface: where a job's samples come from.

The train loop talks to one ``RolloutBackend``:

- ``generate(prompts, params, *, generator, should_stop)`` -> one Completion per prompt, with the
  sampler's per-token log-probs of the temperature-scaled distribution (what the learner scores);
- ``sync(step)`` after every optimizer step (and after AQN draws new noise): make the backend
  sample from the model as it is now (LoRA weights, noisy norm weights), forgetting any cached
  prefix computed under the old weights;
- ``close()`` at the end of the job.

``rollout.backend``: "native" samples with the trainer's own model (sync has nothing to do, the
sampler reads the live weights): on a GPU through the CUDA-graph engine (engine.rollout.cuda_graph:
static KV cache, fused kernels, the NVFP4 base's one copy shared with training), elsewhere through
the eager sampler (engine.rollout.native); QERL_ROLLOUT_ENGINE=graph or eager picks one for any
device. "vllm" runs an in-process vLLM engine on the same base (engine.rollout.vllm_backend);
"auto" picks vLLM when it is installed, native otherwise.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from engine.rollout.params import Completion, SamplingParams
from engine.spec import RolloutSpec
from engine.types import TrainError


class RolloutBackend(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, generator: torch.Generator | None,
                 should_stop: Callable[[], bool] | None = None) -> list[Completion]: ...

    def sync(self, step: int) -> None: ...

    def close(self) -> None: ...


def native_engine(model: Any) -> str:
    """"graph" (engine.rollout.cuda_graph) for a model on a GPU, "eager" (engine.rollout.native)
    elsewhere, unless QERL_ROLLOUT_ENGINE says graph or eager."""
    choice = os.environ.get("QERL_ROLLOUT_ENGINE", "auto")
    if choice not in ("auto", "graph", "eager"):
        raise ValueError(f"QERL_ROLLOUT_ENGINE must be auto, graph or eager; got {choice!r}")
    if choice == "auto":
        return "graph" if model.device.type == "cuda" else "eager"
    return choice


def native_generate(model: Any, tokenizer: Any, prompts: list[list[int]], params: SamplingParams, *,
                    generator: torch.Generator | None, should_stop: Callable[[], bool] | None = None,
                    max_batch: int = 64, dense_base: bool | None = None) -> list[Completion]:
    """One Completion per prompt from the model's own sampler (``native_engine`` picks which);
    the engines keep the same contract (engine.rollout.batching)."""
    if native_engine(model) == "graph":
        from engine.rollout.cuda_graph import generate as graph_generate

        return graph_generate(model, tokenizer, prompts, params, generator=generator, should_stop=should_stop,
                              max_batch=max_batch)
    from engine.rollout.native import generate

    return generate(model, tokenizer, prompts, params, generator=generator, should_stop=should_stop,
                    max_batch=max_batch, dense_base=dense_base)


class NativeBackend:
    """The trainer's own model and sampler (``native_generate``)."""

    name = "native"

    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int = 64, dense_base: bool | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.dense_base = max_batch, dense_base

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, generator: torch.Generator | None,
                 should_stop: Callable[[], bool] | None = None) -> list[Completion]:
        return native_generate(self.model, self.tokenizer, prompts, params, generator=generator,
                               should_stop=should_stop, max_batch=self.max_batch, dense_base=self.dense_base)

    def sync(self, step: int) -> None:
        """Nothing to push: the sampler runs on the live model."""

    def close(self) -> None:
        pass


def vllm_available() -> bool:
    """vLLM is importable here (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_backend_name(name: str) -> str:
    if name == "auto":
        return "vllm" if vllm_available() else "native"
    if name not in ("native", "vllm"):
        raise ValueError(f"rollout.backend must be one of native, vllm, auto; got {name!r}")
    return name


def make_rollout_backend(spec: RolloutSpec, model: Any, tokenizer: Any, *, workdir: str | Path,
                         max_model_len: int | None = None) -> RolloutBackend:
    """The job's backend. ``workdir`` holds the vLLM backend's files (base checkpoint, adapters);
    ``max_model_len`` (prompt + completion tokens) sizes vLLM's context (default: the model's)."""
    name = resolve_backend_name(spec.backend)
    if name == "vllm":
        if not vllm_available():
            raise TrainError("vllm_unavailable", 'rollout.backend is "vllm" but vLLM is not installed on this '
                                                 'worker; install it (pip install "qerl[vllm]") or set '
                                                 'rollout.backend to "native" or "auto"')
        from engine.rollout.vllm_backend import VLLMBackend

        return VLLMBackend(spec, model, tokenizer, workdir=Path(workdir), max_model_len=max_model_len)
    return NativeBackend(model, tokenizer, max_batch=spec.max_batch)


__all__ = ["RolloutBackend", "NativeBackend", "make_rollout_backend", "native_engine", "native_generate",
           "vllm_available", "resolve_backend_name"]
