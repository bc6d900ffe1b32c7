"""Training checkpoints: everything a run needs to continue bit for bit after a restart.

A checkpoint is one directory, ``<workdir>/checkpoints/step-000005/``:

    adapter.safetensors  LoRA weights (engine.lora.adapter_state_dict)
    optimizer.pt         optimizer and LR-scheduler state dicts
    rng.pt               torch CPU/CUDA, python ``random``, and the named generators
                         (rollout sampling, AQN noise)
    state.json           step, data cursor (epoch, position), AQN state, last metrics
    spec.json            the TrainSpec the run was started with
    adapter/             the LoRA at this step as a PEFT adapter with its manifest (what the
                         training loop adds; the API serves it as the checkpoint's download)

It is written into a hidden sibling directory, every file and the directory fsynced, then
renamed into place, so a crash leaves the previous checkpoint or the new one, never half of
one. Only the newest ``keep`` checkpoints stay on disk; ``keep_adapter`` keeps a checkpoint's
``adapter/`` beyond that, as ``<workdir>/checkpoint-adapters/step-000005/`` (hard links).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^step-(\d{6,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass
class Checkpoint:
    path: Path
    step: int
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    state: dict[str, Any]
    spec: dict[str, Any]


# -- RNG ----------------------------------------------------------------------------------
def capture_rng(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """Every random stream the run draws from, as tensors and lists (loadable with weights_only)."""
    rng: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "python": _python_state_to_list(random.getstate()),
        "generators": {name: g.get_state() for name, g in generators.items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["torch_cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(rng["torch_cpu"])
    random.setstate(_python_state_from_list(rng["python"]))
    if "torch_cuda" in rng and torch.cuda.is_available():
        states = rng["torch_cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    missing = sorted(set(generators) - set(rng["generators"]))
    if missing:
        raise ValueError(f"checkpoint has no state for generator(s) {', '.join(missing)}")
    for name, g in generators.items():
        g.set_state(rng["generators"][name])


def _python_state_to_list(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_state_from_list(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


# -- write --------------------------------------------------------------------------------
def save_checkpoint(root: Path, step: int, *, adapter: dict[str, torch.Tensor], optimizer: dict[str, Any],
                    scheduler: dict[str, Any], rng: dict[str, Any], state: dict[str, Any],
                    spec: dict[str, Any], keep: int = 2, extra: Callable[[Path], Any] | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; prune to the newest ``keep``.
    ``extra(dir)`` writes more into the checkpoint before it is published (its PEFT adapter)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}
        save_file(tensors, str(tmp / "adapter.safetensors"))
        torch.save({"optimizer": optimizer, "scheduler": scheduler}, tmp / "optimizer.pt")
        torch.save(rng, tmp / "rng.pt")
        _write_json(tmp / "state.json", {"step": step, **state})
        _write_json(tmp / "spec.json", spec)
        if extra is not None:
            extra(tmp)
        for f in tmp.rglob("*"):
            _fsync_file(f)
        _fsync_dir(tmp)
    except BaseException:  # a full disk, say: give the space of the partial copy back at once
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # the same step saved again (stop right after a resume): replace it
        trash = root / f".old-{final.name}-{os.getpid()}"
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    prune(root, keep)
    return final


def keep_adapter(checkpoint: Path, dest_root: Path) -> Path:
    """Keep ``checkpoint``'s PEFT adapter after the checkpoint is pruned: its files hard-linked
    (copied where links are not possible) into ``dest_root/<checkpoint name>/``, published by a
    rename like a checkpoint. Returns that directory."""
    src, dest_root = Path(checkpoint) / "adapter", Path(dest_root)
    dest_root.mkdir(parents=True, exist_ok=True)
    final = dest_root / Path(checkpoint).name
    tmp = dest_root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        _fsync_dir(tmp)
        if final.exists():  # the same step kept again (a resumed run): the newer one wins
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(dest_root)
    return final


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints and leftovers of interrupted writes."""
    for p in Path(root).iterdir():
        if p.name.startswith((".tmp-", ".old-")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    for p in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True, default=_json_default))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint's JSON")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# -- read ---------------------------------------------------------------------------------
def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint directory (or ``checkpoints/``: its newest one)."""
    path = Path(path)
    if path.is_dir() and not (path / "state.json").exists():
        newest = latest_checkpoint(path)
        if newest is None:
            raise FileNotFoundError(f"no checkpoint in {path}")
        path = newest
    for name in ("adapter.safetensors", "optimizer.pt", "rng.pt", "state.json", "spec.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint: {name} is missing")
    opt = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    state = json.loads((path / "state.json").read_text())
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        adapter=load_file(str(path / "adapter.safetensors")),
        optimizer=opt["optimizer"],
        scheduler=opt["scheduler"],
        rng=torch.load(path / "rng.pt", map_location="cpu", weights_only=True),
        state=state,
        spec=json.loads((path / "spec.json").read_text()),
    )
