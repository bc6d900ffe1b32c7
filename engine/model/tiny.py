"""A random tiny Hugging Face checkpoint for tests: saved by transformers itself (so
transformers and peft load it as the reference), with SmolLM2's tokenizer and chat template.

Norm weights and biases are randomised too (transformers initialises them to 1 and 0), so a
test that mixes up a norm or drops a bias fails.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCH_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
SMOLLM2 = "smollm2-135m-instruct"


def make_tiny_model(out_dir: str | Path, *, arch: str = "llama", hidden: int = 64, layers: int = 2, seed: int = 0,
                    tie_word_embeddings: bool | None = None, **config_overrides: Any) -> Path:
    """Write a random ``arch`` model (head_dim 16, GQA 2:1, vocab 49152) to ``out_dir``."""
    import transformers
    from transformers import AutoModelForCausalLM

    if arch not in ARCH_CONFIGS:
        raise ValueError(f"arch must be one of {', '.join(ARCH_CONFIGS)}; got {arch!r}")
    if hidden % 32:
        raise ValueError(f"hidden must be a multiple of 32 (NVFP4 blocks of 16, head_dim 16); got {hidden}")
    out = Path(out_dir)
    heads = hidden // 16
    kwargs: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1), head_dim=16, intermediate_size=2 * hidden,
        max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.1,
        tie_word_embeddings=(arch == "llama") if tie_word_embeddings is None else tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    cfg = getattr(transformers, ARCH_CONFIGS[arch])(**{**kwargs, **config_overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    smollm2_tokenizer().save_pretrained(out)
    return out


def smollm2_tokenizer():
    """SmolLM2's tokenizer: from the cached converted model, else converted on its own (~5 s)."""
    from engine.model.gguf import cache_root, convert_gguf_tokenizer, wheel_file
    from engine.model.tokenizer import load_tokenizer
    from engine.registry import BUILTIN

    for cached in (cache_root() / "models" / SMOLLM2, cache_root() / "tokenizers" / SMOLLM2):
        if cached.is_dir():
            return load_tokenizer(cached)
    _, module, filename = BUILTIN[SMOLLM2].source.split(":", 2)
    return load_tokenizer(convert_gguf_tokenizer(wheel_file(module, filename), SMOLLM2))
