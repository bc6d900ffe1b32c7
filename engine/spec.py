"""TrainSpec: everything one RL fine-tuning job needs, as plain typed records.

Pure Python (no torch) so the service can validate a job body before queueing it.
Every record rejects inconsistent settings in ``__post_init__`` with a ValueError whose
text names the field and the fix. ``TrainSpec.from_dict`` rejects unknown keys.

Defaults follow the QeRL recipe (RESEARCH.md): NVFP4 base, LoRA alpha = r on all seven
projections, DAPO token-level loss with eps_low 0.2 / eps_high 0.28, no KL, advantage
(r - mean) / (std + 1e-4), AdamW (0.9, 0.99) wd 0.1, 10% warmup, cosine, grad clip 0.2,
AQN over 10 stages from 1e-2 to 5e-4 with stage 0 noise-free.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

QUANTIZATIONS = ("nvfp4", "nf4", "bf16")
ALGORITHMS = ("grpo", "dapo", "dr_grpo")
ROLLOUT_BACKENDS = ("native", "vllm", "auto")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_SHAPE = ("r", "alpha", "target_modules", "use_rslora")  # what a LoRA trained further keeps (not dropout)


def same_lora_value(name: str, a: Any, b: Any) -> bool:
    """Whether two values of LoraSpec field ``name`` describe the same LoRA (target_modules in any order)."""
    if name == "target_modules" and isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return sorted(a) == sorted(b)
    return a == b


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}]; got {value!r}")
    if (value <= lo if lo_open else value < lo) or value > hi:
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}]; got {value!r}")


FINAL_ADAPTERS = ("last", "best_eval")
EVAL_SIZE = 32  # held-out prompts when a job sets none and its data has at least 4 x as many


def default_eval_size(prompts: int) -> int:
    """Held-out prompts for data of ``prompts`` distinct questions when a job sets none: 32, or a
    quarter of fewer than 128, so that a small set keeps most of its questions for training."""
    return min(EVAL_SIZE, prompts // 4)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class LoraSpec:
    r: int = 16
    alpha: float | None = None  # None: alpha = r (QeRL)
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    use_rslora: bool = False

    def __post_init__(self) -> None:
        _check_range("lora.r", self.r, 1, 1024)
        if int(self.r) != self.r:
            raise ValueError(f"lora.r must be an integer; got {self.r!r}")
        self.r = int(self.r)
        if self.alpha is None:
            self.alpha = float(self.r)
        _check_range("lora.alpha", self.alpha, 0, 1e4, lo_open=True)
        _check_range("lora.dropout", self.dropout, 0.0, 0.9)
        if not self.target_modules:
            raise ValueError(f"lora.target_modules must name at least one of {', '.join(LORA_TARGETS)}")
        for m in self.target_modules:
            _check_choice("lora.target_modules[]", m, LORA_TARGETS)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


@dataclass
class AQNSpec:
    enabled: bool = True
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    stages: int = 10  # K; stage 0 has sigma 0
    apply_in_training: bool = False

    def __post_init__(self) -> None:
        _check_range("aqn.sigma_start", self.sigma_start, 0.0, 1.0, lo_open=True)
        _check_range("aqn.sigma_end", self.sigma_end, 0.0, 1.0, lo_open=True)
        _check_range("aqn.stages", self.stages, 2, 1000)
        self.stages = int(self.stages)


@dataclass
class RolloutSpec:
    backend: str = "native"
    num_generations: int = 4  # G samples per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[str] = field(default_factory=list)
    max_batch: int = 64  # sequences decoded together; larger rollouts go in sub-batches
    gpu_memory_utilization: float | None = None  # vllm backend only
    kv_cache_memory_bytes: int | None = None  # vllm backend only

    def __post_init__(self) -> None:
        _check_choice("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        _check_range("rollout.num_generations", self.num_generations, 2, 256)
        _check_range("rollout.max_new_tokens", self.max_new_tokens, 1, 32768)
        _check_range("rollout.temperature", self.temperature, 0.0, 10.0)
        _check_range("rollout.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_range("rollout.top_k", self.top_k, 0, 1_000_000)
        _check_range("rollout.max_batch", self.max_batch, 1, 4096)
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("rollout.stop must be a list of at most 16 non-empty strings")
        if self.gpu_memory_utilization is not None:
            _check_range("rollout.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)


@dataclass
class RLSpec:
    """Loss settings. algorithm picks defaults; named fields override them."""

    algorithm: str = "dapo"  # grpo | dapo | dr_grpo
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.0  # > 0: KL to the reference policy (LoRA disabled)
    mu: int = 1  # optimizer updates per rollout batch
    adv_eps: float = 1e-4
    std_normalize: bool | None = None  # None: False for dr_grpo, True otherwise
    dynamic_sampling: bool | None = None  # drop zero-variance groups; None: True for dapo
    mask_truncated: bool = True
    tis_cap: float = 2.0  # truncated importance sampling: min(pi_learner / pi_sampler, cap); 0 disables
    loss_agg: str | None = None  # token_mean | seq_mean | seq_sum_norm; None: from algorithm

    def __post_init__(self) -> None:
        _check_choice("rl.algorithm", self.algorithm, ALGORITHMS)
        _check_range("rl.eps_low", self.eps_low, 0.0, 1.0)
        _check_range("rl.eps_high", self.eps_high, 0.0, 10.0)
        _check_range("rl.kl_coef", self.kl_coef, 0.0, 10.0)
        _check_range("rl.mu", self.mu, 1, 16)
        _check_range("rl.adv_eps", self.adv_eps, 0.0, 1.0, lo_open=True)
        _check_range("rl.tis_cap", self.tis_cap, 0.0, 100.0)
        if self.std_normalize is None:
            self.std_normalize = self.algorithm != "dr_grpo"
        if self.dynamic_sampling is None:
            self.dynamic_sampling = self.algorithm == "dapo"
        if self.loss_agg is None:
            self.loss_agg = {"grpo": "seq_mean", "dapo": "token_mean", "dr_grpo": "seq_sum_norm"}[self.algorithm]
        _check_choice("rl.loss_agg", self.loss_agg, ("token_mean", "seq_mean", "seq_sum_norm"))


@dataclass
class OptimSpec:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    warmup_ratio: float = 0.1
    schedule: str = "cosine"  # cosine | constant | linear
    grad_clip: float = 0.2
    eight_bit: bool | None = None  # None: 8-bit AdamW where bitsandbytes works on the device

    def __post_init__(self) -> None:
        _check_range("optim.lr", self.lr, 0.0, 1.0, lo_open=True)
        if len(self.betas) != 2:
            raise ValueError("optim.betas must be two numbers, e.g. [0.9, 0.99]")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        for b in self.betas:
            _check_range("optim.betas[]", b, 0.0, 1.0)
        _check_range("optim.weight_decay", self.weight_decay, 0.0, 10.0)
        _check_range("optim.warmup_ratio", self.warmup_ratio, 0.0, 1.0)
        _check_choice("optim.schedule", self.schedule, ("cosine", "constant", "linear"))
        _check_range("optim.grad_clip", self.grad_clip, 0.0, 1e6)


@dataclass
class DataSpec:
    """Where prompts come from: a JSONL file (path on the worker) or a built-in task.

    ``dataset`` for built-ins: {"source": "reasoning_gym", "task": "products", "size": 200,
    "seed": 0, "config": {...}}. ``one_shot`` prepends one worked example (from the same
    source) to every prompt; ``system_prompt`` overrides the format instruction.
    """

    train_file: str | None = None
    validation_file: str | None = None
    dataset: dict[str, Any] | None = None
    eval_size: int = EVAL_SIZE  # held-out prompts (split off the training data when no validation file)
    system_prompt: str | None = None
    one_shot: bool = True
    max_prompt_tokens: int = 512

    def __post_init__(self) -> None:
        if (self.train_file is None) == (self.dataset is None):
            raise ValueError("data: give exactly one of train_file (a JSONL file) or dataset (a built-in task)")
        if self.dataset is not None:
            if not isinstance(self.dataset, dict) or self.dataset.get("source") != "reasoning_gym":
                raise ValueError('data.dataset.source must be "reasoning_gym"')
            if not isinstance(self.dataset.get("task"), str):
                raise ValueError('data.dataset.task must name a reasoning-gym task, e.g. "products"')
            _check_range("data.dataset.size", self.dataset.get("size", 200), 1, 1_000_000)
        _check_range("data.eval_size", self.eval_size, 0, 100_000)
        size = self.dataset.get("size", 200) if self.dataset is not None else None
        if size is not None and self.validation_file is None and self.eval_size >= size:
            raise ValueError(f"data.eval_size={self.eval_size} would hold out every one of the dataset's {size} "
                             f"prompts; lower data.eval_size below {size} or raise data.dataset.size")
        _check_range("data.max_prompt_tokens", self.max_prompt_tokens, 8, 131072)


@dataclass
class TrainSpec:
    model: str = "smollm2-135m-instruct"  # a registry name (engine.registry) or a local directory
    quantization: str = "nvfp4"
    grader: dict[str, Any] = field(default_factory=lambda: {"type": "reasoning_gym", "name": "task"})
    data: DataSpec = field(default_factory=lambda: DataSpec(dataset={"source": "reasoning_gym", "task": "products"}))
    lora: LoraSpec = field(default_factory=LoraSpec)
    aqn: AQNSpec = field(default_factory=AQNSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    rl: RLSpec = field(default_factory=RLSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    steps: int = 30  # optimizer steps (rollout batches x rl.mu)
    prompts_per_step: int = 8
    micro_batch_size: int = 8  # sequences per forward/backward
    eval_interval: int = 0  # 0: only at start and end
    checkpoint_interval: int = 5
    # keep every checkpoint's LoRA (PEFT adapter) after the checkpoint itself is pruned: in
    # <workdir>/checkpoint-adapters/, and through the service as long as the job's adapter
    keep_checkpoint_adapters: bool = False
    # how many of each step's samples (prompt, completion, reward) to report, the first prompts'
    # groups, and as many of each evaluation's greedy completions; 0: none
    log_samples: int = 4
    # the job's adapter: the LoRA after the last step, or (best_eval) the LoRA of the evaluated step
    # whose held-out reward was highest (the later one on a tie; the start counts too)
    final_adapter: str = "last"
    # end the run once this many evaluations in a row (every eval_interval steps) score a held-out
    # reward no higher than the best before them; 0: run every step
    early_stop_patience: int = 0
    # a PEFT LoRA directory to start from (a fine-tuned model trained further): its rank, alpha,
    # target modules and rsLoRA must equal lora's; None: a fresh LoRA (B = 0)
    init_adapter: str | None = None
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    gradient_checkpointing: bool = True
    max_runtime_s: float | None = None
    # CUDA only: the job's share of the GPU (torch's caching allocator; an in-process vLLM counts
    # against it too, its rollout.gpu_memory_utilization fitted to it); None: the whole device
    max_gpu_memory_gib: float | None = None
    # CUDA with native rollouts: plan the job's memory (engine.memory_plan) before the first step,
    # lowering rollout.max_batch and micro_batch_size until it fits the GPU (or the cap), and
    # refuse a job that cannot fit at all before its weights load; false: the batch sizes as given
    memory_plan: bool = True

    def __post_init__(self) -> None:
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if not isinstance(self.grader, dict) or "type" not in self.grader:
            raise ValueError('grader must be an object with a "type" (string_check, text_similarity, '
                             'math_answer, format, multi, reasoning_gym, python, score_model, label_model)')
        _check_range("steps", self.steps, 1, 1_000_000)
        _check_range("prompts_per_step", self.prompts_per_step, 1, 4096)
        _check_range("micro_batch_size", self.micro_batch_size, 1, 4096)
        _check_range("eval_interval", self.eval_interval, 0, 1_000_000)
        _check_range("checkpoint_interval", self.checkpoint_interval, 0, 1_000_000)
        _check_range("log_samples", self.log_samples, 0, 64)
        _check_choice("final_adapter", self.final_adapter, FINAL_ADAPTERS)
        if self.final_adapter == "best_eval" and self.data.eval_size == 0 and self.data.validation_file is None:
            raise ValueError("final_adapter=best_eval keeps the LoRA of the step whose held-out evaluation scored "
                             "best, and this job holds out no prompts: set data.eval_size above 0 (or a "
                             "validation_file)")
        _check_range("early_stop_patience", self.early_stop_patience, 0, 1_000_000)
        if self.early_stop_patience and (self.eval_interval == 0 or (self.data.eval_size == 0
                                                                     and self.data.validation_file is None)):
            raise ValueError("early_stop_patience counts evaluations between the start and the end: set "
                             "eval_interval above 0 and hold out prompts (data.eval_size above 0, or a "
                             "validation_file), or set early_stop_patience to 0")
        _check_range("seed", self.seed, 0, 2**63 - 1)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.max_runtime_s is not None:
            _check_range("max_runtime_s", self.max_runtime_s, 0, 30 * 86400, lo_open=True)
        if self.max_gpu_memory_gib is not None:
            _check_range("max_gpu_memory_gib", self.max_gpu_memory_gib, 0, 100_000, lo_open=True)

    # -- (de)serialisation ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainSpec":
        return _from_dict(cls, data, "")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'spec'} must be an object")
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown field {prefix}{unknown[0]}; allowed: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _from_dict(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", hint, value)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - dataclass signature mismatch
        raise ValueError(f"{prefix or 'spec'}: {exc}") from None


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Type-check JSON values against the annotation; ints are accepted for floats."""
    origin, args = get_origin(hint), get_args(hint)
    if value is None:
        if type(None) in args:
            return None
        raise ValueError(f"{name} must not be null")
    if args and type(None) in args:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, inner[0], value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false; got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer; got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number; got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string; got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list; got {value!r}")
        item = args[0] if args else Any
        return [(_coerce(f"{name}[]", item, v) if item is not Any else v) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object; got {value!r}")
        return value
    if origin is Literal:
        return value
    return value
