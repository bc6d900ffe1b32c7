"""OpenAI's string_check and text_similarity graders."""
from __future__ import annotations

from typing import Any, Mapping

from engine.rewards.base import Grader, check_fields, get_number, get_str, grader_name
from engine.rewards.templates import Template

STRING_OPS = ("eq", "ne", "like", "ilike")
SIMILARITY_METRICS = ("fuzzy_match",)


class StringCheck(Grader):
    """1.0 when ``input <operation> reference`` holds: eq, ne, like (contains), ilike (contains, any case)."""

    type = "string_check"

    def __init__(self, cfg: dict, path: str) -> None:
        check_fields(cfg, path, required=("input", "reference", "operation"))
        super().__init__(grader_name(cfg, path))
        self.input = Template(cfg["input"], f"{path}.input")
        self.reference = Template(cfg["reference"], f"{path}.reference")
        self.operation = get_str(cfg, "operation", path, choices=STRING_OPS)
        self.item_fields = self.input.item_fields | self.reference.item_fields

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        a, b = self.input.render(sample_text, item), self.reference.render(sample_text, item)
        if self.operation == "eq":
            ok = a == b
        elif self.operation == "ne":
            ok = a != b
        elif self.operation == "like":
            ok = b in a
        else:
            ok = b.lower() in a.lower()
        return 1.0 if ok else 0.0


class TextSimilarity(Grader):
    """Similarity in [0, 1] of input and reference.

    fuzzy_match: 2 * LCS / (len(a) + len(b)) over characters, the normalised Indel similarity
    (what rapidfuzz's ``fuzz.ratio`` computes). ``pass_threshold`` is kept for pass-rate
    reporting (``passed``); the reward is the similarity itself, as in OpenAI's graders."""

    type = "text_similarity"

    def __init__(self, cfg: dict, path: str) -> None:
        check_fields(cfg, path, required=("input", "reference", "evaluation_metric"), optional=("pass_threshold",))
        super().__init__(grader_name(cfg, path))
        self.input = Template(cfg["input"], f"{path}.input")
        self.reference = Template(cfg["reference"], f"{path}.reference")
        self.metric = get_str(cfg, "evaluation_metric", path, choices=SIMILARITY_METRICS)
        self.pass_threshold = get_number(cfg, "pass_threshold", path)
        if self.pass_threshold is not None and not 0.0 <= self.pass_threshold <= 1.0:
            raise ValueError(f"{path}.pass_threshold must be in [0, 1]; got {self.pass_threshold}")
        self.item_fields = self.input.item_fields | self.reference.item_fields

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        return fuzzy_ratio(self.input.render(sample_text, item), self.reference.render(sample_text, item))

    def passed(self, score: float) -> bool:
        return self.pass_threshold is None or score >= self.pass_threshold


def fuzzy_ratio(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    return 2.0 * lcs_length(a, b) / (len(a) + len(b))


def lcs_length(a: str, b: str) -> int:
    """Longest common subsequence length, bit-parallel (Allison-Dix / Hyyro): O(len(a) * len(b) / word)."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    masks: dict[str, int] = {}
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")
