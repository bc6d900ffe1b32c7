"""Bearer API keys. Only the sha256 of a secret is stored; each key owns one project and
every query filters by it, so another project's objects answer 404, never 403.

A key that checked out is remembered for ``QERL_AUTH_CACHE_SECONDS`` (KeyCache), so a client
polling every second costs no key query. Revoking a key in this process (``revoke_key``) forgets
it at once; a revocation made by another process (``qerl keys revoke`` elsewhere) takes effect
within that many seconds. Unknown and revoked keys are never cached: they go to the database.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.errors import APIError
from service.models import ApiKey

log = logging.getLogger(__name__)
SECRET_PREFIX = "sk-qerl-"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(session: Session, project: str, name: str = "") -> str:
    """Store a new key for ``project`` and return its secret (shown once, never stored)."""
    if not project or len(project) > 64:
        raise ValueError("project must be 1 to 64 characters")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(project=project, name=name, key_hash=hash_secret(secret), prefix=secret[:12]))
    session.commit()
    return secret


def revoke_key(session: Session, key_id: str) -> bool:
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        return False
    key.revoked_at = datetime.now(timezone.utc)
    session.commit()
    for cache in list(_caches):
        cache.forget(key_id)
    return True


@dataclass(frozen=True)
class AuthenticatedKey:
    """What a request knows of its key: a plain value, so it can be cached and shared by threads."""

    id: str
    project: str
    prefix: str


class KeyCache:
    """Keys that checked out, by secret hash, each for ``ttl`` seconds (0 turns caching off)."""

    def __init__(self, ttl: float, max_entries: int = 10_000) -> None:
        self.ttl, self.max_entries = ttl, max_entries
        self._entries: dict[str, tuple[AuthenticatedKey, float]] = {}
        self._lock = threading.Lock()
        _caches.add(self)

    def get(self, digest: str) -> AuthenticatedKey | None:
        entry = self._entries.get(digest)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def put(self, digest: str, key: AuthenticatedKey) -> None:
        if self.ttl <= 0:
            return
        now = time.monotonic()
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries = {d: e for d, e in self._entries.items() if e[1] >= now}
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
            self._entries[digest] = (key, now + self.ttl)

    def forget(self, key_id: str) -> None:
        with self._lock:
            self._entries = {d: e for d, e in self._entries.items() if e[0].id != key_id}


_caches: weakref.WeakSet[KeyCache] = weakref.WeakSet()  # every cache of this process, for revoke_key


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _checked(row: Any, secret: str) -> AuthenticatedKey:
    """The key a lookup found (id, project, prefix, revoked_at), or 401 saying why not."""
    if row is None:
        raise _unauthorized(f"Incorrect API key provided: {secret[:12]}****. Create one with `qerl keys create`.")
    if row.revoked_at is not None:
        raise _unauthorized(f"API key {row.prefix}**** was revoked. Create a new one with `qerl keys create`.")
    return AuthenticatedKey(id=row.id, project=row.project, prefix=row.prefix)


async def current_key(request: Request) -> AuthenticatedKey:
    """The request's key: from the cache, or one read (service.reads) on a miss."""
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise _unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                            "(create one with `qerl keys create`).")
    secret = secret.strip()
    digest = hash_secret(secret)
    cache: KeyCache = request.app.state.key_cache
    key = cache.get(digest)
    if key is None:
        key = _checked(await request.app.state.reads.key(digest), secret)
        cache.put(digest, key)
    limiter = getattr(request.app.state, "rate_limiter", None)
    if limiter is not None:
        limiter.check(key.id)
    request.state.key_id = key.id
    return key


CurrentKey = Annotated[AuthenticatedKey, Depends(current_key)]


def ensure_default_key(make_session: sessionmaker[Session], base_url: str, config_path: Path) -> str | None:
    """First start of an embedded server: create a key, print it, save it for the CLI.

    Returns the new secret, or None when keys already exist (then the saved config only
    learns this start's URL: the port may have changed)."""
    with make_session() as session:
        if session.scalar(select(func.count()).select_from(ApiKey)):
            _refresh_client_url(Path(config_path).expanduser(), base_url)
            return None
        secret = create_key(session, "default", "created on first start")
    write_client_config(config_path, base_url=base_url, api_key=secret)
    print(f"qerl: created API key {secret}\nqerl: saved it with base_url {base_url} to {config_path}", flush=True)
    return secret


def _refresh_client_url(path: Path, base_url: str) -> None:
    try:
        saved = json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return
    if saved.get("api_key") and saved.get("base_url") != base_url:
        write_client_config(path, base_url=base_url, api_key=saved["api_key"])


def write_client_config(path: Path, *, base_url: str, api_key: str) -> None:
    """Merge {base_url, api_key} into the CLI's JSON config; owner-only, replaced atomically."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, object] = {}
    if path.exists():
        try:
            data = json.loads(path.read_text() or "{}")
        except json.JSONDecodeError:
            log.warning("replacing unreadable client config %s", path)
    data.update(base_url=base_url, api_key=api_key)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)
