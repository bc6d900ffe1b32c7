"""What the engine hands back to its caller: the Reporter protocol, TrainResult, TrainError,
and how to tell the two resource failures a user can fix (memory, disk) from other errors."""
from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


# what a step's event and watch line say of a step without an update (metric ``updates_skipped``:
# dynamic sampling kept no group, every group's samples having scored alike)
NO_UPDATE = "no update: every group's samples scored alike"


class Reporter(Protocol):
    """Receives progress from ``engine.train``. The worker's reporter writes to the database
    and raises ``LeaseLost`` (from any method) when this worker no longer owns the job; the
    engine lets that exception propagate."""

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None: ...

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None: ...

    # optional: a reporter may also take ``samples(step, kind, rows)`` (engine.metrics.sample_rows)


class NullReporter:
    """Collects everything in memory (CLI and tests)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any] | None]] = []
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.checkpoints: list[tuple[int, Path]] = []
        self.samples_seen: list[tuple[int, str, list[dict[str, Any]]]] = []

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.events.append((level, message, data))

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.steps.append((step, dict(values)))

    def checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        self.checkpoints.append((step, Path(path)))

    def samples(self, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
        self.samples_seen.append((step, kind, rows))


@dataclass
class TrainResult:
    adapter_dir: Path  # PEFT directory + qerl_manifest.json
    steps: int  # optimizer steps completed
    metrics: dict[str, float] = field(default_factory=dict)  # final metrics (incl. eval)
    stopped: bool = False  # True when should_stop() ended the run early (cancel / shutdown)


class TrainError(ValueError):
    """A job failure a user can act on. ``code`` is stored on the job (e.g. "invalid_dataset",
    "unknown_model", "invalid_spec", "out_of_memory", "disk_full", "max_runtime_exceeded")."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class GraderUnavailable(TrainError):
    """A judge model stayed unreachable: the run saved a checkpoint (``checkpoint``) and stopped,
    to be resumed once the judge is back (the service pauses the job)."""

    def __init__(self, message: str, checkpoint: Path) -> None:
        super().__init__("grader_unavailable", message)
        self.checkpoint = checkpoint


OOM_ADVICE = ("The job ran out of memory. Lower micro_batch_size, rollout.max_batch, rollout.max_new_tokens or "
              "rollout.num_generations, keep gradient_checkpointing on, or use a smaller model.")

# torch's CPU allocator and CUDA raise RuntimeError subclasses; safetensors and torch.save report a
# full disk as text (SafetensorError "StorageFull", "file write failed"), not always as OSError.
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")
_DISK_FULL_TEXT = ("no space left on device", "storagefull", "disk quota exceeded")


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """exc, then its cause or context, and so on (each once)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, torch.cuda.OutOfMemoryError, or an allocator's ENOMEM, anywhere in the chain."""
    for e in exception_chain(exc):
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
            return True
        if isinstance(e, OSError) and e.errno == errno.ENOMEM:
            return True
        if isinstance(e, RuntimeError) and any(t in str(e).lower() for t in _OOM_TEXT):
            return True
    return False


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT anywhere in the chain (or the text libraries that wrap them use)."""
    for e in exception_chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(e).lower() for t in _DISK_FULL_TEXT):
            return True
    return False
