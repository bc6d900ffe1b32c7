"""Settings from the environment: the embedded defaults, the documented variable names, and
refusals that say what to fix."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.settings import Settings

NAMES = ("DATABASE_URL", "REDIS_URL", "ARTIFACT_DIR", "MAX_UPLOAD_BYTES", "QERL_DATA_DIR", "QERL_LEASE_SECONDS",
         "QERL_HEARTBEAT_SECONDS", "QERL_CONFIG", "QERL_CELERY_QUEUE")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_embedded_defaults(env, tmp_path: Path):
    env.setenv("QERL_DATA_DIR", str(tmp_path))
    s = Settings()
    assert s.embedded and s.is_sqlite and s.should_migrate
    assert s.database_url == f"sqlite:///{tmp_path / 'qerl.db'}" and s.artifact_dir == tmp_path / "artifacts"
    assert s.max_upload_bytes == 100 * 1024 * 1024 and s.base_url == "http://127.0.0.1:8000"


def test_environment_names(env, tmp_path: Path):
    env.setenv("DATABASE_URL", "postgresql+psycopg://u@db/qerl")
    env.setenv("REDIS_URL", "redis://broker:6379/0")
    env.setenv("ARTIFACT_DIR", str(tmp_path / "store"))
    env.setenv("MAX_UPLOAD_BYTES", "1234")
    env.setenv("QERL_LEASE_SECONDS", "90")
    env.setenv("QERL_CELERY_QUEUE", "gpu")
    s = Settings()
    assert not s.embedded and not s.is_sqlite and not s.should_migrate
    assert (s.database_url, s.redis_url, s.artifact_dir) == ("postgresql+psycopg://u@db/qerl", "redis://broker:6379/0",
                                                             tmp_path / "store")
    assert (s.max_upload_bytes, s.lease_seconds, s.celery_queue) == (1234, 90.0, "gpu")
    env.setenv("REDIS_URL", "")
    assert Settings().embedded  # blank means unset


def test_refusals_name_the_fix(env):
    env.setenv("DATABASE_URL", "postgresql://u@db/qerl")
    with pytest.raises(ValidationError, match="postgresql\\+psycopg://"):
        Settings()
    env.delenv("DATABASE_URL")
    env.setenv("QERL_LEASE_SECONDS", "10")
    env.setenv("QERL_HEARTBEAT_SECONDS", "8")
    with pytest.raises(ValidationError, match="QERL_HEARTBEAT_SECONDS"):
        Settings()
