"""OpenAI grader templates: ``{{sample.output_text}}``, ``{{sample.output_json[.<field>...]}}`` and
``{{item.<field>[.<field>...]}}``.

A template is any string; each ``{{ ... }}`` is replaced by the sample's text, by the sample
read as JSON (whole, or a field of it), or by a field of the dataset row (nested through dicts,
or lists by index). Non-string values are written as JSON. Variables are checked when the grader
is built; a missing item field raises at scoring time with the field's name (the dataset's
fault), while a sample that is not JSON, or lacks the field, renders as "" (the sample's fault:
it scores as an empty answer).
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

_VAR = re.compile(r"\{\{(.*?)\}\}")
_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*|[0-9]+")
HELP = "use {{sample.output_text}}, {{sample.output_json.<field>}} or {{item.<field>}}"


class Template:
    def __init__(self, text: Any, where: str) -> None:
        if not isinstance(text, str):
            raise ValueError(f"{where} must be a string template, e.g. \"{{{{item.answer}}}}\"; got {text!r}")
        self.text = text
        self.where = where
        self.item_paths: list[tuple[str, ...]] = []
        for match in _VAR.finditer(text):
            self._check(match.group(1).strip())
        rest = _VAR.sub("", text)
        if "{{" in rest or "}}" in rest:
            raise ValueError(f"{where}: unbalanced '{{{{' or '}}}}' in template {text!r}; {HELP}")

    def _check(self, var: str) -> None:
        if var == "sample.output_text":
            return
        parts = var.split(".")
        if parts[:2] == ["sample", "output_json"] and all(_PART.fullmatch(p) for p in parts[2:]):
            return
        if parts[0] == "item" and len(parts) > 1 and all(_PART.fullmatch(p) for p in parts[1:]):
            self.item_paths.append(tuple(parts[1:]))
            return
        raise ValueError(f"{self.where}: unknown template variable {{{{{var}}}}}; {HELP}")

    @property
    def item_fields(self) -> set[str]:
        return {p[0] for p in self.item_paths}

    def render(self, sample_text: str, item: Mapping[str, Any]) -> str:
        def sub(match: re.Match) -> str:
            var = match.group(1).strip()
            if var == "sample.output_text":
                return sample_text
            if var.startswith("sample."):
                return _sample_json(sample_text, var.split(".")[2:])
            return _to_text(lookup(item, var.split(".")[1:], self.where))

        return _VAR.sub(sub, self.text)


def lookup(item: Any, path: list[str] | tuple[str, ...], where: str) -> Any:
    value = item
    for i, key in enumerate(path):
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif isinstance(value, (list, tuple)) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            name = ".".join(path[: i + 1])
            raise ValueError(f"dataset row has no field item.{name} (read by {where}); "
                             f"add it to every row or change the template")
    return value


def _sample_json(text: str, path: list[str]) -> str:
    """The sample's JSON (a field of it): "" when the sample is not a JSON object or array, or lacks the field."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(value, (dict, list)):
        return ""
    for key in path:
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return ""
    return _to_text(value)


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, ensure_ascii=False, default=str)
