"""Artifact store on the local disk (a shared mount when workers run on other hosts).

Everything is written under ``tmp/`` first and renamed into place, so a reader never sees half a
file and a failed or oversized upload leaves nothing behind. The sha256 is computed while
streaming, stored with the row, and checked again before a download is served (``verified``),
so a truncated or bit-rotted artifact is refused instead of handed out. Paths stored in the
database are relative to the store's root.

Layout: ``files/<file-id>.jsonl`` (written here); ``jobs/<job-id>/`` (a job's workdir) and
``adapters/<adapter-id>.tar.gz`` (written by the worker, ``worker.artifacts``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)
CHUNK = 1024 * 1024


class Corrupt(Exception):
    """The bytes on disk no longer hash to the sha256 recorded when they were written."""


class TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"larger than {limit} bytes")
        self.limit = limit


@dataclass
class Blob:
    path: str  # relative to the store root
    bytes: int
    sha256: str


@dataclass
class Staged:
    """Bytes written to a temporary name, not yet visible."""

    store: "ArtifactStore"
    tmp: Path
    bytes: int
    sha256: str

    def publish(self, rel: str) -> Blob:
        dest = self.store.abspath(rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, dest)
        return Blob(rel, self.bytes, self.sha256)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def checkpoint_adapters_dir(job_id: str) -> str:
    """Where a job's kept checkpoint LoRAs lie (qerl.keep_checkpoint_adapters), relative to the store."""
    return f"checkpoints/{job_id}"


def iter_chunks(fh: BinaryIO, size: int = CHUNK) -> Iterator[bytes]:
    while chunk := fh.read(size):
        yield chunk


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.tmp_dir = self.root / "tmp"
        self._verified: dict[Path, tuple[int, int, str]] = {}  # path -> (size, mtime_ns, sha256) that matched

    def ensure(self) -> None:
        for sub in ("tmp", "files", "jobs", "adapters"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def abspath(self, rel: str) -> Path:
        path = (self.root / rel).resolve()
        if self.root not in path.parents:
            raise ValueError(f"artifact path {rel!r} leaves the artifact directory")
        return path

    def _tmp_path(self) -> Path:
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        return self.tmp_dir / f"{int(time.time())}-{secrets.token_hex(8)}.part"

    def stage(self, chunks: Iterable[bytes], *, max_bytes: int | None = None) -> Staged:
        """Write ``chunks`` to a temporary file, hashing; TooLarge (and no file) past ``max_bytes``."""
        tmp = self._tmp_path()
        digest, total = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as fh:
                for chunk in chunks:
                    total += len(chunk)
                    if max_bytes is not None and total > max_bytes:
                        raise TooLarge(max_bytes)
                    digest.update(chunk)
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return Staged(self, tmp, total, digest.hexdigest())

    def pack(self, src: Path) -> Staged:
        """A tar.gz of the files under ``src`` (sorted, named relative to it: a PEFT directory's
        files at the archive root) in a temporary file, fsynced and hashed. The same files give
        the same bytes (no time in the gzip header). Deflate stores the bytes as they are: trained
        float weights shrink by ~7% at any level while compressing them runs ~35 MB/s, storing them
        ~270 MB/s (a kept checkpoint's LoRA is packed while its job waits)."""
        import gzip
        import tarfile

        src = Path(src)
        tmp = self._tmp_path()
        try:
            with open(tmp, "wb") as raw:
                with gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=0) as gz:  # same files: same bytes
                    with tarfile.open(fileobj=gz, mode="w") as tar:
                        for f in sorted(p for p in src.rglob("*") if p.is_file()):
                            tar.add(f, arcname=str(f.relative_to(src)))
                raw.flush()
                os.fsync(raw.fileno())
            digest = hashlib.sha256()
            with open(tmp, "rb") as fh:
                for chunk in iter_chunks(fh):
                    digest.update(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return Staged(self, tmp, tmp.stat().st_size, digest.hexdigest())

    def verified(self, rel: str, sha256: str) -> Path:
        """The path of ``rel`` once its bytes hash to ``sha256``; FileNotFoundError or Corrupt otherwise.

        A file is hashed again only when its size or mtime changed since it last matched."""
        path = self.abspath(rel)
        st = path.stat()  # FileNotFoundError when it is gone
        stamp = (st.st_size, st.st_mtime_ns, sha256)
        if self._verified.get(path) == stamp:
            return path
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter_chunks(fh):
                digest.update(chunk)
        if digest.hexdigest() != sha256:
            self._verified.pop(path, None)
            raise Corrupt(f"{rel}: sha256 {digest.hexdigest()} on disk, {sha256} recorded")
        if len(self._verified) >= 4096:
            self._verified.clear()
        self._verified[path] = stamp
        return path

    def delete(self, rel: str) -> None:
        self.abspath(rel).unlink(missing_ok=True)

    def delete_tree(self, rel: str) -> None:
        shutil.rmtree(self.abspath(rel), ignore_errors=True)

    def sweep_tmp(self, older_than_s: float = 3600.0) -> int:
        """Remove temporary files left by a crash; returns how many."""
        if not self.tmp_dir.exists():
            return 0
        cutoff, removed = time.time() - older_than_s, 0
        for path in self.tmp_dir.iterdir():
            if path.is_file() and path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
                removed += 1
        return removed


def verified_artifact(store: ArtifactStore, rel: str, sha256: str, what: str) -> Path:
    """``store.verified`` for a download: a missing or corrupt artifact answers 503 (a server-side
    fault the operator must see), never a 500 or bytes that differ from the recorded sha256."""
    from service.errors import APIError

    try:
        return store.verified(rel, sha256)
    except (FileNotFoundError, IsADirectoryError):
        raise APIError(503, f"The bytes of {what} are missing from the artifact store; check that ARTIFACT_DIR is "
                            "the same on the API and the workers.", code="artifact_missing") from None
    except Corrupt as exc:
        log.error("refusing to serve a corrupt artifact: %s", exc)
        raise APIError(503, f"The stored bytes of {what} no longer match the sha256 recorded when they were "
                            "written; it was not sent. Restore it from a backup or create it again.",
                       code="artifact_corrupt") from None
