"""Where a job's files live in the artifact store, and the adapter tarball.

Layout under ARTIFACT_DIR: ``jobs/<job_id>/`` (the engine's workdir: checkpoints/, adapter/),
``adapters/<adapter_id>.tar.gz`` (what ``GET /v1/adapters/{id}/content`` serves) and, for jobs
with ``keep_checkpoint_adapters``, ``checkpoints/<job_id>/<checkpoint_id>.tar.gz`` (each
checkpoint's LoRA). A workdir outlives its job by ``QERL_JOB_FILES_RETENTION_SECONDS``
(``remove_finished_workdirs``, run by every worker's maintenance pass); the tarballs stay.

With an artifact bucket (``ARTIFACT_URL``) a workdir lives on the host that runs the job, and its
``checkpoints/`` and ``best-adapters/`` directories follow it into the bucket at every checkpoint
(``push_workdir``), so a job whose host is lost resumes on another (``pull_workdir``).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.models import Job, utcnow
from service.queue import TERMINAL
from service.storage import ArtifactStore, StoreUnavailable, checkpoint_adapters_dir, open_store

log = logging.getLogger(__name__)
REMOVING = ".removing"  # suffix of a workdir being deleted (a dot name: never a job id)

REQUIRED_ADAPTER_FILES = ("adapter_config.json", "qerl_manifest.json")
SYNCED = ("checkpoints", "best-adapters")  # the workdir's folders a job resumes from, on any host
_STEP_DIR = re.compile(r"^step-\d{6,}$")  # engine.checkpoint's names (dot names are its temporaries)


def worker_store(settings: Any) -> ArtifactStore:
    """This process's artifact store, made once per setting (with a bucket, its client too): the
    runner's jobs and the periodic cleanup share it."""
    return _store_of(Path(settings.artifact_dir), settings.artifact_url, settings.artifact_cache_seconds)


@lru_cache(maxsize=8)
def _store_of(artifact_dir: Path, artifact_url: str | None, cache_seconds: float) -> ArtifactStore:
    return open_store(SimpleNamespace(artifact_dir=artifact_dir, artifact_url=artifact_url,
                                      artifact_cache_seconds=cache_seconds))


def job_workdir(artifact_dir: Path, job_id: str) -> Path:
    return Path(artifact_dir) / "jobs" / job_id


def _ended(session: Session, ids: list[str], retention_s: float) -> list[str]:
    cutoff = utcnow() - timedelta(seconds=retention_s)
    out: list[str] = []
    for i in range(0, len(ids), 500):
        out += session.execute(select(Job.id).where(
            Job.id.in_(ids[i:i + 500]), Job.status.in_(TERMINAL),
            func.coalesce(Job.finished_at, Job.created_at) <= cutoff)).scalars().all()
        session.rollback()
    return out


def remove_finished_workdirs(session: Session, store: ArtifactStore, *, retention_s: float) -> list[str]:
    """Delete the workdirs of jobs that ended (succeeded, failed, cancelled) more than
    ``retention_s`` ago: their checkpoints can no longer be resumed and their adapter is packed.
    Workdirs of unfinished jobs (paused ones included) and of ids the database does not know
    are left alone. Each is renamed to a dot name first, so a removal cut short is finished by
    the next pass and several workers at once remove each directory once; with a bucket, the
    job's pushed checkpoints there go too. Returns the job ids whose workdir this host removed."""
    root = store.root / "jobs"
    if store.remote is not None:
        try:
            for job_id in _ended(session, store.remote.names("jobs"), retention_s):
                store.remote.delete_prefix(f"jobs/{job_id}")
        except StoreUnavailable as exc:  # the next pass tries again; this host's own workdirs go meanwhile
            log.warning("finished jobs' checkpoints stay in the artifact bucket for now: %s", exc)
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:  # leftovers of a removal cut short
        if e.name.startswith(".") and e.name.endswith(REMOVING):
            shutil.rmtree(e.path, ignore_errors=True)
    names = [e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    removed: list[str] = []
    for job_id in _ended(session, names, retention_s):
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


def push_workdir(store: ArtifactStore, job_id: str, newest: str) -> None:
    """With a bucket: make its copy of the job's ``checkpoints/`` and ``best-adapters/`` what this
    host holds. ``newest`` (the checkpoint just saved, relative to the store) is always uploaded (a
    step a lost attempt had also saved is replaced); the others when the bucket lacks them; those
    this host no longer holds (pruned by the engine) leave the bucket."""
    if store.remote is None:
        return
    store.push_dir(newest)
    for sub in SYNCED:
        rel = f"jobs/{job_id}/{sub}"
        here = store.abspath(rel)
        local = {p.name for p in here.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)} if here.is_dir() else set()
        pushed = set(store.pushed_dirs(rel))
        for name in sorted(local - pushed):
            if f"{rel}/{name}" != newest:
                store.push_dir(f"{rel}/{name}")
        for name in sorted(pushed - local):
            store.drop_pushed_dir(f"{rel}/{name}")


def pull_workdir(store: ArtifactStore, job_id: str) -> None:
    """With a bucket: bring the job's pushed checkpoints and best-step adapters that this host lacks
    (the job ran elsewhere before). The newest checkpoint only: it is the one a job resumes from."""
    if store.remote is None:
        return
    for sub in SYNCED:
        rel = f"jobs/{job_id}/{sub}"
        names = [n for n in store.pushed_dirs(rel) if _STEP_DIR.match(n)]
        for name in names[-1:] if sub == "checkpoints" else names:
            store.local_dir(f"{rel}/{name}")


@dataclass
class PackedAdapter:
    path: str  # relative to ARTIFACT_DIR
    bytes: int
    sha256: str
    manifest: dict[str, Any]


def pack_adapter(adapter_dir: Path, store: ArtifactStore, name: str, *, folder: str = "adapters") -> PackedAdapter:
    """tar.gz the PEFT directory (files at the archive root) under a temp name, then rename to
    ``folder/name`` (``adapters/<adapter_id>.tar.gz``; and upload it, with a bucket), so a reader
    never sees half an archive."""
    adapter_dir = Path(adapter_dir)
    missing = [f for f in REQUIRED_ADAPTER_FILES if not (adapter_dir / f).is_file()]
    if missing:
        raise RuntimeError(f"the engine's adapter directory {adapter_dir.name}/ lacks {', '.join(missing)}")
    manifest = json.loads((adapter_dir / "qerl_manifest.json").read_text())
    staged = store.pack(adapter_dir)
    try:
        blob = staged.publish(f"{folder}/{name}")
    finally:
        staged.discard()  # a no-op once published
    return PackedAdapter(path=blob.path, bytes=blob.bytes, sha256=blob.sha256, manifest=manifest)


def pack_checkpoint_adapter(adapter_dir: Path, store: ArtifactStore, job_id: str, checkpoint_id: str) -> PackedAdapter:
    """A checkpoint's PEFT directory as ``checkpoints/<job_id>/<checkpoint_id>.tar.gz`` (the same
    archive as a checkpoint download packed from the workdir: the same bytes, the same sha256)."""
    return pack_adapter(adapter_dir, store, f"{checkpoint_id}.tar.gz",
                        folder=checkpoint_adapters_dir(job_id))


def cleanup(session: Session, settings: Any) -> None:
    """The maintenance pass's slow part (every ``cleanup_interval_seconds``): finished jobs'
    workdirs past their retention, and webhook events past theirs."""
    from worker import webhooks

    remove_finished_workdirs(session, worker_store(settings), retention_s=settings.job_files_retention_seconds)
    webhooks.prune(session)
