"""Tokenizer loading and the end-of-sequence ids a sampler should stop on."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The model's tokenizer (with its chat template); pad = eos when the model has no pad."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None = None) -> list[int]:
    """The tokenizer's eos plus generation_config.json's eos_token_id (int or list), deduplicated."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen is not None and gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        for i in (value if isinstance(value, list) else [value]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids
