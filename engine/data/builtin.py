"""Built-in prompt sources: reasoning-gym procedural tasks (deterministic given their seed)."""
from __future__ import annotations

from typing import Any

from engine.types import TrainError

DATASET_FIELDS = ("source", "task", "size", "seed", "config")
SHOT_SEED_OFFSET = 1_000_003  # the one-shot example comes from another stream than the data


def _create(task: str, size: int, seed: int, config: dict[str, Any]):
    try:
        import reasoning_gym  # imported on use: ~1 s and many modules
    except ImportError as exc:  # the package, or one it imports, missing where the job runs
        raise TrainError("dataset_unavailable", f"data.dataset's source reasoning_gym cannot be imported here "
                                                f"({exc}); install the project's dependencies where the job runs, "
                                                "or give the prompts as a training_file") from None

    if task not in reasoning_gym.factory.DATASETS:
        raise TrainError("invalid_dataset", f"data.dataset.task {task!r} is not a reasoning-gym task; pick one of "
                                            f"{', '.join(sorted(reasoning_gym.factory.DATASETS))}")
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise TrainError("invalid_dataset", f"data.dataset.config is not valid for {task!r}: {exc}; "
                                            "use the fields of the task's reasoning-gym config class") from None


def _config(dataset: dict[str, Any]) -> dict[str, Any]:
    """The task's config of a ``data.dataset`` record, after checking the record's own fields."""
    unknown = sorted(set(dataset) - set(DATASET_FIELDS))
    if unknown:
        raise TrainError("invalid_dataset",
                         f"data.dataset.{unknown[0]} is not a field; allowed: {', '.join(DATASET_FIELDS)}")
    config = dataset.get("config") or {}
    if not isinstance(config, dict):
        raise TrainError("invalid_dataset", "data.dataset.config must be an object of the task's config fields")
    for key in ("size", "seed"):
        if key in config:
            raise TrainError("invalid_dataset", f"data.dataset.config.{key}: set data.dataset.{key} instead")
    return dict(config)


def check_dataset(dataset: dict[str, Any]) -> None:
    """What ``reasoning_gym_entries`` would reject (fields, task name, the task's config), found
    by building one item, so that a job is refused when it is created rather than when it runs."""
    _create(dataset["task"], 1, int(dataset.get("seed", 0)), _config(dataset))


def reasoning_gym_entries(dataset: dict[str, Any], seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return (entries, one-shot entry). Each entry is reasoning-gym's dict plus ``task``.

    ``dataset.seed`` defaults to the job seed; the one-shot example is drawn from a separate
    seed and, where the task allows, is a question not among the entries."""
    config = _config(dataset)
    task, size = dataset["task"], int(dataset.get("size", 200))
    ds_seed = int(dataset.get("seed", seed))
    ds = _create(task, size, ds_seed, config)
    entries = [dict(ds[i], task=task) for i in range(size)]
    questions = {e["question"] for e in entries}
    pool = _create(task, 64, ds_seed + SHOT_SEED_OFFSET, config)
    candidates = [dict(pool[i], task=task) for i in range(len(pool))]
    shot = next((c for c in candidates if c["question"] not in questions), candidates[0])
    return entries, shot
