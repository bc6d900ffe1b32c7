"""Prompt data: JSONL uploads and reasoning-gym tasks as chat ``Example``s. Torch-free."""
from engine.data.load import Example, load_examples, split_eval

__all__ = ["Example", "load_examples", "split_eval"]
