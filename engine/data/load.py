"""``load_examples``: prompts for training and a held-out eval split, deterministic given the seed."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.data.builtin import reasoning_gym_entries
from engine.data.jsonl import parse_jsonl_lines
from engine.data.prompts import build_messages, row_messages
from engine.spec import DataSpec
from engine.types import TrainError


@dataclass(frozen=True)
class Example:
    messages: list[dict[str, str]]  # the chat to continue (ends with the user's turn)
    item: dict[str, Any] = field(default_factory=dict)  # the row the grader reads ({{item.x}})
    line: int | None = None  # 1-based line of the JSONL row, for error messages; None for built-ins


def load_examples(spec: DataSpec, seed: int) -> tuple[list[Example], list[Example]]:
    """Return (train, eval). Without a validation file, eval_size distinct questions are held out
    of the training data (no eval question appears in train). Train order is a seeded shuffle."""
    if spec.dataset is not None:
        entries, shot = reasoning_gym_entries(spec.dataset, seed)
        shot = shot if spec.one_shot else None
        examples = [Example(build_messages(e["question"], system_prompt=spec.system_prompt, shot=shot), e)
                    for e in entries]
    else:
        examples = _jsonl_examples(spec.train_file, "data.train_file", spec)
    if spec.validation_file is not None:
        evals = _jsonl_examples(spec.validation_file, "data.validation_file", spec)
        evals = _sample(evals, spec.eval_size, seed)
        train = examples[:]
        random.Random(seed).shuffle(train)
        return train, evals
    return split_eval(examples, spec.eval_size, seed)


def split_eval(examples: list[Example], eval_size: int, seed: int) -> tuple[list[Example], list[Example]]:
    """Hold out ``eval_size`` distinct prompts (one example each); train keeps every other row."""
    by_key: dict[str, Example] = {}
    for ex in examples:
        by_key.setdefault(_key(ex), ex)
    if eval_size and eval_size >= len(by_key):
        raise TrainError("invalid_dataset", f"data.eval_size={eval_size} holds out all {len(by_key)} distinct "
                                            "prompts; lower data.eval_size, add rows, or give a validation_file")
    keys = list(by_key)
    rng = random.Random(seed)
    rng.shuffle(keys)
    held = set(keys[:eval_size])
    evals = [by_key[k] for k in keys[:eval_size]]
    train = [ex for ex in examples if _key(ex) not in held]
    rng.shuffle(train)
    return train, evals


def _key(ex: Example) -> str:
    """What makes two prompts the same question: the final user turn (``prompt_key`` for a row)."""
    return ex.messages[-1]["content"]


def _sample(examples: list[Example], size: int, seed: int) -> list[Example]:
    if size >= len(examples):
        return examples
    return random.Random(seed).sample(examples, size)


def _jsonl_examples(path: str, where: str, spec: DataSpec) -> list[Example]:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TrainError("invalid_dataset", f"{where}: cannot read {path} ({exc.strerror}); upload the file again")
    rows, errors = parse_jsonl_lines(data)
    if errors:
        raise TrainError("invalid_dataset", f"{where}: " + "; ".join(errors))
    return [Example(row_messages(r, system_prompt=spec.system_prompt, one_shot=spec.one_shot), r, line)
            for line, r in rows]
