"""qerl engine: QeRL RL fine-tuning (NVFP4 base + LoRA + GRPO/DAPO + AQN).

``from engine import TrainSpec`` stays torch-free; ``engine.train`` imports torch on first use.
"""
from engine.spec import TrainSpec
from engine.types import NullReporter, Reporter, TrainError, TrainResult


def train(spec, *, workdir, reporter, should_stop, resume_from=None):  # noqa: D401
    """Run one RL fine-tuning job; see engine.train_loop.train."""
    from engine.train_loop import train as _train

    return _train(spec, workdir=workdir, reporter=reporter, should_stop=should_stop, resume_from=resume_from)


__all__ = ["TrainSpec", "TrainResult", "TrainError", "Reporter", "NullReporter", "train"]
