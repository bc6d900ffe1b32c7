"""format: a regular expression over the sample (DOTALL), scoring ``weight`` on a match, else 0."""
from __future__ import annotations

import re
from typing import Any, Mapping

from engine.rewards.base import Grader, check_fields, get_number, get_str, grader_name
from engine.rewards.templates import Template

MAX_PATTERN = 2000


class FormatGrader(Grader):
    type = "format"

    def __init__(self, cfg: dict, path: str) -> None:
        check_fields(cfg, path, required=("pattern",), optional=("input", "match", "weight"))
        super().__init__(grader_name(cfg, path))
        self.input = Template(cfg.get("input", "{{sample.output_text}}"), f"{path}.input")
        pattern = get_str(cfg, "pattern", path)
        if len(pattern) > MAX_PATTERN:
            raise ValueError(f"{path}.pattern is longer than {MAX_PATTERN} characters; shorten it")
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"{path}.pattern is not a valid regular expression ({exc}); fix the pattern") from None
        self.match = get_str(cfg, "match", path, default="fullmatch", choices=("fullmatch", "search"))
        self.weight = get_number(cfg, "weight", path, default=1.0)
        self.item_fields = self.input.item_fields

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        text = self.input.render(sample_text, item)
        hit = self.regex.fullmatch(text) if self.match == "fullmatch" else self.regex.search(text)
        return self.weight if hit else 0.0
