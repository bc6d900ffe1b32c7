"""multi: named sub-graders combined by an arithmetic ``calculate_output`` expression."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Mapping, Sequence

from engine.rewards.base import Grader, check_fields, grader_name
from engine.rewards.expr import Expression

MAX_GRADERS = 32


class MultiGrader(Grader):
    type = "multi"

    def __init__(self, cfg: dict, path: str) -> None:
        from engine.rewards.build import build_at  # the sub-graders may be of any type

        check_fields(cfg, path, required=("graders", "calculate_output"))
        super().__init__(grader_name(cfg, path))
        graders = cfg["graders"]
        if not isinstance(graders, dict) or not graders or len(graders) > MAX_GRADERS:
            raise ValueError(f"{path}.graders must be an object of 1 to {MAX_GRADERS} named graders, "
                             "e.g. {\"format\": {...}, \"answer\": {...}}")
        for key in graders:
            if not isinstance(key, str) or not key.isidentifier() or key in ("min", "max"):
                raise ValueError(f"{path}.graders: name {key!r} must be an identifier (letters, digits, _) "
                                 "other than min/max, so calculate_output can refer to it")
        self.graders = {key: build_at(sub, f"{path}.graders.{key}") for key, sub in graders.items()}
        self.expression = Expression(cfg["calculate_output"], set(self.graders), f"{path}.calculate_output")
        self.item_fields = set().union(*(g.item_fields for g in self.graders.values()))

    def __call__(self, sample_text: str, item: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        return self.batch([sample_text], [item])[0]

    def batch(self, texts: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[tuple[float, dict[str, float]]]:
        """Each sub-grader over all the samples (a model grader's requests then run together)."""
        by_grader = {key: grader.batch(texts, items) for key, grader in self.graders.items()}
        out = []
        for k in range(len(texts)):
            parts: dict[str, float] = {}
            values: dict[str, float] = {}
            for key, grader in self.graders.items():
                score, sub_parts = by_grader[key][k]
                values[key] = score
                parts[key] = score
                if isinstance(grader, MultiGrader):
                    parts.update({f"{key}.{k2}": v for k2, v in sub_parts.items()})
            out.append((self.expression.evaluate(values), parts))
        return out

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        return self(sample_text, item)[0]


def leaves(grader: Grader) -> Iterator[Grader]:
    """The graders that score by themselves: ``grader``, or every one inside a multi grader (depth first)."""
    if isinstance(grader, MultiGrader):
        for sub in grader.graders.values():
            yield from leaves(sub)
    else:
        yield grader
