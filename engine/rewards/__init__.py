"""Reward graders by OpenAI's names and shapes (plus math_answer, format, reasoning_gym).

Torch-free, so the service can validate a job's grader with ``build_grader`` before queueing.
"""
from engine.rewards.base import Grader
from engine.rewards.build import GRADERS, build_grader

__all__ = ["Grader", "GRADERS", "build_grader"]
