"""Where a job's files live in the artifact store, and the adapter tarball.

Layout under ARTIFACT_DIR: ``jobs/<job_id>/`` (the engine's workdir: checkpoints/, adapter/),
``adapters/<adapter_id>.tar.gz`` (what ``GET /v1/adapters/{id}/content`` serves) and, for jobs
with ``keep_checkpoint_adapters``, ``checkpoints/<job_id>/<checkpoint_id>.tar.gz`` (each
checkpoint's LoRA). A workdir outlives its job by ``QERL_JOB_FILES_RETENTION_SECONDS``
(``remove_finished_workdirs``, run by every worker's maintenance pass); the tarballs stay.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.models import Job, utcnow
from service.queue import TERMINAL
from service.storage import ArtifactStore, checkpoint_adapters_dir

log = logging.getLogger(__name__)
REMOVING = ".removing"  # suffix of a workdir being deleted (a dot name: never a job id)

REQUIRED_ADAPTER_FILES = ("adapter_config.json", "qerl_manifest.json")


def job_workdir(artifact_dir: Path, job_id: str) -> Path:
    return Path(artifact_dir) / "jobs" / job_id


def remove_finished_workdirs(session: Session, artifact_dir: Path, *, retention_s: float) -> list[str]:
    """Delete the workdirs of jobs that ended (succeeded, failed, cancelled) more than
    ``retention_s`` ago: their checkpoints can no longer be resumed and their adapter is packed.
    Workdirs of unfinished jobs (paused ones included) and of ids the database does not know
    are left alone. Each is renamed to a dot name first, so a removal cut short is finished by
    the next pass and several workers at once remove each directory once. Returns the job ids."""
    root = Path(artifact_dir) / "jobs"
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:  # leftovers of a removal cut short
        if e.name.startswith(".") and e.name.endswith(REMOVING):
            shutil.rmtree(e.path, ignore_errors=True)
    names = [e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    cutoff = utcnow() - timedelta(seconds=retention_s)
    removed: list[str] = []
    for i in range(0, len(names), 500):
        ended = session.execute(select(Job.id).where(
            Job.id.in_(names[i:i + 500]), Job.status.in_(TERMINAL),
            func.coalesce(Job.finished_at, Job.created_at) <= cutoff)).scalars().all()
        session.rollback()
        for job_id in ended:
            doomed = root / f".{job_id}{REMOVING}"
            try:
                os.rename(root / job_id, doomed)
            except FileNotFoundError:  # another worker took it
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(job_id)
    if removed:
        log.info("removed the workdirs of %d finished jobs: %s", len(removed), ", ".join(removed[:20]))
    return removed


@dataclass
class PackedAdapter:
    path: str  # relative to ARTIFACT_DIR
    bytes: int
    sha256: str
    manifest: dict[str, Any]


def pack_adapter(adapter_dir: Path, artifact_dir: Path, name: str, *, folder: str = "adapters") -> PackedAdapter:
    """tar.gz the PEFT directory (files at the archive root) under a temp name, then rename to
    ``folder/name`` (``adapters/<adapter_id>.tar.gz``), so a reader never sees half an archive."""
    adapter_dir = Path(adapter_dir)
    missing = [f for f in REQUIRED_ADAPTER_FILES if not (adapter_dir / f).is_file()]
    if missing:
        raise RuntimeError(f"the engine's adapter directory {adapter_dir.name}/ lacks {', '.join(missing)}")
    manifest = json.loads((adapter_dir / "qerl_manifest.json").read_text())
    blob = ArtifactStore(artifact_dir).pack(adapter_dir).publish(f"{folder}/{name}")
    return PackedAdapter(path=blob.path, bytes=blob.bytes, sha256=blob.sha256, manifest=manifest)


def pack_checkpoint_adapter(adapter_dir: Path, artifact_dir: Path, job_id: str, checkpoint_id: str) -> PackedAdapter:
    """A checkpoint's PEFT directory as ``checkpoints/<job_id>/<checkpoint_id>.tar.gz`` (the same
    archive as a checkpoint download packed from the workdir: the same bytes, the same sha256)."""
    return pack_adapter(adapter_dir, artifact_dir, f"{checkpoint_id}.tar.gz",
                        folder=checkpoint_adapters_dir(job_id))


def cleanup(session: Session, settings: Any) -> None:
    """The maintenance pass's slow part (every ``cleanup_interval_seconds``): finished jobs'
    workdirs past their retention, and webhook events past theirs."""
    from worker import webhooks

    remove_finished_workdirs(session, settings.artifact_dir, retention_s=settings.job_files_retention_seconds)
    webhooks.prune(session)
