"""``build_grader(cfg)``: validate a grader config (OpenAI names and shapes) and build it."""
from __future__ import annotations

from typing import Any

from engine.rewards.base import Grader
from engine.rewards.format import FormatGrader
from engine.rewards.math_answer import MathAnswer
from engine.rewards.model_grader import LabelModel, ScoreModel
from engine.rewards.multi import MultiGrader
from engine.rewards.python_grader import PythonGrader
from engine.rewards.rg import ReasoningGymGrader
from engine.rewards.text import StringCheck, TextSimilarity

GRADERS: dict[str, type[Grader]] = {
    g.type: g for g in (StringCheck, TextSimilarity, MathAnswer, FormatGrader, MultiGrader, ReasoningGymGrader,
                        PythonGrader, ScoreModel, LabelModel)
}
MAX_DEPTH = 4


def build_grader(cfg: dict[str, Any]) -> Grader:
    """The grader for ``cfg``; ValueError naming the bad field (``grader.<path>``) and the fix."""
    return build_at(cfg, "grader")


def build_at(cfg: Any, path: str) -> Grader:
    if path.count(".graders.") >= MAX_DEPTH:
        raise ValueError(f"{path}: multi graders nest at most {MAX_DEPTH} deep; flatten them")
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise ValueError(f"{path} must be an object with a \"type\": one of {', '.join(GRADERS)}")
    kind = cfg["type"]
    if kind not in GRADERS:
        raise ValueError(f"{path}.type must be one of {', '.join(GRADERS)}; got {kind!r}")
    return GRADERS[kind](cfg, path)
