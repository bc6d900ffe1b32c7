"""math_answer: the sample's final answer equals the reference, compared as numbers when both parse.

Extraction ("auto"), first that applies: the last <answer>...</answer>, the last GSM8K
``#### x``, the last ``\\boxed{x}``, else the last number in the text ("answer_tag": only the
first). The reference goes through the same extraction, so a full GSM8K solution works as a
reference. Numbers compare exactly as fractions after dropping commas, ``$``, ``%`` and a
trailing period (so "1,000" == "1000.0" and "3/4" == "0.75" == "\\frac{3}{4}"), with a relative
tolerance of 1e-6 for decimals; anything else compares as a normalised string.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Mapping

from engine.rewards.base import Grader, check_fields, get_str, grader_name
from engine.rewards.templates import Template

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def extract_answer(text: str, mode: str = "auto") -> str | None:
    tags = ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    if mode == "answer_tag":
        return None
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def parse_number(text: str) -> Fraction | None:
    """The value of ``text`` as a number, or of the last number in it; None when it has none."""
    s = _FRAC.sub(r"(\1)/(\2)", text)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").replace("\\!", "")
    s = s.replace(",", "").strip().rstrip(".").strip()
    s = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", s)
    for candidate in (s, *reversed(_NUMBER.findall(s.replace(" ", "")))):
        try:
            return Fraction(candidate.replace(",", ""))
        except (ValueError, ZeroDivisionError):
            continue
    return None


def normalize_text(text: str) -> str:
    s = _TEXT.sub(r"\1", text)
    s = s.replace("\\left", "").replace("\\right", "").replace("$", "")
    return re.sub(r"\s+", "", s).rstrip(".").lower()


def answers_match(pred: str | None, reference: str | None) -> bool:
    if pred is None or reference is None:
        return False
    a, b = parse_number(pred), parse_number(reference)
    if a is not None and b is not None:
        return a == b or abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    return normalize_text(pred) == normalize_text(reference) and normalize_text(reference) != ""


class MathAnswer(Grader):
    type = "math_answer"

    def __init__(self, cfg: dict, path: str) -> None:
        check_fields(cfg, path, required=("reference",), optional=("input", "extract"))
        super().__init__(grader_name(cfg, path))
        self.input = Template(cfg.get("input", "{{sample.output_text}}"), f"{path}.input")
        self.reference = Template(cfg["reference"], f"{path}.reference")
        self.extract = get_str(cfg, "extract", path, default="auto", choices=("auto", "answer_tag"))
        self.item_fields = self.input.item_fields | self.reference.item_fields

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        pred = extract_answer(self.input.render(sample_text, item), self.extract)
        ref_text = self.reference.render(sample_text, item)
        ref = extract_answer(ref_text, "auto") if _has_marker(ref_text) else ref_text.strip()
        return 1.0 if answers_match(pred, ref) else 0.0


def _has_marker(text: str) -> bool:
    return "<answer>" in text or "####" in text or "\\boxed{" in text
