"""The base checkpoint a vLLM rollout engine loads: the very policy the trainer holds.

- NVFP4 base on a GPU: the compressed-tensors ``nvfp4-pack-quantized`` checkpoint
  (engine.quant.ct_io), which vLLM runs with its Marlin FP4 kernel (W4A16) on Hopper/Ampere and
  CUTLASS FP4 on Blackwell. The export quantizes exactly as load_model does (bf16 cast, shared
  global scale for q/k/v and gate/up), so sampler and learner share one set of 4-bit weights. A
  base that is already such a checkpoint is used as is.
- Everywhere else (vLLM has no NVFP4 kernel on CPU; NF4 has no compressed-tensors form vLLM
  reads): the trainer's base weights dequantized to its dtype (bf16 in jobs) and written as a
  plain Hugging Face checkpoint. Dequantization is exact (e2m1 x e4m3 fits bf16), so this is the
  same policy.

Module names follow Hugging Face's (the decoder mirrors them), so vLLM's loader and PEFT
adapter keys line up without a mapping.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.quant.base import FrozenLinear

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def uses_nvfp4_kernel(model: Any) -> bool:
    """vLLM can run this base as NVFP4: every frozen projection is NVFP4 and the model is on a GPU."""
    layers = [m for m in model.modules() if isinstance(m, FrozenLinear)]
    return model.device.type == "cuda" and bool(layers) and all(m.fmt == "nvfp4" for m in layers)


def write_vllm_base(model: Any, out_dir: Path) -> Path:
    """Write (or pick) the checkpoint vLLM loads for ``model``'s base; returns its directory."""
    src = Path(model.model_dir)
    if uses_nvfp4_kernel(model):
        config = json.loads((src / "config.json").read_text())
        if (config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
            return src
        from engine.quant.ct_io import export_compressed_tensors

        return export_compressed_tensors(src, out_dir, device=model.device)
    return write_dense_base(model, out_dir, dtype=model.dtype)


def dense_base_state_dict(model: Any, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> the trainer's base weights (projections dequantized), no LoRA."""
    sd: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, FrozenLinear):
            hf = name.removesuffix(".base")  # under a LoRA wrapper
            sd[f"{hf}.weight"] = module.dequantize(dtype)
            if module.bias is not None:
                sd[f"{hf}.bias"] = module.bias.to(dtype)
    for name, param in model.named_parameters():  # embeddings, norms, untied lm_head (tied: once)
        if ".lora_" not in name:
            sd[name] = param.detach().to(dtype)
    return {k: v.contiguous().cpu() for k, v in sd.items()}


def write_dense_base(model: Any, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    src = Path(model.model_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(dense_base_state_dict(model, dtype), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("torch_dtype", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for fname in TOKENIZER_FILES:
        if (src / fname).is_file():
            shutil.copy2(src / fname, out_dir / fname)
    return out_dir
