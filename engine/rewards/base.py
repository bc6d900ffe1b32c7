"""The grader interface and config checks shared by every grader type."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence


class Grader:
    """Scores one sample: ``grader(sample_text, item) -> (score, parts)``.

    ``parts`` maps each named (sub-)grader to its score, so a run can log the format reward
    apart from the correctness reward. ``item_fields`` names the top-level item fields read."""

    type: str = ""

    def __init__(self, name: str) -> None:
        self.name = name
        self.item_fields: set[str] = set()

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        raise NotImplementedError

    def check_item(self, item: Mapping[str, Any]) -> str | None:
        """Why this grader cannot score samples of ``item`` (beyond a missing ``item_fields`` field),
        or None; checked on every row before a job loads its model."""
        return None

    def check_field_counts(self, counts: Mapping[str, int], rows: int) -> str | None:
        """What ``check_item`` would find in some row of a file whose ``rows`` rows have these
        top-level field counts (where the counts alone tell), or None."""
        return None

    def __call__(self, sample_text: str, item: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        s = float(self.score(sample_text, item))
        return s, {self.name: s}

    def batch(self, texts: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[tuple[float, dict[str, float]]]:
        """``self(text, item)`` for each pair; graders that wait on something else (a judge model,
        a sandbox) override it to grade a step's samples together."""
        return [self(t, i) for t, i in zip(texts, items)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def check_fields(cfg: Any, path: str, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> None:
    """Reject a config that is not an object, lacks a required field or has an unknown one."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must be an object with a \"type\"; got {type(cfg).__name__}")
    allowed = ("type", "name", *required, *optional)
    for key in cfg:
        if key not in allowed:
            raise ValueError(f"{path}.{key} is not a field of a {cfg.get('type')} grader; "
                             f"allowed: {', '.join(allowed)}")
    for key in required:
        if key not in cfg:
            raise ValueError(f"{path}.{key} is required for a {cfg.get('type')} grader")


def get_str(cfg: dict, key: str, path: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
    value = cfg.get(key, default)
    if not isinstance(value, str) or (not value and not choices):
        raise ValueError(f"{path}.{key} must be a non-empty string; got {value!r}")
    if choices and value not in choices:
        raise ValueError(f"{path}.{key} must be one of {', '.join(choices)}; got {value!r}")
    return value


def get_number(cfg: dict, key: str, path: str, default: float | None = None) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{path}.{key} must be a number; got {value!r}")
    if not finite(value):
        raise ValueError(f"{path}.{key} must be a finite number below 1e308; got {shown(value)}")
    return float(value)


def finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond float's range
        return False


def shown(value: int | float) -> str:
    """A number for a message; an integer of hundreds of digits cut short, with its length."""
    text = repr(value)
    return text if len(text) <= 30 else f"{text[:8]}... ({len(text.lstrip('-'))} digits)"


def grader_name(cfg: dict, path: str) -> str:
    name = cfg.get("name", cfg.get("type"))
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path}.name must be a non-empty string; got {name!r}")
    return name
