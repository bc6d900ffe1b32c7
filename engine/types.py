"""What the engine hands back to its caller: the Reporter protocol and TrainResult."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Reporter(Protocol):
    """Receives progress from ``engine.train``. The worker's reporter writes to the database
    and raises ``LeaseLost`` (from any method) when this worker no longer owns the job; the
    engine lets that exception propagate."""

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None: ...

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None: ...


class NullReporter:
    """Collects everything in memory (CLI and tests)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any] | None]] = []
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.checkpoints: list[tuple[int, Path]] = []

    def event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.events.append((level, message, data))

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.steps.append((step, dict(values)))

    def checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        self.checkpoints.append((step, Path(path)))


@dataclass
class TrainResult:
    adapter_dir: Path  # PEFT directory + qerl_manifest.json
    steps: int  # optimizer steps completed
    metrics: dict[str, float] = field(default_factory=dict)  # final metrics (incl. eval)
    stopped: bool = False  # True when should_stop() ended the run early (cancel / shutdown)


class TrainError(ValueError):
    """A job failure a user can act on. ``code`` is stored on the job (e.g. "invalid_dataset",
    "unknown_model", "out_of_memory", "max_runtime_exceeded")."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
