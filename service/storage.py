"""Artifact store: the local disk (a shared mount when workers run on other hosts), or that disk
as a cache of an S3-compatible bucket (``ARTIFACT_URL=s3://bucket/prefix``, ``service.storage_s3``).

Everything is written under ``tmp/`` first and renamed into place, so a reader never sees half a
file and a failed or oversized upload leaves nothing behind. The sha256 is computed while
streaming, stored with the row, and checked again before a download is served (``verified``),
so a truncated or bit-rotted artifact is refused instead of handed out. Paths stored in the
database are relative to the store's root.

Layout: ``files/<file-id>.jsonl`` (written here); ``jobs/<job-id>/`` (a job's workdir) and
``adapters/<adapter-id>.tar.gz`` (written by the worker, ``worker.artifacts``).

With a bucket, the bucket holds every artifact under the same relative names and each host's
directory is a cache: ``publish`` writes the file here and uploads it before it is named in the
database, ``verified`` fetches a file this host lacks (and fetches again a cached copy that no
longer hashes right), deletions reach both. A job's workdir stays on the host that runs it; its
checkpoints and best-step adapters are uploaded as one tar object per directory
(``jobs/<id>/checkpoints/step-000004.tar``: an object appears whole or not at all), so another host
resumes the job, or serves a checkpoint's LoRA, from them (``push_dir``, ``local_dir``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

log = logging.getLogger(__name__)
CHUNK = 1024 * 1024


class Corrupt(Exception):
    """The bytes on disk no longer hash to the sha256 recorded when they were written."""


class StoreUnavailable(Exception):
    """The artifact bucket did not answer, or refused (not a missing object: FileNotFoundError)."""


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
        """Rename into place (and upload, with a bucket): when it returns, every host can read it."""
        dest = self.store.abspath(rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, dest)
        if self.store.remote is not None:
            try:
                self.store.remote.upload(dest, rel, self.sha256)
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
        return Blob(rel, self.bytes, self.sha256)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def checkpoint_adapters_dir(job_id: str) -> str:
    """Where a job's kept checkpoint LoRAs lie (qerl.keep_checkpoint_adapters), relative to the store."""
    return f"checkpoints/{job_id}"


def _add_tree(tar: Any, src: Path) -> None:
    """The files under ``src`` into ``tar``, sorted, named relative to it (the same files: the same archive)."""
    for f in sorted(p for p in Path(src).rglob("*") if p.is_file()):
        tar.add(f, arcname=str(f.relative_to(src)))


def iter_chunks(fh: BinaryIO, size: int = CHUNK) -> Iterator[bytes]:
    while chunk := fh.read(size):
        yield chunk


class Remote(Protocol):
    """Where a bucket-backed store keeps the artifacts (service.storage_s3.S3Remote)."""

    url: str

    def upload(self, local: Path, rel: str, sha256: str | None = None) -> None: ...
    def download(self, rel: str, dest: Path) -> None: ...  # FileNotFoundError when there is no such object
    def delete(self, rel: str) -> None: ...
    def delete_prefix(self, rel: str) -> None: ...
    def names(self, rel: str) -> list[str]: ...  # the names directly under rel/ (objects and "folders")
    def check(self) -> None: ...


class ArtifactStore:
    def __init__(self, root: Path, remote: Remote | None = None, *, cache_seconds: float = 86400.0) -> None:
        self.root = Path(root).expanduser().resolve()
        self.tmp_dir = self.root / "tmp"
        self.remote, self.cache_seconds = remote, cache_seconds
        self._next_sweep = 0.0  # monotonic time of the next sweep_cache a fetch runs
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
                        _add_tree(tar, src)
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

        A file is hashed again only when its size or mtime changed since it last matched. With a
        bucket, a file this host lacks is fetched first, and a cached copy that does not match is
        fetched again (the bucket is the truth)."""
        path = self.abspath(rel)
        try:
            self._verified_here(rel, sha256, path)
        except (FileNotFoundError, Corrupt):
            if self.remote is None:
                raise
            self._fetch(rel, path)
            self._verified_here(rel, sha256, path)
        if self.remote is not None:
            self._used(path, sha256)
        return path

    def _used(self, path: Path, sha256: str) -> None:
        """A cached copy just read counts as fresh for sweep_cache (its mtime is "last used"), so a
        copy about to be served is not swept; touched at most every quarter of the cache period."""
        st = path.stat()
        if time.time() - st.st_mtime > self.cache_seconds / 4:
            os.utime(path)
            self._verified[path] = (st.st_size, path.stat().st_mtime_ns, sha256)  # the same bytes

    def _fetch(self, rel: str, path: Path) -> None:
        if time.monotonic() >= self._next_sweep:  # fetches are what grow the cache: they keep it swept
            self._next_sweep = time.monotonic() + min(3600.0, self.cache_seconds / 4)
            self.sweep_cache(self.cache_seconds)
        tmp = self._tmp_path()
        try:
            self.remote.download(rel, tmp)  # type: ignore[union-attr]
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _verified_here(self, rel: str, sha256: str, path: Path) -> Path:
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
        """Remove ``rel`` here and from the bucket. Callers delete a file after the row that named
        it: a bucket that fails then leaves an orphan object (logged), as a crash in between would."""
        self.abspath(rel).unlink(missing_ok=True)
        if self.remote is not None:
            try:
                self.remote.delete(rel)
            except StoreUnavailable as exc:
                log.warning("left an orphan object %s in the artifact bucket: %s", rel, exc)

    def delete_tree(self, rel: str) -> None:
        shutil.rmtree(self.abspath(rel), ignore_errors=True)
        if self.remote is not None:
            try:
                self.remote.delete_prefix(rel)
            except StoreUnavailable as exc:
                log.warning("left orphan objects under %s in the artifact bucket: %s", rel, exc)

    # -- directories (a job's checkpoints) -------------------------------------------------
    def push_dir(self, rel: str) -> None:
        """With a bucket, upload the directory ``rel`` as one tar object ``rel.tar`` (the files
        sorted, named relative to it); without one there is nothing to do."""
        if self.remote is None:
            return
        import tarfile

        src = self.abspath(rel)
        tmp = self._tmp_path()
        try:
            with tarfile.open(tmp, "w") as tar:
                _add_tree(tar, src)
            self.remote.upload(tmp, f"{rel}.tar")
        finally:
            tmp.unlink(missing_ok=True)

    def local_dir(self, rel: str) -> Path:
        """The directory ``rel`` on this host: as it is, or (with a bucket) extracted from ``rel.tar``
        into a temporary name and renamed into place. FileNotFoundError where neither has it."""
        path = self._dir_here(rel)
        if path.is_dir():
            return path
        unpacked = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
        try:
            self._extract(rel, unpacked)
            try:
                unpacked.rename(path)
            except OSError:  # another process put it there first
                if not path.is_dir():
                    raise
        finally:
            shutil.rmtree(unpacked, ignore_errors=True)
        return path

    @contextmanager
    def checkpoint_dir(self, rel: str) -> Iterator[Path]:
        """A job's checkpoint directory to read: where this host holds it, else (with a bucket)
        extracted from its pushed tar into a temporary directory, removed afterwards.
        FileNotFoundError where neither has it; ValueError for a path outside the store."""
        path = self._dir_here(rel)
        if path.is_dir():
            yield path
            return
        tmp = self._tmp_path().with_suffix(".d")
        try:
            self._extract(rel, tmp)
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _dir_here(self, rel: str) -> Path:
        """Where the directory ``rel`` is or would be on this host; FileNotFoundError where it is
        not here and there is no bucket to bring it from."""
        path = self.abspath(rel)
        if self.remote is None and not path.is_dir():
            raise FileNotFoundError(rel)
        return path

    def _extract(self, rel: str, dest: Path) -> None:
        """``rel.tar`` from the bucket, extracted into ``dest`` (FileNotFoundError without such an object)."""
        import tarfile

        archive = self._tmp_path()
        try:
            self.remote.download(f"{rel}.tar", archive)  # type: ignore[union-attr]
            dest.mkdir(parents=True)
            with tarfile.open(archive) as tar:
                tar.extractall(dest, filter="data")  # our own archive; "data" refuses links and escapes
        finally:
            archive.unlink(missing_ok=True)

    def pushed_dirs(self, rel: str) -> list[str]:
        """The names of the directories under ``rel`` that ``push_dir`` uploaded (none without a bucket)."""
        if self.remote is None:
            return []
        return sorted(n[:-4] for n in self.remote.names(rel) if n.endswith(".tar"))

    def drop_pushed_dir(self, rel: str) -> None:
        if self.remote is not None:
            self.remote.delete(f"{rel}.tar")

    def sweep_cache(self, older_than_s: float) -> int:
        """With a bucket, this host's copies of files, adapters and kept checkpoint LoRAs not written,
        fetched or read for ``older_than_s`` go (the bucket keeps them; a later read fetches them
        again). Returns how many; 0 without a bucket, where this disk is the store."""
        if self.remote is None:
            return 0
        cutoff, removed = time.time() - older_than_s, 0
        for sub in ("files", "adapters", "checkpoints"):
            for path in (self.root / sub).rglob("*"):
                try:
                    if path.is_file() and path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def check(self) -> None:
        """Raise if the store cannot be used (the bucket unreachable or refusing these credentials)."""
        if self.remote is not None:
            self.remote.check()

    def sweep_tmp(self, older_than_s: float = 3600.0) -> int:
        """Remove temporary files (and a checkpoint's extracted directory) left by a crash; returns how many."""
        if not self.tmp_dir.exists():
            return 0
        cutoff, removed = time.time() - older_than_s, 0
        for path in self.tmp_dir.iterdir():
            try:
                if path.stat().st_mtime >= cutoff:
                    continue
            except FileNotFoundError:  # its writer finished with it meanwhile
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
        return removed


def open_store(settings: object) -> ArtifactStore:
    """The store that ``settings`` name: ``artifact_dir``, with ``artifact_url``'s bucket behind it when set."""
    remote = None
    url = getattr(settings, "artifact_url", None)
    if url:
        from service.storage_s3 import S3Remote

        remote = S3Remote(url)
    return ArtifactStore(getattr(settings, "artifact_dir"), remote,
                         cache_seconds=getattr(settings, "artifact_cache_seconds", 86400.0))


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
