"""Rollouts in an in-process vLLM engine on the job's base, LoRA synced after every step (QeRL).

Setup: ``vllm.LLM`` (engine.rollout.vllm_engine) on engine.rollout.vllm_base's checkpoint (NVFP4
compressed-tensors on a GPU, the dequantized base on CPU), LoRA enabled at the job's rank.

``sync(step)``: the current adapter is written as a PEFT directory and registered under a new
LoRARequest id (vLLM caches adapters by id), the previous one is removed from the engine and
from disk; the norm weights feeding q/k/v and gate/up (where AQN puts its noise) are copied into
vLLM's model in place; the prefix cache is reset, since cached KV blocks were computed under the
old weights.

Sampling maps one to one (max_tokens, temperature, top_p, top_k, stop strings kept in the text,
eos ids). Seeds: each request gets its own seed, drawn from the job's sampling generator, so a
rollout depends only on the generator's state (resumable, independent of batching). Log-probs:
``logprobs=0`` returns the sampled token's; vLLM's ``logprobs_mode`` picks which distribution.
The learner scores log softmax(logits / T) without top-k/top-p truncation (T = 1 when greedy).
"processed_logprobs" is log softmax after temperature and after top-k/top-p masking, so it is
that distribution exactly when no truncation is on; "raw_logprobs" is log softmax(logits), which
is it when T = 1 or greedy. The mode is chosen per job accordingly; with truncation on and
T != 1 no mode gives the untruncated value, and the sampler's log-prob is that of the truncated,
renormalised distribution it really sampled from.

Precision: vLLM keeps norm weights, LoRA weights and the LoRA branch in the model dtype (bf16);
the trainer keeps the LoRA and AQN noise in fp32. The noisy norm weight w + z therefore reaches
vLLM rounded to bf16 (noise below ~4e-3 of w is partly rounded away there). The sampler's
log-probs come from the weights vLLM really used, so the importance-sampling correction stays
exact.
"""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from engine.rollout.params import Completion, SamplingParams
from engine.rollout.vllm_engine import shutdown_engine, start_engine
from engine.spec import RolloutSpec

_open: list["VLLMBackend"] = []  # in-process engines share vLLM's global parallel state: one at a time


class VLLMBackend:
    name = "vllm"

    def __init__(self, spec: RolloutSpec, model: Any, tokenizer: Any, *, workdir: Path,
                 max_model_len: int | None = None) -> None:
        from engine.lora import lora_modules
        from engine.rollout.vllm_base import write_vllm_base

        if _open:
            raise RuntimeError("a vLLM rollout engine is already open in this process; close() it first")
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.dir = Path(workdir) / "vllm"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.base_dir = write_vllm_base(model, self.dir / "base")
        self.lora_spec = getattr(model, "lora_spec", None) if lora_modules(model) else None
        self.llm = start_engine(self.base_dir, spec, model, self.lora_spec, max_model_len)
        _open.append(self)
        self.lora_request: Any = None
        self._ids = itertools.count(1)
        self._requests = itertools.count()

    # -- weights ----------------------------------------------------------------------------
    def sync(self, step: int) -> None:
        """Push the current LoRA and (noisy) norm weights; drop KV blocks cached under old ones."""
        self.llm.apply_model(_NormCopy(_norm_weights(self.model)))
        if self.lora_spec is not None:
            self._push_lora(step)
        self.llm.reset_prefix_cache()

    def _push_lora(self, step: int) -> None:
        from vllm.lora.request import LoRARequest

        from engine.lora import save_peft_adapter

        lora_id = next(self._ids)
        path = save_peft_adapter(self.model, self.dir / f"lora-{lora_id}", base_model_name_or_path=str(self.base_dir))
        request = LoRARequest(lora_name=f"qerl-step{step}-{lora_id}", lora_int_id=lora_id, lora_path=str(path))
        self.llm.llm_engine.add_lora(request)
        old, self.lora_request = self.lora_request, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    # -- sampling ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, generator: torch.Generator | None,
                 should_stop: Callable[[], bool] | None = None) -> list[Completion]:
        """One Completion per prompt, in order; on ``should_stop()`` unfinished ones end "cancelled"."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if self.lora_spec is not None and self.lora_request is None:
            self.sync(0)
        engine = self.llm.llm_engine
        stop = should_stop or (lambda: False)
        seeds = _seeds(len(prompts), generator)
        ids = {}
        for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
            rid = f"qerl-{next(self._requests)}"
            ids[rid] = i
            engine.add_request(rid, {"prompt_token_ids": list(prompt)}, self._vllm_params(params, seed),
                               lora_request=self.lora_request)
        toks: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * len(prompts)
        while engine.has_unfinished_requests():
            if stop():
                engine.abort_request([r for r, i in ids.items() if finish[i] is None])
                break
            for out in engine.step():
                i = ids[out.request_id]
                o = out.outputs[0]  # DELTA: the tokens of this step
                toks[i].extend(o.token_ids)
                lps[i].extend(_sampled_logprobs(o))
                if out.finished:
                    finish[i] = "length" if o.finish_reason == "length" else "stop"
        return [self._completion(p, t, l, f or "cancelled", params) for p, t, l, f in zip(prompts, toks, lps, finish)]

    def _vllm_params(self, params: SamplingParams, seed: int | None) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        eos = params.eos_token_ids or list(getattr(self.model, "eos_token_ids", None) or [])
        return VSamplingParams(n=1, max_tokens=params.max_new_tokens, temperature=params.temperature,
                               top_p=params.top_p, top_k=params.top_k, stop=list(params.stop) or None,
                               stop_token_ids=eos or None, include_stop_str_in_output=True, seed=seed, logprobs=0,
                               output_kind=RequestOutputKind.DELTA, skip_special_tokens=True)

    def _completion(self, prompt: list[int], toks: list[int], lps: list[float], finish: str,
                    params: SamplingParams) -> Completion:
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        ends = [text.find(s) + len(s) for s in params.stop if s in text]
        if ends and finish == "stop":
            text = text[:min(ends)]  # as the native sampler: cut right after the first stop string
        return Completion(list(prompt), list(toks), torch.tensor(lps, dtype=torch.float32), finish, text)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown_engine(llm)
        if self in _open:
            _open.remove(self)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- helpers ------------------------------------------------------------------------------------
class _NormCopy:
    """Runs inside vLLM's worker (apply_model): copy norm weights into its model in place."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def __call__(self, vmodel: torch.nn.Module) -> int:
        params = dict(vmodel.named_parameters())
        with torch.no_grad():
            for name, w in self.weights.items():
                p = params.get(name)
                if p is None:
                    raise ValueError(f"vLLM's model has no parameter {name}; cannot sync AQN noise")
                p.copy_(w.to(device=p.device, dtype=p.dtype))
        return len(self.weights)


def _norm_weights(model: Any) -> dict[str, torch.Tensor]:
    """HF name -> weight + AQN noise (fp32 sum; vLLM rounds it to its dtype) of every AQN norm."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for norm in model.aqn_norms():
        w = norm.weight.detach().float()
        out[f"{names[id(norm)]}.weight"] = w + norm.noise if norm.noise is not None else w
    return out


def _seeds(n: int, generator: torch.Generator | None) -> list[int | None]:
    if generator is None:
        return [None] * n
    return torch.randint(0, 2**62, (n,), generator=generator, device=generator.device).tolist()


def _sampled_logprobs(o: Any) -> list[float]:
    if o.logprobs is None:
        raise RuntimeError("vLLM returned no log-probs although logprobs=0 was requested")
    return [float(step[t].logprob) for t, step in zip(o.token_ids, o.logprobs)]
