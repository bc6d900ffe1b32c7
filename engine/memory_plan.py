"""What a job will hold on its GPU, planned before it runs, and the batch sizes that fit.

A job holds, for its whole run: the base (as its format stores it), the LoRA with its gradients,
optimizer states and the copies the rollout engine and the learner keep of it, and the rollout
engine's static KV cache (``rollout_batch`` sequences of ``max_len`` tokens, kept between steps
so its CUDA graphs stay valid). On top of that, one of two passes at a time: a rollout's prefill
(chunks of up to 8192 prompt tokens through the layers, no gradients) or a learner micro-batch
(layer inputs kept for gradient checkpointing, one layer's activations and their gradients
while it is recomputed, or the head's row chunk of fp32 logits).

The held terms are exact arithmetic on the shapes; the passes' terms count the tensors the code
keeps (engine.model.layers, engine.model.decoder.token_logprobs) and are checked against the
peak torch reports on the GPU (benchmarks/rl_step.py prints both). ``fit`` keeps the job's
micro_batch_size and rollout.max_batch when the plan fits and otherwise halves them, keeping the
rollout's batch as large as it can (it is what makes decoding fast; the learner's rows are many per
GEMM at any micro-batch), and says when nothing fits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.model.config import ModelConfig
from engine.rollout.cuda_graph import PREFILL_ROWS, batch_bucket, kv_len
from engine.spec import TrainSpec

GIB = 2**30
HEAD_CHUNK = 512  # rows of the learner's head per chunk (engine.model.decoder.token_logprobs)
SLACK = 0.10  # the allocator's rounding and fragmentation over what the tensors need
FIXED = 256 * 2**20  # cuBLAS workspaces, the sampler's and graphs' small buffers


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder projection, by its Hugging Face name."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def base_bytes(cfg: ModelConfig, quantization: str, *, dtype_bytes: int = 2, operand: bool = True) -> int:
    """The base as the job holds it: decoder projections in ``quantization`` (NVFP4 at 0.5625 bytes
    a weight: as the GPU kernel's operand, over whole 16-row, 256-input tiles, or with ``operand``
    False as compressed-tensors' buffers; NF4 codes and an fp32 absmax per 64; bf16), their
    biases, norms, embeddings and head in the model dtype."""
    per_layer = 0
    for out, inp in linear_shapes(cfg).values():
        if quantization == "nvfp4":
            rows, cols = (_round_up(out, 16), _round_up(inp, 256)) if operand else (out, inp)
            per_layer += rows * cols * 9 // 16 + 4
        elif quantization == "nf4":
            n = out * inp
            per_layer += -(-n // 2) + -(-n // 64) * 4
        else:
            per_layer += out * inp * dtype_bytes
    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.attention_bias:
        per_layer += (cfg.num_heads + 2 * cfg.num_kv_heads) * d * dtype_bytes
    if cfg.o_bias:
        per_layer += h * dtype_bytes
    if cfg.mlp_bias:
        per_layer += (2 * cfg.intermediate_size + h) * dtype_bytes
    per_layer += 2 * h * dtype_bytes + (2 * d * dtype_bytes if cfg.qk_norm else 0)
    embed = cfg.vocab_size * h * dtype_bytes
    return cfg.num_layers * per_layer + embed * (1 if cfg.tie_word_embeddings else 2) + h * dtype_bytes


def adapter_numel(cfg: ModelConfig, r: int, targets: list[str]) -> int:
    """Trainable LoRA parameters: r x (in + out) per targeted projection and layer."""
    shapes = linear_shapes(cfg)
    return cfg.num_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)


def adapter_bytes(numel: int, *, eight_bit: bool) -> dict[str, int]:
    """The LoRA's fp32 weights and gradients, AdamW's two states (fp32, or one byte each with
    bitsandbytes), the rollout engine's fp32 copy and the learner's bf16 (hi, lo) pieces (three of
    each factor side by side, engine.lora._pieces)."""
    return {"weights": 4 * numel, "gradients": 4 * numel, "optimizer": (2 if eight_bit else 8) * numel,
            "rollout copy": 4 * numel, "learner pieces": 6 * numel}


def kv_cache_bytes(cfg: ModelConfig, batch: int, max_len: int, *, dtype_bytes: int = 2) -> int:
    """The rollout engine's static cache: keys and values of every layer, the validity mask and
    the RoPE tables (engine.rollout.cuda_graph.GraphRollout)."""
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_len * cfg.head_dim * dtype_bytes
    return kv + batch * max_len + 2 * max_len * cfg.head_dim * dtype_bytes


def rollout_max_len(longest_prompt: int, max_new_tokens: int) -> int:
    """The KV length of the engine a rollout of these lengths is decoded on."""
    return kv_len(longest_prompt + max_new_tokens)


def _layer_activation_bytes(cfg: ModelConfig) -> int:
    """Bytes a token's activations take in one decoder layer's forward with gradients: the two
    norms' fp32 inputs and bf16 outputs, q/k/v before and after RoPE, attention's output and its
    copy into o, o's output and the residual, gate, up, SiLU and their product, down and the
    residual (engine.model.layers)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 2 * (4 + 2) * h + 2 * (q + 2 * kv) + 2 * (q + kv) + 2 * 2 * q + 2 * 2 * h + 4 * 2 * i + 2 * 2 * h


def learner_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, *, checkpointing: bool = True,
                  quantization: str = "nvfp4", head_chunk: int = HEAD_CHUNK) -> int:
    """Peak of one learner micro-batch beyond what the job holds: the layer inputs kept for the
    backward (every layer's activations without checkpointing), the final norm's and the hidden
    states' gradients, and the larger of the head's chunk (fp32 logits, log-softmax, probabilities
    and their gradients) and one layer being recomputed with its gradients and a projection's
    weights dequantized for its product."""
    n = micro_batch * seq_len
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_token = _layer_activation_bytes(cfg)
    kept = cfg.num_layers * n * (2 * h if checkpointing else per_token)
    final = n * h * (4 + 2 + 2 + 4)  # final norm's fp32 input, its output, the hidden gradient (bf16, fp32)
    head = min(head_chunk, n) * v * 4 * 5
    grads = n * (3 * 2 * i + 4 * 2 * h)  # one layer's widest gradients alive together
    biggest = max(o * k for o, k in linear_shapes(cfg).values())
    dequant = 2 * biggest * 2 if quantization != "bf16" else 0
    layer = (n * per_token if checkpointing else 0) + grads + dequant
    return kept + final + max(head, layer)


def prefill_bytes(cfg: ModelConfig, batch: int, longest_prompt: int) -> int:
    """Peak of a rollout's prefill beyond the cache: one chunk's activations through a layer (no
    gradients: a layer's tensors are freed before the next) and the last positions' fp32 logits."""
    n = min(PREFILL_ROWS, batch * max(1, longest_prompt))
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * (4 * h + (q + 2 * kv) + q + 3 * i)
    return n * per_token + batch * cfg.vocab_size * 4 * 3


@dataclass
class MemoryPlan:
    """Bytes by term, for ``rollout_batch`` sequences decoded together and learner micro-batches
    of ``micro_batch`` sequences of ``seq_len`` tokens, against ``limit`` (None: not checked)."""

    held: dict[str, int]
    rollout_pass: int
    learner_pass: int
    rollout_batch: int
    micro_batch: int
    max_len: int
    seq_len: int
    limit: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        tensors = sum(self.held.values()) + max(self.rollout_pass, self.learner_pass)
        return int(tensors * (1 + SLACK)) + FIXED

    @property
    def fits(self) -> bool:
        return self.limit is None or self.peak <= self.limit

    def as_dict(self) -> dict[str, float]:
        """GiB by term (for an event's data)."""
        out = {k: round(v / GIB, 3) for k, v in self.held.items()}
        out.update({"rollout pass": round(self.rollout_pass / GIB, 3), "learner pass": round(self.learner_pass / GIB, 3),
                    "peak": round(self.peak / GIB, 3), "rollout_batch": self.rollout_batch,
                    "micro_batch_size": self.micro_batch})
        if self.limit is not None:
            out["limit"] = round(self.limit / GIB, 3)
        return out

    def describe(self) -> str:
        held = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.held.items() if v)
        text = (f"{self.peak / GIB:.1f} GiB planned at the peak (GiB: {held}; then the larger of a rollout's "
                f"prefill {self.rollout_pass / GIB:.2f} and a learner micro-batch of {self.micro_batch} x "
                f"{self.seq_len} tokens {self.learner_pass / GIB:.2f}; {SLACK:.0%} and {FIXED / GIB:.2f} GiB "
                f"for the allocator and workspaces)")
        if self.limit is not None:
            text += f" of the {self.limit / GIB:.1f} GiB this job may use"
        return text


@dataclass(frozen=True)
class PlanInputs:
    """What the plan reads of a job beyond its spec: the prompts' longest length in tokens, how many
    sequences a step's rollout and an evaluation decode, and whether AdamW runs in 8 bits."""

    longest_prompt: int
    rollout_rows: int
    eval_rows: int = 0
    eight_bit: bool = False


def plan(cfg: ModelConfig, spec: TrainSpec, inputs: PlanInputs, *, rollout_batch: int | None = None,
         micro_batch: int | None = None, limit: int | None = None, base: int | None = None,
         head_chunk: int = HEAD_CHUNK) -> MemoryPlan:
    """The plan of ``spec`` with these batch sizes (default: the spec's). ``base``: the bytes held
    once the model is loaded (its base and LoRA weights, measured), else the shapes' arithmetic;
    ``head_chunk``: the learner head's rows per chunk."""
    rb = rollout_batch or spec.rollout.max_batch
    mb = micro_batch or spec.micro_batch_size
    rows = max(inputs.rollout_rows, inputs.eval_rows, 1)
    engine_batch = batch_bucket(min(rb, rows), rb)  # what the cached engine is built for
    max_len = rollout_max_len(inputs.longest_prompt, spec.rollout.max_new_tokens)
    seq_len = inputs.longest_prompt + spec.rollout.max_new_tokens
    numel = adapter_numel(cfg, spec.lora.r, list(spec.lora.target_modules))
    adapter = adapter_bytes(numel, eight_bit=inputs.eight_bit)
    held = ({"base": base_bytes(cfg, spec.quantization), "LoRA weights": adapter["weights"]} if base is None
            else {"model as loaded": base})  # a loaded model's bytes hold its LoRA weights
    held["LoRA gradients"] = adapter["gradients"]
    held["optimizer"] = adapter["optimizer"]
    held["LoRA copies"] = adapter["rollout copy"] + adapter["learner pieces"]
    held["KV cache"] = kv_cache_bytes(cfg, engine_batch, max_len)
    return MemoryPlan(held=held, rollout_pass=prefill_bytes(cfg, engine_batch, inputs.longest_prompt),
                      learner_pass=learner_bytes(cfg, min(mb, rows), seq_len, checkpointing=spec.gradient_checkpointing,
                                                 quantization=spec.quantization, head_chunk=head_chunk),
                      rollout_batch=engine_batch, micro_batch=mb, max_len=max_len, seq_len=seq_len, limit=limit)


class DoesNotFit(ValueError):
    """No batch sizes fit: the message gives the smallest plan and what would make room."""


def fit(cfg: ModelConfig, spec: TrainSpec, inputs: PlanInputs, *, limit: int, base: int | None = None) -> MemoryPlan:
    """The plan with the spec's batch sizes when it fits ``limit``; else the largest rollout batch
    (halving from the spec's) that fits with some micro-batch, with the largest micro-batch (halving
    likewise) that fits beside it: decoding gains most from its batch, the learner's long rows fill
    its GEMMs at any micro-batch. ``notes`` says what was lowered and why."""
    want = plan(cfg, spec, inputs, limit=limit, base=base)
    if want.fits:
        return want
    rb = want.rollout_batch
    while rb >= 1:
        mb = spec.micro_batch_size
        while mb >= 1:
            p = plan(cfg, spec, inputs, rollout_batch=rb, micro_batch=mb, limit=limit, base=base)
            if p.fits:
                lowered = []
                if mb != spec.micro_batch_size:
                    lowered.append(f"micro_batch_size {spec.micro_batch_size} -> {mb}")
                if rb != want.rollout_batch:
                    lowered.append(f"rollout sub-batches {want.rollout_batch} -> {rb} sequences")
                p.notes.append(f"lowered {', '.join(lowered)} to fit: as asked, the job would need "
                               f"{want.peak / GIB:.1f} GiB of the {limit / GIB:.1f} it may use")
                return p
            mb //= 2
        rb //= 2
    smallest = plan(cfg, spec, inputs, rollout_batch=1, micro_batch=1, limit=limit, base=base)
    raise DoesNotFit(f"the job does not fit the {limit / GIB:.1f} GiB it may use even with one sequence per "
                     f"rollout sub-batch and learner micro-batch: {smallest.describe()}. Make room with a "
                     f"smaller model, quantization nvfp4 or nf4, a shorter rollout.max_new_tokens or "
                     f"data.max_prompt_tokens, a lower lora.r, or a GPU with more memory "
                     f"(max_gpu_memory_gib, where set, is the limit)")


def with_batches(spec: TrainSpec, p: MemoryPlan) -> TrainSpec:
    """``spec`` with the plan's micro-batch and rollout batch (as caps: the same or lower)."""
    rollout = dataclasses.replace(spec.rollout, max_batch=min(spec.rollout.max_batch, p.rollout_batch))
    return dataclasses.replace(spec, micro_batch_size=min(spec.micro_batch_size, p.micro_batch), rollout=rollout)
