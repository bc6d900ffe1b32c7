"""Bearer API keys. Only the sha256 of a secret is stored; each key owns one project and
every query filters by it, so another project's objects answer 404, never 403."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.deps import SessionDep
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
    return True


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def current_key(request: Request, session: SessionDep) -> ApiKey:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise _unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                            "(create one with `qerl keys create`).")
    secret = secret.strip()
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(secret)))
    if key is None:
        raise _unauthorized(f"Incorrect API key provided: {secret[:12]}****. Create one with `qerl keys create`.")
    if key.revoked_at is not None:
        raise _unauthorized(f"API key {key.prefix}**** was revoked. Create a new one with `qerl keys create`.")
    limiter = getattr(request.app.state, "rate_limiter", None)
    if limiter is not None:
        limiter.check(key.id)
    # end the read now: it frees the connection while the route waits for a worker thread (holding it
    # across that wait can starve the pool and deadlock under load), and on SQLite the write lock
    session.commit()
    request.state.key_id = key.id
    return key


CurrentKey = Annotated[ApiKey, Depends(current_key)]


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
