"""Rollouts: sample completions from the policy (native KV-cache sampler)."""
from engine.rollout.native import generate
from engine.rollout.params import Completion, SamplingParams

__all__ = ["SamplingParams", "Completion", "generate"]
