"""LoRA on the frozen (quantized) projections, saved in PEFT's format.

y = base(x) + B(A(dropout(x))) * scaling, scaling = alpha / r (rsLoRA: alpha / sqrt(r)).
A is kaiming-uniform (a = sqrt(5)), B is zero: PEFT's default, so a fresh adapter is the base.

Precision: A and B are fp32 parameters and the LoRA branch runs in fp32 (x is cast up, the
sum base + delta is formed in fp32, then cast back to the activation dtype). At the QeRL
learning rate (1e-5) a bf16 parameter would round most AdamW updates away. This is also exactly
what PEFT does when it loads our fp32 adapter on a bf16 base (it computes in the adapter's
dtype), so the two agree closely.

On a GPU the branch of a bf16 model keeps that precision with fewer passes over the
layer-sized tensors (``_Branch``): each fp32 operand of a rank-r product is split into bf16
(hi, lo) pieces (16 of fp32's 24 significand bits), so the products run as bf16 tensor-core
GEMMs with fp32 sums (each within ~2^-16 of fp32's) and no fp32 copy of x or of the gradients;
the delta joins the base output in the last GEMM's epilogue (``BRANCH_ADD``: that epilogue may
round it to bf16 first, one bf16 step at most; "add" keeps the fp32 formula's single rounding).
Written the plain way (casts, the scaling, the fp32 sum and their gradients) the branch took
most of the learner's time outside the base GEMMs (benchmarks/learner.py; benchmarks/RESULTS.md).

``lora_disabled(model)`` switches every adapter off: the frozen base is the reference policy
without a second copy of the weights.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from engine.spec import LoraSpec

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, spec: LoraSpec, *, dtype: torch.dtype = torch.float32,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.base = base
        device = next(base.buffers()).device
        a = torch.empty(spec.r, base.in_features, dtype=dtype)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(a.to(device))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, spec.r, dtype=dtype, device=device))  # (out, r)
        self.scaling = spec.scaling
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.disabled = False
        self._hold = False  # inside held_pieces(): keep the weights' pieces (_held) between passes
        self._held: tuple | None = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.disabled:
            return y
        xd = self.dropout(x)
        if _split_branch(xd, y, self.lora_A, self.lora_B):
            ap, bp = self._pieces()
            return _Branch.apply(xd, y, self.lora_A, self.lora_B, ap, bp, self.scaling)
        xa = xd.to(self.lora_A.dtype)
        delta = F.linear(F.linear(xa, self.lora_A), self.lora_B) * self.scaling
        return (y.to(delta.dtype) + delta).to(x.dtype)

    def _pieces(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A's and B's bf16 pieces for _Branch: (3r, in) and (out, 3r). Made in every forward pass,
        or once while the adapter is held (``held_pieces``) and its weights keep their version."""
        key = (self.lora_A._version, self.lora_B._version)
        if self._held is not None and self._held[0] == key:
            return self._held[1]
        with torch.no_grad():
            pieces = _pieces(self.lora_A, 0), _pieces(self.lora_B, 1)
        if self._hold:
            self._held = (key, pieces)
        return pieces


# Where the LoRA branch runs as bf16-piece GEMMs (_Branch): "auto" on CUDA, "on" on every device
# (the CPU then emulates the bf16 GEMMs' fp32 sums: tests), "off" nowhere.
SPLIT_BRANCH = "auto"


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``t`` as bf16 (hi, lo) with hi + lo = t to ~2^-17 relative (16 of fp32's 24
    significand bits; t - hi is exact in fp32)."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi).to(torch.bfloat16)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 matrices with fp32 sums and an fp32 result (cuBLAS on CUDA, fp32 on CPU)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _halves_sum(p: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of p's two halves along dim: a product over (hi, lo) pieces."""
    first, second = p.chunk(2, dim=dim)
    return first + second


def _pieces(t: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 t's pieces side by side along dim as [hi, lo, hi]: times [hi', hi', lo'] of another
    fp32 operand they give hi hi' + lo hi' + hi lo', the product to ~2^-16 relative; their first
    two thirds [hi, lo] times an exact bf16 operand give t's product to ~2^-17."""
    hi, lo = split_bf16(t)
    return torch.cat([hi, lo, hi], dim=dim)


def _pairs(t: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 t's pieces as [hi, hi, lo] along dim (the partner of ``_pieces``); the last two
    thirds [hi, lo] are t's (hi, lo) pair."""
    hi, lo = split_bf16(t)
    return torch.cat([hi, hi, lo], dim=dim)


@lru_cache(maxsize=None)
def _mm_f32_works(device: str) -> bool:
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return bool(torch.equal(_mm_f32(x, x), torch.full((2, 2), 2.0, device=device)))
    except torch.cuda.OutOfMemoryError:
        raise  # the job's memory, not the product: no answer to cache for later jobs
    except (RuntimeError, TypeError):
        return False


def _split_branch(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    if SPLIT_BRANCH == "off" or (SPLIT_BRANCH == "auto" and not x.is_cuda):
        return False
    if not (x.dtype == y.dtype == torch.bfloat16 and a.dtype == b.dtype == torch.float32):
        return False
    return not x.is_cuda or _mm_f32_works(str(x.device))


# How _Branch adds the delta to the base output. "addmm": cuBLAS's epilogue adds it into y in
# place (y is made for the branch and saved by no one: the base's backward needs only dL/dy), but
# on the H200 8-24% of outputs of a test whose delta is as large as y were one bf16 step from the
# fp32 formula, as if the product were rounded to bf16 before the add (the rounding a bf16
# adapter's delta gets; an adapter's delta is mostly far smaller than y). "add": the delta in
# fp32, then y + delta rounded once (0.06-0.3% differ, from the pieces): a 7B learner micro-batch
# took 765 ms against addmm's 632 (H200, benchmarks/learner.py).
BRANCH_ADD = "addmm"


class _Branch(torch.autograd.Function):
    """bf16(y + (x @ A^T) @ B^T * scaling), y the base output, with every product a bf16 GEMM
    over (hi, lo) pieces of its fp32 operands (``_pieces``, ``_pairs``) and fp32 sums:
    u = x @ [A hi; A lo]^T, halves added; u_s = u * scaling; y + [u_s hi, u_s hi, u_s lo] @
    [B hi, B lo, B hi]^T (BRANCH_ADD says how the sum is rounded). Backward, with g = dL/dout
    (bf16: exact as an operand): g_u = g @ [B hi, B lo] * scaling; dL/dx = [g_u hi, g_u hi,
    g_u lo] @ [A hi; A lo; A hi] rounded once; dL/dA = [g_u hi, g_u lo]^T @ x and dL/dB = g^T @
    [u_s hi, u_s lo], halves added; dL/dy = g. Each product is within ~2^-16 of fp32's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,  # type: ignore[override]
                ap: torch.Tensor, bp: torch.Tensor, scaling: float) -> torch.Tensor:
        """ap, bp: a's and b's pieces, ``_pieces(a, 0)`` (3r, K) and ``_pieces(b, 1)`` (N, 3r)."""
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        r = a.shape[0]
        us = _halves_sum(_mm_f32(x2, ap[:2 * r].t()), 1) * scaling  # (T, r)
        left = _pairs(us, 1)  # (T, 3r)
        # into y itself when y is a tensor of its own: the base output is the branch's alone. Not when
        # y is a view (the GPU kernels' output reshaped): autograd forbids changing in place a view
        # made inside another custom Function (the base's), so it gets a copy.
        if BRANCH_ADD == "addmm" and y.is_contiguous() and y._base is None:
            y2.addmm_(left, bp.t())  # y2 is a view of y
            ctx.mark_dirty(y)
            out = y
        elif BRANCH_ADD == "addmm":
            out = torch.addmm(y2, left, bp.t()).view(y.shape)
        else:
            out = torch.empty_like(y2)
            torch.add(y2, _mm_f32(left, bp.t()), out=out)
            out = out.view(y.shape)
        ctx.save_for_backward(x, ap, bp, left)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, ap, bp, left = ctx.saved_tensors
        r = ap.shape[0] // 3
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[3]:
            grad_b = _halves_sum(_mm_f32(g2.t(), left[:, r:]), 1)  # (N, r)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            gu = _pairs(_halves_sum(_mm_f32(g2, bp[:, :2 * r]), 1) * ctx.scaling, 1)  # (T, 3r)
            if ctx.needs_input_grad[0]:
                grad_x = torch.mm(gu, ap).view(x.shape)
            if ctx.needs_input_grad[2]:
                grad_a = _halves_sum(_mm_f32(gu[:, r:].t(), x.reshape(-1, x.shape[-1])), 0)  # (r, K)
        return grad_x, g, grad_a, grad_b, None, None, None


@contextmanager
def held_pieces(model: nn.Module) -> Iterator[None]:
    """While the adapters' weights do not change (the micro-batches of one update, each a forward
    pass, its checkpointed layers' recompute and backward), make the bf16 pieces of each A and B
    that the LoRA branch multiplies by (_Branch) once, not in every forward pass: ~10 small
    launches per projection and pass fewer, for 6 bytes per adapter weight while held. A weight
    changed in place by torch inside the block (its version moves) gets new pieces."""
    mods = list(lora_modules(model).values())
    for m in mods:
        m._hold = True
    try:
        yield
    finally:
        for m in mods:
            m._hold, m._held = False, None


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{module path (Hugging Face naming): LoRALinear}."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, spec: LoraSpec, *, dtype: torch.dtype = torch.float32,
               seed: int | None = None) -> list[nn.Parameter]:
    """Wrap every target projection of every decoder layer; returns the new parameters."""
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters; load a fresh base to apply another")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in spec.target_modules:
                if hasattr(parent, name):
                    setattr(parent, name, LoRALinear(getattr(parent, name), spec, dtype=dtype, generator=gen))
    model.lora_spec = spec
    return adapter_params(model)


def adapter_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B)]


@contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """Run the frozen base alone (the reference policy) inside the block."""
    mods = list(lora_modules(model).values())
    before = [m.disabled for m in mods]
    for m in mods:
        m.disabled = True
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.disabled = b


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """LoRA weights under PEFT's key names (detached, on their device)."""
    sd = {}
    for name, m in lora_modules(model).items():
        sd[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach()
        sd[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach()
    return sd


def load_adapter_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy weights in; keys as ``adapter_state_dict`` writes them (PEFT's ``.default.``
    adapter-name infix is accepted too). Missing or misshapen weights raise ValueError."""
    sd = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v for k, v in sd.items()}
    mods = lora_modules(model)
    if not mods:
        raise ValueError("the model has no LoRA adapters; call apply_lora first")
    expected = set()
    with torch.no_grad():
        for name, m in mods.items():
            for part, param in (("lora_A", m.lora_A), ("lora_B", m.lora_B)):
                key = f"{PEFT_PREFIX}{name}.{part}.weight"
                expected.add(key)
                if key not in sd:
                    raise ValueError(f"adapter lacks {key}; was it trained with other target_modules or rank?")
                if tuple(sd[key].shape) != tuple(param.shape):
                    raise ValueError(f"adapter {key} has shape {tuple(sd[key].shape)}, model expects {tuple(param.shape)}")
                param.copy_(sd[key].to(param.dtype))
    extra = sorted(set(sd) - expected)
    if extra:
        raise ValueError(f"adapter has weights for modules the model lacks, e.g. {extra[0]}")


def save_peft_adapter(model: nn.Module, out_dir: str | Path, *, base_model_name_or_path: str,
                      dtype: torch.dtype | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors that peft and vLLM load on the
    original base. ``dtype`` None keeps the fp32 training weights."""
    from peft import LoraConfig

    spec: LoraSpec = model.lora_spec
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    cfg = LoraConfig(r=spec.r, lora_alpha=alpha, lora_dropout=spec.dropout, use_rslora=spec.use_rslora,
                     target_modules=sorted(set(spec.target_modules)), bias="none", task_type="CAUSAL_LM",
                     base_model_name_or_path=base_model_name_or_path)
    cfg.save_pretrained(str(out))
    sd = {k: v.to(dtype or v.dtype).contiguous().cpu() for k, v in adapter_state_dict(model).items()}
    save_file(sd, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def peft_lora_spec(adapter_dir: str | Path) -> LoraSpec:
    """The LoraSpec of a PEFT LoRA directory's adapter_config.json."""
    cfg = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    targets = cfg["target_modules"]
    return LoraSpec(r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                    target_modules=sorted(targets) if isinstance(targets, (list, set)) else [targets],
                    use_rslora=bool(cfg.get("use_rslora", False)))


def load_peft_adapter(model: nn.Module, adapter_dir: str | Path) -> None:
    """Attach (if needed) and load a PEFT LoRA directory written by save_peft_adapter."""
    d = Path(adapter_dir)
    if not lora_modules(model):
        apply_lora(model, peft_lora_spec(d))
    load_adapter_state_dict(model, load_file(str(d / ADAPTER_WEIGHTS)))
