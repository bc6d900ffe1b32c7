"""Where a job's files live in the artifact store, and the adapter tarball.

Layout under ARTIFACT_DIR: ``jobs/<job_id>/`` (the engine's workdir: checkpoints/, adapter/)
and ``adapters/<adapter_id>.tar.gz`` (what ``GET /v1/adapters/{id}/content`` serves).
"""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED_ADAPTER_FILES = ("adapter_config.json", "qerl_manifest.json")


def job_workdir(artifact_dir: Path, job_id: str) -> Path:
    return Path(artifact_dir) / "jobs" / job_id


@dataclass
class PackedAdapter:
    path: str  # relative to ARTIFACT_DIR
    bytes: int
    sha256: str
    manifest: dict[str, Any]


def pack_adapter(adapter_dir: Path, artifact_dir: Path, adapter_id: str) -> PackedAdapter:
    """tar.gz the PEFT directory (files at the archive root) under a temp name, then rename,
    so a reader never sees half an archive."""
    adapter_dir = Path(adapter_dir)
    missing = [f for f in REQUIRED_ADAPTER_FILES if not (adapter_dir / f).is_file()]
    if missing:
        raise RuntimeError(f"the engine's adapter directory {adapter_dir.name}/ lacks {', '.join(missing)}")
    manifest = json.loads((adapter_dir / "qerl_manifest.json").read_text())
    out_dir = Path(artifact_dir) / "adapters"
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{adapter_id}.tar.gz"
    tmp = out_dir / f".{adapter_id}.tar.gz.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w:gz") as tar:
                for f in sorted(p for p in adapter_dir.rglob("*") if p.is_file()):
                    tar.add(f, arcname=str(f.relative_to(adapter_dir)))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    digest = hashlib.sha256()
    with open(final, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return PackedAdapter(path=str(final.relative_to(artifact_dir)), bytes=final.stat().st_size,
                         sha256=digest.hexdigest(), manifest=manifest)
