"""One RL fine-tuning run (QeRL): NVFP4 base + LoRA, GRPO/DAPO updates, AQN exploration.

Each rollout step, for ``prompts_per_step`` prompts x G samples:

 1. AQN: draw fresh channel-wise noise (sigma from the stage schedule over the whole run) on
    the norms feeding q/k/v and gate/up; the sampler sees it, the learner only when
    ``aqn.apply_in_training``.
 2. Rollout with the adapter attached, keeping the sampler's per-token log-probs.
 3. Grade; group advantages (r - mean_G) / (std_G + eps); DAPO's dynamic sampling drops groups
    whose G rewards are equal (if every group drops, no update runs but the step counts).
 4. Reference log-probs (LoRA off, no noise) only when ``rl.kl_coef`` > 0; old log-probs from the
    learner before the update (with ``rl.mu`` == 1 they are the current ones, detached).
 5. ``rl.mu`` optimizer updates, each over micro-batches with gradient accumulation. The loss
    denominator (token count for DAPO's token mean) is taken over the whole rollout batch, so
    micro-batching never changes the gradient. Then grad-norm clip, AdamW, LR schedule.

``should_stop()`` is polled at every step boundary and inside rollouts. A stop saves a
checkpoint of the last step boundary and returns ``stopped=True``; a judge model that stays
unreachable (a model grader) saves one too and raises GraderUnavailable. Checkpoints hold every random
stream and the data position, so a resumed run is bit-identical to an uninterrupted one on CPU.
"""
from __future__ import annotations

import dataclasses
import gc
import random
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from engine import checkpoint as ckpt
from engine import memory_plan
from engine.evaluate import evaluate, examples_problem, grade
from engine.metrics import UpdateStats, peak_memory_mb, report_samples, sample_metrics, sample_rows
from engine.rewards.model_grader import ModelGraderError, judge_tokens
from engine.rl.advantages import group_advantages, keep_groups
from engine.rl.aqn import apply_noise, clear_noise, sigma_for_step
from engine.rl.loss import effective_mask, loss_denominator, policy_loss
from engine.spec import LORA_SHAPE, RolloutSpec, TrainSpec, same_lora_value
from engine.train_batch import DataCursor, RolloutBatch, build_batch, encode_prompts
from engine.types import (OOM_ADVICE, GraderUnavailable, Reporter, TrainError, TrainResult, exception_chain,
                          is_disk_full, is_out_of_memory)


def train(spec: TrainSpec, *, workdir: Path, reporter: Reporter, should_stop: Callable[[], bool],
          resume_from: Path | None = None) -> TrainResult:
    """Run (or resume) the job described by ``spec`` in ``workdir``; see the module docstring."""
    run = None
    try:
        run = _Run(spec, Path(workdir), reporter, should_stop)
        try:
            return run.run(Path(resume_from) if resume_from is not None else None)
        finally:
            run.close()
    except TrainError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            note = run._cap_note() if run is not None else ""
            raise TrainError("out_of_memory", OOM_ADVICE + note) from exc
        if is_disk_full(exc):
            where = next((e.filename for e in exception_chain(exc) if getattr(e, "filename", None)), workdir)
            raise TrainError("disk_full", f"No space left on device while writing {where}. Free space on the "
                                          f"filesystem that holds {workdir} (checkpoints and adapters of old jobs are "
                                          "the usual bulk), then run the job again; the last complete checkpoint "
                                          "is kept.") from exc
        raise


def seed_everything(seed: int, device: torch.device) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("device_unavailable", f"device={name!r} but no CUDA GPU is visible; use \"auto\" or \"cpu\"")
    return device


@dataclasses.dataclass
class _Boundary:
    """What changes during a rollout step before the update: restored on a mid-step stop."""

    rng: dict[str, Any]
    data: dict[str, int]


class _Run:
    def __init__(self, spec: TrainSpec, workdir: Path, reporter: Reporter, should_stop: Callable[[], bool]) -> None:
        self.spec, self.workdir, self.reporter, self.should_stop = spec, workdir, reporter, should_stop
        self.t_start = time.monotonic()
        self.elapsed_before = 0.0  # runtime of earlier attempts (from the checkpoint)
        self.step = 0  # optimizer steps done
        self.trained_tokens = 0
        self.initial_eval: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self.last_eval_step: int | None = None  # the step of the latest evaluation
        self._step_boundary: _Boundary | None = None  # the running step's start, while one is under way
        self._step_samples: list[dict[str, Any]] = []  # the running step's samples, reported with its metrics
        self._saved: tuple[int, Path] | None = None  # the step and path of the latest checkpoint
        self.best_eval: tuple[int, float] | None = None  # final_adapter=best_eval: (step, eval reward) so far
        # early_stop_patience: the best held-out reward so far (the start's included), its step, and
        # the evaluations since that scored no higher
        self.plateau: tuple[float, int, int] | None = None
        self.eval_due: int | None = None  # the step of the latest evaluation begun (eval_interval, the last step)
        self.rollout: Any = None  # engine.rollout.backend.RolloutBackend, from _setup
        self.gpu_memory_cap_gib: float | None = None  # spec.max_gpu_memory_gib once applied to the device
        self._gpu_total = 0  # bytes of that device
        self._capped_device: torch.device | None = None

    def close(self) -> None:
        try:
            if self.rollout is not None:
                self.rollout.close()
                self.rollout = None
        finally:
            self._release_model()
            if self._capped_device is not None:  # the next job in this process gets the whole device
                torch.cuda.set_per_process_memory_fraction(1.0, self._capped_device.index)
                torch.cuda.empty_cache()
                self._capped_device = None

    def _release_model(self) -> None:
        """Let the model, its graph engine and optimizer state go now: the engine refers back to the
        model, so without this a GPU job's memory waits for the garbage collector, and the next job
        in the same process (the embedded worker's) would find it still held."""
        model = getattr(self, "model", None)
        if model is None:
            return
        model.__dict__.pop("_graph_rollout", None)
        self.model = self.optimizer = self.scheduler = self.params = None
        device = getattr(self, "device", None)
        if device is not None and device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def _cap_gpu_memory(self) -> None:
        """spec.max_gpu_memory_gib as the limit of torch's CUDA allocator in this process (until close)."""
        cap, device = self.spec.max_gpu_memory_gib, self.device
        if cap is None:
            return
        if device.type != "cuda":
            self.reporter.event("warn", f"max_gpu_memory_gib={cap:g} does not apply on {device.type}: the job "
                                        "runs without a memory cap", {"max_gpu_memory_gib": cap, "applied": False})
            return
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        total = torch.cuda.get_device_properties(device).total_memory
        if cap * 2**30 > total:
            raise TrainError("invalid_spec", f"max_gpu_memory_gib={cap:g} is more than {device} has "
                                             f"({total / 2**30:.1f} GiB); lower max_gpu_memory_gib to at most the "
                                             "device's memory or leave it unset")
        torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total, device.index)  # wants an index
        self._capped_device, self.gpu_memory_cap_gib, self._gpu_total = device, cap, total

    def _rollout_spec(self) -> RolloutSpec:
        """spec.rollout, where a GPU memory cap applies and the rollouts run on an in-process vLLM
        sized by a share of the whole GPU (rollout.gpu_memory_utilization) with that share fitted to
        the cap: by default GPU_MEMORY_UTILIZATION of the cap instead of the device; a share larger
        than the cap is refused before vLLM starts."""
        from engine.rollout.backend import resolve_backend_name
        from engine.rollout.vllm_engine import GPU_MEMORY_UTILIZATION

        r, cap = self.spec.rollout, self.gpu_memory_cap_gib
        if cap is None or r.kv_cache_memory_bytes is not None or resolve_backend_name(r.backend) != "vllm":
            return r
        share = cap * 2**30 / self._gpu_total
        if r.gpu_memory_utilization is None:
            return dataclasses.replace(r, gpu_memory_utilization=GPU_MEMORY_UTILIZATION * share)
        if r.gpu_memory_utilization > share:
            raise TrainError("invalid_spec", f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} asks vLLM "
                                             f"for {r.gpu_memory_utilization * self._gpu_total / 2**30:.1f} GiB of "
                                             f"{self.device}, more than max_gpu_memory_gib={cap:g}; lower it to at "
                                             f"most {share:.3f} (leaving the trainer room), set "
                                             "rollout.kv_cache_memory_bytes instead, or raise max_gpu_memory_gib")
        return r

    # -- setup ------------------------------------------------------------------------------
    def _setup(self) -> None:
        from engine.data import load_examples
        from engine.data.prompts import training_framing
        from engine.lora import adapter_params
        from engine.model import compute_dtype, load_model
        from engine.optim import build_optimizer, build_scheduler
        from engine.rewards import build_grader
        from engine.rollout import SamplingParams
        from engine.rollout.backend import make_rollout_backend, resolve_backend_name

        spec = self.spec
        self.device = pick_device(spec.device)
        if self.device.type == "cuda":
            # blocks earlier work left cached would take the model's tensors among their free space
            # and stay reserved beside them, and the steps' peak_memory_mb is this job's own
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self._cap_gpu_memory()
        rollout_spec = self._rollout_spec()  # checked before anything is loaded
        planned = (spec.memory_plan and self.device.type == "cuda"
                   and resolve_backend_name(rollout_spec.backend) == "native")
        if planned:
            self._check_fits()
        seed_everything(spec.seed, self.device)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.grader = build_grader(spec.grader)
        except ValueError as exc:
            raise TrainError("invalid_grader", str(exc)) from None
        try:
            train_ex, eval_ex = load_examples(spec.data, spec.seed)
        except TrainError:
            raise
        except (ValueError, FileNotFoundError) as exc:
            raise TrainError("invalid_dataset", str(exc)) from None
        self._check_item_fields(train_ex, eval_ex)
        self.prompt_framing = training_framing(spec.data, train_ex)
        try:
            # bf16 values throughout; held in fp32 on a CPU without a bf16 fast path (compute_dtype)
            self.model, self.tokenizer = load_model(spec.model, quantization=spec.quantization, lora=spec.lora,
                                                    device=self.device, dtype=compute_dtype(self.device),
                                                    source_dtype=torch.bfloat16)
        except (ValueError, FileNotFoundError) as exc:
            raise TrainError("unknown_model", str(exc)) from None
        if spec.init_adapter is not None:
            self._load_init_adapter(Path(spec.init_adapter))
        self.model_dir = getattr(self.model, "model_dir", None) or _model_dir(spec.model)
        if hasattr(self.model, "gradient_checkpointing"):
            self.model.gradient_checkpointing = bool(spec.gradient_checkpointing)
        self.train_prompts = encode_prompts(self.tokenizer, train_ex, spec.data.max_prompt_tokens, "training")
        self.eval_prompts = encode_prompts(self.tokenizer, eval_ex, spec.data.max_prompt_tokens, "eval")
        self.train_items = [ex.item for ex in train_ex]
        self.eval_items = [ex.item for ex in eval_ex]
        if planned:
            self.spec = spec = self._fit_memory()
            rollout_spec = dataclasses.replace(rollout_spec, max_batch=spec.rollout.max_batch)
        if spec.final_adapter == "best_eval" and not self.eval_prompts:
            raise TrainError("invalid_spec", "final_adapter=best_eval keeps the LoRA of the step whose held-out "
                                             "evaluation scored best, and this job holds out no prompts: set "
                                             "data.eval_size above 0 (or a validation_file), and eval_interval to "
                                             "evaluate between the start and the end")
        self.cursor = DataCursor(len(train_ex), spec.seed)
        self.params = adapter_params(self.model)
        self.optimizer = build_optimizer(self.params, spec.optim, self.device)
        self.scheduler = build_scheduler(self.optimizer, spec.optim, spec.steps)
        r = rollout_spec
        self.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                       top_k=r.top_k, stop=list(r.stop),
                                       eos_token_ids=list(getattr(self.model, "eos_token_ids", None) or []))
        # One generator per random stream, so none of them shifts when another draws more or less.
        self.generators = {
            "sampling": torch.Generator(device=_generator_device(self.device)).manual_seed(spec.seed + 1),
            "aqn": torch.Generator(device="cpu").manual_seed(spec.seed + 2),
        }
        self.rollout = make_rollout_backend(r, self.model, self.tokenizer, workdir=self.workdir / "rollout",
                                            max_model_len=spec.data.max_prompt_tokens + r.max_new_tokens)

    def _check_item_fields(self, train_ex: list[Any], eval_ex: list[Any]) -> None:
        """Every row the grader will score has the item fields it reads and what else its graders
        check (a reasoning_gym grader without a task: a task the row names); a row without them
        would end the job at its first rollout, after the model loaded."""
        data = self.spec.data
        if data.dataset is not None:
            parts = [("data.dataset", train_ex + eval_ex)]
        elif data.validation_file is not None:
            parts = [("data.train_file", train_ex), ("data.validation_file", eval_ex)]
        else:
            parts = [("data.train_file", train_ex + eval_ex)]
        for where, examples in parts:
            problem = examples_problem(self.grader, examples, where)
            if problem:
                raise TrainError("invalid_dataset", problem)

    # -- the memory plan (engine.memory_plan): native rollouts on a GPU ----------------------
    def _memory_limit(self) -> int:
        """Bytes this job may hold: what the device has free plus what torch already holds, and
        no more than max_gpu_memory_gib where that is set."""
        free, _ = torch.cuda.mem_get_info(self.device)
        limit = free + torch.cuda.memory_reserved(self.device)
        if self.gpu_memory_cap_gib is not None:
            limit = min(limit, int(self.gpu_memory_cap_gib * 2**30))
        return limit

    def _plan_inputs(self, longest_prompt: int) -> memory_plan.PlanInputs:
        from engine.optim import uses_eight_bit

        spec = self.spec
        try:
            eight_bit = uses_eight_bit(spec.optim, self.device)
        except ValueError as exc:
            raise TrainError("invalid_spec", str(exc)) from None
        return memory_plan.PlanInputs(longest_prompt=longest_prompt,
                                      rollout_rows=spec.prompts_per_step * spec.rollout.num_generations,
                                      eval_rows=len(getattr(self, "eval_prompts", [])), eight_bit=eight_bit)

    def _cap_note(self) -> str:
        cap = self.gpu_memory_cap_gib
        return (f" This job was capped at {cap:g} GiB by max_gpu_memory_gib; raise it if the GPU has room."
                if cap is not None else "")

    def _check_fits(self) -> None:
        """Before the weights load: refuse a job that cannot fit even with one sequence per batch
        and one-token prompts (its base, LoRA state and the KV cache of max_new_tokens alone)."""
        from engine.model import ModelConfig, resolve_model_dir

        try:
            cfg = ModelConfig.from_dir(resolve_model_dir(self.spec.model))
        except (ValueError, FileNotFoundError, OSError):
            return  # load_model names what is wrong with the model
        try:
            memory_plan.fit(cfg, self.spec, self._plan_inputs(1), limit=self._memory_limit())
        except memory_plan.DoesNotFit as exc:
            raise TrainError("out_of_memory", f"Refused before loading the model: {exc}.{self._cap_note()}") from None

    def _fit_memory(self) -> TrainSpec:
        """The spec with the batch sizes the plan fits in this GPU, with what the process holds once
        the model is loaded as measured: what torch keeps reserved after collecting garbage and
        releasing the loading's cached blocks (the cap limits that, and a block pinned by a live
        tensor cannot be released);
        the plan goes out as an event (a warning where it lowered a batch size)."""
        longest = max((len(p) for p in self.train_prompts + self.eval_prompts), default=1)
        gc.collect()  # tensors only unreachable cycles still refer to would count as held
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved(self.device)
        try:
            p = memory_plan.fit(self.model.config, self.spec, self._plan_inputs(longest),
                                limit=self._memory_limit(), base=held)
        except memory_plan.DoesNotFit as exc:
            raise TrainError("out_of_memory", f"Refused before the first step: {exc}.{self._cap_note()}") from None
        level = "warn" if p.notes else "info"
        note = f" ({'; '.join(p.notes)})" if p.notes else ""
        self.reporter.event(level, f"Memory plan: {p.describe()}; rollouts decode {p.rollout_batch} sequences at a "
                                   f"time, the learner takes {p.micro_batch} per micro-batch{note}",
                            {"memory_plan_gib": p.as_dict()})
        return memory_plan.with_batches(self.spec, p)

    def _load_init_adapter(self, path: Path) -> None:
        """The LoRA to start from (a resumed run then loads its checkpoint's over it)."""
        from engine.lora import load_peft_adapter, peft_lora_spec

        try:
            theirs = peft_lora_spec(path)
        except (FileNotFoundError, KeyError, ValueError) as exc:
            raise TrainError("invalid_spec", f"init_adapter {path} is not a PEFT LoRA directory: {exc}") from None
        ours = self.spec.lora
        for name in LORA_SHAPE:
            a, b = getattr(theirs, name), getattr(ours, name)
            if not same_lora_value(name, a, b):
                raise TrainError("invalid_spec", f"init_adapter was trained with lora.{name}={a!r}, this job asks "
                                                 f"for {b!r}; set lora.{name} to {a!r} (or leave lora unset)")
        try:
            load_peft_adapter(self.model, path)
        except (FileNotFoundError, ValueError) as exc:
            raise TrainError("invalid_spec", f"init_adapter {path} does not fit {self.spec.model}: {exc}") from None
        self.reporter.event("info", f"Starting from the LoRA in {path.name}/ (r={ours.r})", {"init_adapter": str(path)})

    def _restore(self, path: Path) -> None:
        from engine.lora import load_adapter_state_dict

        try:
            saved = ckpt.load_checkpoint(path)
        except (FileNotFoundError, KeyError, ValueError) as exc:
            raise TrainError("invalid_checkpoint", f"cannot resume from {path}: {exc}") from None
        now, then = _jsonable(self.spec), saved.spec
        for part in (now, then):  # file paths may move between attempts; the row count is checked
            for key in ("train_file", "validation_file"):
                part.get("data", {}).pop(key, None)
        for key in ("model", "quantization", "lora", "seed", "steps", "data"):
            if then.get(key) != now.get(key):
                raise TrainError("invalid_checkpoint", f"the checkpoint at {saved.path} was made with a different "
                                                       f"{key}; resume with the spec it was started with")
        load_adapter_state_dict(self.model, saved.adapter)
        self.optimizer.load_state_dict(saved.optimizer)
        self.scheduler.load_state_dict(saved.scheduler)
        ckpt.restore_rng(saved.rng, self.generators)
        self.cursor.load(saved.state["data"])
        self.step = saved.step
        self.trained_tokens = int(saved.state.get("trained_tokens", 0))
        self.elapsed_before = float(saved.state.get("elapsed_s", 0.0))
        self.initial_eval = dict(saved.state.get("initial_eval", {}))
        self.last_metrics = dict(saved.state.get("metrics", {}))
        best = saved.state.get("best_eval")
        self.best_eval = (int(best[0]), float(best[1])) if best else None
        plateau = saved.state.get("plateau")
        self.plateau = (float(plateau[0]), int(plateau[1]), int(plateau[2])) if plateau else None
        self.eval_due = saved.state.get("eval_due")
        self.reporter.event("info", f"Resumed from checkpoint step {self.step}",
                            {"step": self.step, "checkpoint": str(saved.path)})

    # -- main loop --------------------------------------------------------------------------
    def run(self, resume_from: Path | None) -> TrainResult:
        spec = self.spec
        self._setup()
        if resume_from is not None:
            self._restore(resume_from)
        else:
            cap = self.gpu_memory_cap_gib
            cap_note = f", memory capped at {cap:g} GiB (max_gpu_memory_gib)" if cap is not None else ""
            self.reporter.event("info", f"Training {spec.model} ({spec.quantization} base, LoRA r={spec.lora.r}, "
                                        f"{spec.rl.algorithm}, AQN {'on' if spec.aqn.enabled else 'off'}) for "
                                        f"{spec.steps} steps on {self.device.type}{cap_note}{_dtype_note(self.model)}",
                                {"steps": spec.steps, "device": str(self.device), "rollout_backend": self.rollout.name,
                                 **({"max_gpu_memory_gib": cap} if cap is not None else {}),
                                 "compute_dtype": str(self.model.dtype).removeprefix("torch."),
                                 "train_prompts": len(self.train_prompts), "eval_prompts": len(self.eval_prompts)})
        try:
            return self._loop()
        except ModelGraderError as exc:
            if exc.kind != "server":  # a refusal or an unreadable reply: the grader's setup, not an outage
                raise
            clear_noise(self.model.aqn_norms())
            if self._saved is not None and self._saved[0] == self.step:  # the step's checkpoint is this boundary
                path = self._saved[1]
            else:
                path = self._save(self._step_boundary or self._boundary())  # mid-step: the step's start
            raise GraderUnavailable(f"{exc}. The run stopped at step {self.step}/{spec.steps} with a checkpoint "
                                    f"({path.name}); resume it once the judge answers again", path) from None

    def _loop(self) -> TrainResult:
        spec = self.spec
        if self.step == 0 and not self.initial_eval:
            result = self._evaluate()
            if result is None:
                return self._stop(self._boundary())
            self.initial_eval = result
        elif self._eval_cut_short():  # redo it
            if self._evaluate() is None:
                return self._stop(self._boundary())
            if self.step < spec.steps and self._plateaued():
                return self._finish(early=True)

        while self.step < spec.steps:
            boundary = self._step_boundary = self._boundary()
            if self.should_stop():
                return self._stop(boundary)
            if spec.max_runtime_s is not None and self._elapsed() > spec.max_runtime_s:
                path = self._save(boundary)
                raise TrainError("max_runtime_exceeded",
                                 f"the run took longer than max_runtime_s={spec.max_runtime_s:g} s at step "
                                 f"{self.step}/{spec.steps}; checkpoint saved at {path}; raise max_runtime_s "
                                 f"or lower steps, then resume")
            before = self.step
            metrics = self._rollout_step()
            if metrics is None:  # stopped inside the rollout
                return self._stop(boundary)
            self._step_boundary = None
            self.last_metrics = metrics
            self.reporter.metrics(self.step, metrics)
            report_samples(self.reporter, self.step, "train", self._step_samples)
            last_checkpoint = self.step >= spec.steps and _crossed(before, self.step, spec.checkpoint_interval)
            if (_crossed(before, self.step, spec.eval_interval) and self.step < spec.steps) or last_checkpoint:
                self.eval_due = self.step
                self._evaluate()  # the final evaluation before the last checkpoint, which then carries its scores
            if self.step < spec.steps and self.last_eval_step == self.step and self._plateaued():
                return self._finish(early=True)
            if _crossed(before, self.step, spec.checkpoint_interval):
                self._save(self._boundary())
        return self._finish()

    def _rollout_step(self) -> dict[str, float] | None:
        spec, G = self.spec, self.spec.rollout.num_generations
        t0 = time.monotonic()
        n_updates = min(spec.rl.mu, spec.steps - self.step)
        norms = self.model.aqn_norms()
        sigma = sigma_for_step(self.step, spec.steps, spec.aqn)
        apply_noise(norms, sigma, self.generators["aqn"])
        noise = [n.noise for n in norms]
        self.rollout.sync(self.step)  # the sampler gets the LoRA of the last update and this step's noise

        idx = self.cursor.take(spec.prompts_per_step)
        prompts = [self.train_prompts[i] for i in idx for _ in range(G)]  # prompt-major: N x G
        items = [self.train_items[i] for i in idx for _ in range(G)]
        self.model.eval()
        t_gen = time.monotonic()
        with torch.no_grad():
            completions = self.rollout.generate(prompts, self.sampling, generator=self.generators["sampling"],
                                                should_stop=self.should_stop)
        gen_s = time.monotonic() - t_gen
        if any(c.finish_reason == "cancelled" for c in completions):
            clear_noise(norms)
            return None

        t_grade, tokens_before = time.monotonic(), judge_tokens(self.grader)
        scores, parts, correct = grade(self.grader, completions, items)
        grade_s = time.monotonic() - t_grade
        judge_used = judge_tokens(self.grader) - tokens_before
        self._step_samples = sample_rows(self.tokenizer, prompts, completions, scores, parts, spec.log_samples)
        rewards = torch.tensor(scores, dtype=torch.float32)  # (N*G,)
        adv, zero_var = group_advantages(rewards, G, std_normalize=spec.rl.std_normalize, eps=spec.rl.adv_eps)
        keep = keep_groups(zero_var, G, spec.rl)  # (N*G,) bool
        n_tokens = sum(len(c.token_ids) for c in completions)

        metrics = sample_metrics(scores, parts, correct, [len(c.token_ids) for c in completions],
                                 [c.finish_reason == "length" for c in completions])
        metrics.update(zero_var_frac=float(zero_var.float().mean()), aqn_sigma=sigma,
                       rollout_tokens_per_s=n_tokens / max(gen_s, 1e-9), rollout_s=gen_s, grade_s=grade_s)
        if judge_used:
            metrics["judge_tokens"] = float(judge_used)

        clear_noise(norms)
        rows = keep.nonzero().flatten().tolist()
        if rows:
            batch = build_batch([completions[i] for i in rows], adv[rows], pad_id=_pad_id(self.tokenizer),
                                device=self.device)
            metrics.update(self._train_on(batch, norms, noise, n_updates))
        else:
            metrics["updates_skipped"] = 1.0
            for _ in range(n_updates):  # the step counts: keep the LR schedule on the step count
                _scheduler_step(self.scheduler)
        clear_noise(norms)
        self.step += n_updates
        metrics.setdefault("updates_skipped", 0.0)
        metrics.update(step_s=time.monotonic() - t0, peak_memory_mb=peak_memory_mb(self.device),
                       trained_tokens=float(self.trained_tokens))
        return metrics

    def _train_on(self, batch: RolloutBatch, norms: list, noise: list, n_updates: int) -> dict[str, float]:
        with _dense_base(self.model, enabled=self.device.type == "cpu"):
            return self._train_on_batch(batch, norms, noise, n_updates)

    def _train_on_batch(self, batch: RolloutBatch, norms: list, noise: list, n_updates: int) -> dict[str, float]:
        from engine.lora import held_pieces, lora_disabled
        from engine.optim import clip_grad_norm

        spec = self.spec
        mbs = batch.split(spec.micro_batch_size)
        denom = loss_denominator(batch.loss_mask, spec.rl, truncated=batch.truncated,
                                 max_len=spec.rollout.max_new_tokens)
        self.model.eval()
        with torch.no_grad():
            if spec.rl.kl_coef > 0:  # reference policy: the base alone, no noise
                with lora_disabled(self.model):
                    for mb in mbs:
                        mb.ref_logp = self._logprobs(mb)[0]
            if spec.aqn.apply_in_training:
                _set_noise(norms, noise)
            if spec.rl.mu > 1:
                with held_pieces(self.model):
                    for mb in mbs:
                        mb.old_logp = self._logprobs(mb)[0]
        self.model.train()
        out: dict[str, float] = {}
        for _ in range(n_updates):
            self.optimizer.zero_grad(set_to_none=True)
            acc = UpdateStats()
            with held_pieces(self.model):  # the adapter changes only at the optimizer step
                for mb in mbs:
                    logp, entropy = self._logprobs(mb)  # (b, t-1) each, fp32
                    old = mb.old_logp if mb.old_logp is not None else logp.detach()
                    loss, stats = policy_loss(logp, old, mb.advantages, mb.loss_mask, spec.rl,
                                              sampler_logp=mb.sampler_logp, ref_logp=mb.ref_logp,
                                              truncated=mb.truncated, denominator=denom,
                                              max_len=spec.rollout.max_new_tokens)
                    loss.backward()
                    acc.add(stats, effective_mask(mb.loss_mask, spec.rl, mb.truncated), entropy.detach(),
                            old.detach(), mb.sampler_logp)
            lr = float(self.optimizer.param_groups[0]["lr"])
            grad_norm = clip_grad_norm(self.params, spec.optim.grad_clip)
            self.optimizer.step()
            _scheduler_step(self.scheduler)
            out = acc.result()
            out.update(grad_norm=grad_norm, lr=lr)
        self.optimizer.zero_grad(set_to_none=True)
        self.trained_tokens += int(out.get("tokens", 0.0))
        out.pop("tokens", None)
        out["kl"] = out["kl_ref"] if spec.rl.kl_coef > 0 else out["kl_sampler"]
        return out

    def _logprobs(self, mb: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = self.model.token_logprobs(mb.input_ids, mb.attention_mask, from_position=mb.first_col,
                                                  temperature=self.spec.rollout.temperature)  # (b, t-1) each
        return logp.float(), entropy.float()

    # -- evaluation, checkpoints, the end -------------------------------------------------------
    def _evaluate(self) -> dict[str, float] | None:
        if not self.eval_prompts:
            return {}
        t0 = time.monotonic()
        rows: list[dict[str, Any]] = []
        result = evaluate(self.model, self.tokenizer, self.eval_prompts, self.eval_items, self.grader,
                          self.sampling, max_batch=self.spec.rollout.max_batch, should_stop=self.should_stop,
                          samples=rows, keep=self.spec.log_samples)
        if result is None:
            return None
        result["eval/seconds"] = time.monotonic() - t0
        self.reporter.metrics(self.step, result)
        report_samples(self.reporter, self.step, "eval", rows)
        self.reporter.event("info", f"Evaluation at step {self.step}: reward {result['eval/reward_mean']:.3f}, "
                                    f"accuracy {result['eval/accuracy']:.3f} on {len(self.eval_prompts)} prompts",
                            {"step": self.step, **result})
        self.last_eval, self.last_eval_step = result, self.step
        if self.spec.final_adapter == "best_eval" and (self.best_eval is None
                                                       or result["eval/reward_mean"] >= self.best_eval[1]):
            self._write_adapter(self._best_dir(self.step), stopped=False)  # this step's LoRA, kept until the end
            self.best_eval = (self.step, float(result["eval/reward_mean"]))
        score = float(result["eval/reward_mean"])
        if self.plateau is None or score > self.plateau[0]:
            self.plateau = (score, self.step, 0)
        else:
            self.plateau = (self.plateau[0], self.plateau[1], self.plateau[2] + 1)
        return result

    def _eval_cut_short(self) -> bool:
        """This step's evaluation was begun and a stop cut it short."""
        return self.eval_due == self.step and self.last_eval_step != self.step

    def _plateaued(self) -> bool:
        """early_stop_patience evaluations in a row without a higher held-out reward: say so, and end."""
        patience = self.spec.early_stop_patience
        if not patience or self.plateau is None or self.plateau[2] < patience:
            return False
        best, step, since = self.plateau
        evals = "1 evaluation" if since == 1 else f"{since} evaluations"
        self.reporter.event("info", f"Stopping early at step {self.step}/{self.spec.steps}: {evals} since step "
                                    f"{step} scored no higher than its held-out reward {best:.3f} "
                                    f"(early_stop_patience={patience})",
                            {"step": self.step, "best_step": step, "best_eval_reward": best})
        return True

    def _best_dir(self, step: int) -> Path:
        return self.workdir / "best-adapters" / f"step-{step:06d}"

    def _boundary(self) -> _Boundary:
        return _Boundary(rng=ckpt.capture_rng(self.generators), data=self.cursor.state())

    def _elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.t_start

    def _save(self, boundary: _Boundary) -> Path:
        from engine.lora import adapter_state_dict

        state = {"data": boundary.data, "trained_tokens": self.trained_tokens, "elapsed_s": self._elapsed(),
                 "initial_eval": self.initial_eval, "metrics": self.last_metrics,
                 "aqn": {"sigma_next": sigma_for_step(self.step, self.spec.steps, self.spec.aqn)},
                 "best_eval": list(self.best_eval) if self.best_eval is not None else None,
                 "plateau": list(self.plateau) if self.plateau is not None else None,
                 # a step whose evaluation a stop cut short: the resumed run evaluates it first
                 "eval_due": self.step if self._eval_cut_short() else None}
        partial = self.step < self.spec.steps
        path = ckpt.save_checkpoint(self.workdir / "checkpoints", self.step, adapter=adapter_state_dict(self.model),
                                    optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
                                    rng=boundary.rng, state=state, spec=_jsonable(self.spec), keep=2,
                                    extra=lambda d: self._write_adapter(d / "adapter", stopped=partial))
        if self.spec.keep_checkpoint_adapters:
            ckpt.keep_adapter(path, self.workdir / "checkpoint-adapters")
        metrics = dict(self.last_metrics)
        if self.last_eval_step == self.step:  # evaluated at this step: the checkpoint says how it scored
            metrics.update(self.last_eval)
        self.reporter.checkpoint(self.step, path, metrics)
        self.reporter.event("info", f"Checkpoint saved at step {self.step}", {"step": self.step, "path": str(path)})
        self._saved = (self.step, path)
        return path

    def _final_metrics(self) -> dict[str, float]:
        final = dict(self.last_metrics)
        final.update(getattr(self, "last_eval", {}) or {})
        final.update({f"eval_initial/{k.split('/', 1)[1]}": v for k, v in self.initial_eval.items()
                      if k.startswith("eval/")})
        return final

    def _stop(self, boundary: _Boundary) -> TrainResult:
        path = self._save(boundary)
        adapter = self._write_adapter(stopped=True)
        self.reporter.event("info", f"Stopped at step {self.step}/{self.spec.steps}; checkpoint {path.name}",
                            {"step": self.step, "checkpoint": str(path)})
        return TrainResult(adapter_dir=adapter, steps=self.step, metrics=self._final_metrics(), stopped=True)

    def _finish(self, *, early: bool = False) -> TrainResult:
        result = self.last_eval if self.last_eval_step == self.step else self._evaluate()
        if result is None:
            return self._stop(self._boundary())
        if self.spec.final_adapter == "best_eval":
            adapter, final = self._take_best()
        else:
            adapter, final = self._write_adapter(stopped=False), self._final_metrics()
        of = f" of {self.spec.steps} (stopped early)" if early else ""
        self.reporter.event("info", f"Training finished: {self.step} steps{of} in {self._elapsed():.0f} s; "
                                    f"{self._eval_summary(final)}",
                            {"steps": self.step, "adapter_dir": str(adapter), "early_stop": early, **final})
        return TrainResult(adapter_dir=adapter, steps=self.step, metrics=final, stopped=False)

    def _eval_summary(self, final: dict[str, float]) -> str:
        """How the held-out prompts scored at the start and at the end, or that none were held out."""
        if "eval/accuracy" not in final:
            return "no held-out evaluation (data.eval_size is 0 and there is no validation_file)"
        start = self.initial_eval.get("eval/accuracy")
        before = f"{start:.3f} -> " if start is not None else ""
        return f"held-out accuracy {before}{final['eval/accuracy']:.3f}"

    def _take_best(self) -> tuple[Path, dict[str, float]]:
        """final_adapter=best_eval: the job's adapter (``<workdir>/adapter``, replaced whole) is the
        best evaluated step's LoRA, the final metrics that step's; the last step's when it is the best."""
        import json
        import shutil

        from engine.manifest import MANIFEST

        step, score = self.best_eval or (self.step, float("nan"))
        best = self._best_dir(step)
        if step != self.step and not best.is_dir():  # lost with a workdir the run could not keep
            self.reporter.event("warn", f"The LoRA of step {step}, the best evaluated, is gone; the job's adapter "
                                        f"is the last step's", {"step": step})
            step = self.step
        if step == self.step:
            adapter, final = self._write_adapter(stopped=False), self._final_metrics()
        else:
            adapter = self.workdir / "adapter"
            tmp = adapter.parent / f".tmp-{adapter.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(best, tmp)
            shutil.rmtree(adapter, ignore_errors=True)
            tmp.rename(adapter)
            final = dict(json.loads((adapter / MANIFEST).read_text())["metrics"])
        shutil.rmtree(self.workdir / "best-adapters", ignore_errors=True)
        final["final_adapter_step"] = float(step)
        last = self.last_eval.get("eval/reward_mean", float("nan"))
        self.reporter.event("info", f"The job's adapter is the LoRA of step {step}: the best held-out reward, "
                                    f"{score:.3f}; the last step's was {last:.3f}",
                            {"final_adapter_step": step, "eval/reward_mean": score})
        return adapter, final

    def _write_adapter(self, out_dir: Path | None = None, *, stopped: bool) -> Path:
        """The PEFT adapter of the LoRA as it is now (the job's result, or a checkpoint's copy)."""
        from engine.manifest import write_adapter

        return write_adapter(self.model, out_dir or self.workdir / "adapter", spec=self.spec, steps=self.step,
                             metrics=self._final_metrics(), model_dir=self.model_dir, stopped=stopped,
                             prompt_framing=self.prompt_framing)


def _dtype_note(model: Any) -> str:
    """The start message's note when a CPU job computes in fp32 (engine.model.compute_dtype)."""
    if model.dtype == torch.float32 and model.device.type == "cpu":
        return " (bf16 weights computed in fp32: this CPU has no fast bf16 matmul)"
    return ""


@contextmanager
def _dense_base(model: Any, *, enabled: bool) -> Iterator[None]:
    """Serve every quantized projection from one dense copy for the whole update (forward,
    checkpoint recompute and backward), as engine.rollout.dense does for rollouts: the same
    dequantize and matmul, so the numbers are identical, but dequantized once per rollout step
    instead of three times per micro-batch. On CPU only: GPUs read the 4-bit weights directly."""
    from engine.quant.base import FrozenLinear

    layers = [m for m in model.modules() if isinstance(m, FrozenLinear) and m.fmt != "bf16"] if enabled else []
    try:
        for layer in layers:
            w = layer.dequantize(model.dtype)  # (out, in)
            # instance attributes shadow the class's methods until removed
            layer._matmul = partial(_dense_matmul, w)
            layer._matmul_t = partial(_dense_matmul_t, w)
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("_matmul", None)
            layer.__dict__.pop("_matmul_t", None)


def _dense_matmul(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
    return torch.matmul(x, w.to(x.dtype).t())


def _dense_matmul_t(w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:  # (..., out) -> (..., in)
    return torch.matmul(dy, w.to(dy.dtype))


def _crossed(before: int, after: int, interval: int) -> bool:
    return interval > 0 and after // interval > before // interval


def _scheduler_step(scheduler: Any) -> None:
    import warnings

    with warnings.catch_warnings():  # a skipped update steps the schedule without optimizer.step()
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def _set_noise(norms: list, noise: list) -> None:
    for norm, z in zip(norms, noise):
        norm.noise = z


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return int(pad) if pad is not None else 0


def _generator_device(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else str(device)


def _model_dir(name: str) -> Path | None:
    """The local directory holding the base weights (for the manifest's hashes)."""
    p = Path(name)
    if p.is_dir():
        return p
    try:
        from engine.model.load import resolve_model_dir

        return Path(resolve_model_dir(name))
    except Exception:  # noqa: BLE001 - a Hub id without a local copy: the manifest names it only
        return None


def _jsonable(value: Any) -> Any:
    import json

    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


__all__ = ["train", "seed_everything", "pick_device"]
