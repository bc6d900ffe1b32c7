"""LoRA on the frozen (quantized) projections, saved in PEFT's format.

y = base(x) + B(A(dropout(x))) * scaling, scaling = alpha / r (rsLoRA: alpha / sqrt(r)).
A is kaiming-uniform (a = sqrt(5)), B is zero: PEFT's default, so a fresh adapter is the base.

Precision: A and B are fp32 parameters and the LoRA branch runs in fp32 (x is cast up, the
sum base + delta is formed in fp32, then cast back to the activation dtype). At the QeRL
learning rate (1e-5) a bf16 parameter would round most AdamW updates away; the rank-r matmuls
are a few percent of the layer's cost. This is also exactly what PEFT does when it loads our
fp32 adapter on a bf16 base (it computes in the adapter's dtype), so the two agree closely.

``lora_disabled(model)`` switches every adapter off: the frozen base is the reference policy
without a second copy of the weights.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
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
        xa = self.dropout(x).to(self.lora_A.dtype)
        delta = F.linear(F.linear(xa, self.lora_A), self.lora_B) * self.scaling
        return (y.to(delta.dtype) + delta).to(x.dtype)


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


def load_peft_adapter(model: nn.Module, adapter_dir: str | Path) -> None:
    """Attach (if needed) and load a PEFT LoRA directory written by save_peft_adapter."""
    d = Path(adapter_dir)
    cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    if not lora_modules(model):
        targets = cfg["target_modules"]
        spec = LoraSpec(r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                        target_modules=sorted(targets) if isinstance(targets, (list, set)) else [targets],
                        use_rslora=bool(cfg.get("use_rslora", False)))
        apply_lora(model, spec)
    load_adapter_state_dict(model, load_file(str(d / ADAPTER_WEIGHTS)))
