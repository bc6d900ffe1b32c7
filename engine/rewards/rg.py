"""reasoning_gym: score with the task's own ``score_answer(answer, entry)``.

The item is the reasoning-gym entry (question, answer, metadata). The task comes from the
grader's ``task`` field, else the item's ``task`` field, else ``metadata.source_dataset``.
The answer is taken from the sample's last <answer>...</answer> (reasoning-gym's own
``extract_answer``); no tags means no answer, which every task scores 0.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

from engine.rewards.base import Grader, check_fields, get_str, grader_name
from engine.rewards.math_answer import ANSWER_TAG
from engine.rewards.templates import Template


def _extract(text: str) -> str | None:
    try:
        from reasoning_gym.utils import extract_answer
    except ImportError:  # older releases: same rule, last tag wins
        tags = ANSWER_TAG.findall(text)
        return tags[-1].strip() if tags else None
    return extract_answer(text)


@functools.lru_cache(maxsize=None)
def scorer(task: str) -> Callable[..., float]:
    """The task's bound ``score_answer``; ValueError for an unknown task."""
    import reasoning_gym

    if task not in reasoning_gym.factory.DATASETS:
        raise ValueError(f"unknown reasoning-gym task {task!r}; pick one of "
                         f"{', '.join(sorted(reasoning_gym.factory.DATASETS))}")
    return reasoning_gym.get_score_answer_fn(task)


class ReasoningGymGrader(Grader):
    type = "reasoning_gym"

    def __init__(self, cfg: dict, path: str) -> None:
        check_fields(cfg, path, optional=("task", "input"))
        super().__init__(grader_name(cfg, path))
        self.input = Template(cfg.get("input", "{{sample.output_text}}"), f"{path}.input")
        self.task = get_str(cfg, "task", path) if "task" in cfg else None
        if self.task is not None:
            try:
                scorer(self.task)
            except ValueError as exc:
                raise ValueError(f"{path}.task: {exc}") from None
        self.item_fields = self.input.item_fields | {"answer"}

    def task_of(self, item: Mapping[str, Any]) -> str:
        task = self.task or item.get("task") or (item.get("metadata") or {}).get("source_dataset")
        if not isinstance(task, str):
            raise ValueError("reasoning_gym grader: the dataset row names no task; set grader.task or give "
                             "rows a \"task\" field (or metadata.source_dataset)")
        return task

    def check_item(self, item: Mapping[str, Any]) -> str | None:
        if self.task is not None:
            return None
        try:
            scorer(self.task_of(item))
        except ValueError as exc:
            return str(exc)
        return None

    def check_field_counts(self, counts: Mapping[str, int], rows: int) -> str | None:
        named = counts.get("task", 0) + counts.get("metadata", 0)
        if self.task is not None or named >= rows:
            return None
        return (f"the reasoning_gym grader {self.name!r} has no task, so every row must name one (a \"task\" field "
                f"or metadata.source_dataset): {counts.get('task', 0)} of {rows} rows have \"task\", "
                f"{counts.get('metadata', 0)} have \"metadata\"; set the grader's task, or give every row a task")

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        if "answer" not in item:
            raise ValueError("reasoning_gym grader: the dataset row has no \"answer\" field; rows must be "
                             "reasoning-gym entries (question, answer, metadata)")
        score_answer = scorer(self.task_of(item))
        answer = _extract(self.input.render(sample_text, item))
        try:
            return float(score_answer(answer=answer, entry=dict(item)))
        except Exception:  # a garbled answer some task's parser chokes on scores 0, it must not end the run
            return 0.0
