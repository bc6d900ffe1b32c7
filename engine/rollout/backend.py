"""The rollout backend interface: where a job's samples come from.

The train loop talks to one ``RolloutBackend``:

- ``generate(prompts, params, *, generator, should_stop)`` -> one Completion per prompt, with the
  sampler's per-token log-probs of the temperature-scaled distribution (what the learner scores);
- ``sync(step)`` after every optimizer step (and after AQN draws new noise): make the backend
  sample from the model as it is now (LoRA weights, noisy norm weights), forgetting any cached
  prefix computed under the old weights;
- ``close()`` at the end of the job.

``rollout.backend``: "native" samples with the trainer's own model (engine.rollout.native; sync
has nothing to do, the sampler reads the live weights); "vllm" runs an in-process vLLM engine on
the same base (engine.rollout.vllm_backend); "auto" picks vLLM when it is installed, native
otherwise.
"""
from __future__ import annotations

import importlib.util
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


class NativeBackend:
    """The trainer's own model and KV-cache sampler."""

    name = "native"

    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int = 64, dense_base: bool | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.dense_base = max_batch, dense_base

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, generator: torch.Generator | None,
                 should_stop: Callable[[], bool] | None = None) -> list[Completion]:
        from engine.rollout.native import generate

        return generate(self.model, self.tokenizer, prompts, params, generator=generator, should_stop=should_stop,
                        max_batch=self.max_batch, dense_base=self.dense_base)

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


__all__ = ["RolloutBackend", "NativeBackend", "make_rollout_backend", "vllm_available", "resolve_backend_name"]
