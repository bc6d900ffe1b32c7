"""Service configuration, read once from the environment.

With neither ``DATABASE_URL`` nor ``REDIS_URL`` set the service runs embedded: SQLite under the
data directory and an in-process worker thread. Setting ``REDIS_URL`` switches the queue to Celery;
``DATABASE_URL`` (``postgresql+psycopg://...``) moves the truth to Postgres.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _env(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QERL_", extra="ignore", populate_by_name=True)

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".qerl", validation_alias=_env("QERL_DATA_DIR"))
    database_url: str | None = Field(default=None, validation_alias=_env("DATABASE_URL", "QERL_DATABASE_URL"))
    redis_url: str | None = Field(default=None, validation_alias=_env("REDIS_URL", "QERL_REDIS_URL"))
    artifact_dir: Path | None = Field(default=None, validation_alias=_env("ARTIFACT_DIR", "QERL_ARTIFACT_DIR"))
    # s3://bucket[/prefix]: the artifacts live in that bucket and ARTIFACT_DIR is each host's cache
    # of it (service.storage_s3; the endpoint and credentials are boto3's: AWS_ENDPOINT_URL, ...)
    artifact_url: str | None = Field(default=None, validation_alias=_env("ARTIFACT_URL", "QERL_ARTIFACT_URL"))
    # with a bucket: a host's copies of files and adapters not written or fetched for this long go
    artifact_cache_seconds: float = Field(default=86400.0, gt=0)
    max_upload_bytes: int = Field(default=100 * 1024 * 1024, gt=0,
                                  validation_alias=_env("MAX_UPLOAD_BYTES", "QERL_MAX_UPLOAD_BYTES"))

    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str | None = None  # what clients should call; default http://host:port

    # queue (the worker reads these too)
    lease_seconds: float = Field(default=60.0, gt=0)
    heartbeat_seconds: float = Field(default=10.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    reap_interval_seconds: float = Field(default=5.0, gt=0)
    sweep_after_seconds: float = Field(default=60.0, gt=0)  # re-send a wake-up for a job queued this long
    # a finished job's workdir (checkpoints with optimizer state, the unpacked adapter) is deleted
    # this long after the job ended; the adapter tarball it produced stays
    job_files_retention_seconds: float = Field(default=3600.0, ge=0)
    cleanup_interval_seconds: float = Field(default=60.0, gt=0)  # how often workers look for such workdirs
    # job-end notifications (OpenAI's fine_tuning.job.* events, signed as Standard Webhooks)
    webhook_url: str | None = None
    webhook_secret: str | None = None  # whsec_<base64> (or any string: its UTF-8 bytes are the key)
    webhook_timeout_seconds: float = Field(default=5.0, gt=0)
    webhook_retry_seconds: float = Field(default=5.0, gt=0)  # first retry; each later one waits 6x longer, to 1 h
    webhook_max_age_seconds: float = Field(default=86400.0, gt=0)  # then an undelivered event is given up
    celery_queue: str = "qerl"
    embedded_worker: bool = True  # start the in-process worker thread in embedded mode

    # database pool of each API process: capacity (size + overflow) matches the 40 threads that serve
    # sync routes, so a request never waits for a connection a thread could not use anyway
    db_pool_size: int = Field(default=10, ge=1)
    db_max_overflow: int = Field(default=30, ge=0)
    db_pool_timeout: float = Field(default=10.0, gt=0)  # then 503 database_unavailable, never a hang
    db_read_pool_size: int = Field(default=10, ge=1)  # Postgres: the polled reads' own pool (service.reads)

    # API behaviour
    rate_limit_per_minute: int = Field(default=1200, ge=0)  # per API key; 0 disables
    # jobs a project may have waiting for or holding a worker (queued, running, pausing, cancelling;
    # paused ones hold nothing); a create or resume beyond it is a 429. 0: no limit
    max_active_jobs: int = Field(default=0, ge=0)
    # a verified key is remembered this long; a revocation by another process takes effect within it
    auth_cache_seconds: float = Field(default=5.0, ge=0)
    sse_poll_seconds: float = Field(default=0.5, gt=0)
    sse_keepalive_seconds: float = Field(default=15.0, gt=0)
    auto_migrate: bool | None = None  # None: only in embedded mode
    config_path: Path | None = Field(default=None, validation_alias=_env("QERL_CONFIG"))  # client config file

    @field_validator("database_url", "redis_url", "webhook_url", "webhook_secret", "artifact_url", mode="before")
    @classmethod
    def _blank_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _fill_defaults(self) -> "Settings":
        self.data_dir = self.data_dir.expanduser()
        if self.artifact_dir is None:
            self.artifact_dir = self.data_dir / "artifacts"
        self.artifact_dir = self.artifact_dir.expanduser()
        if self.database_url is None:
            self.database_url = f"sqlite:///{self.data_dir / 'qerl.db'}"
        if self.database_url.startswith(("postgres://", "postgresql://")):
            raise ValueError("DATABASE_URL must use the psycopg 3 driver: postgresql+psycopg://user@host/db")
        if self.webhook_url is not None:
            _check_webhook(self.webhook_url, self.webhook_secret)
        if self.artifact_url is not None:
            from service.storage_s3 import parse_url

            parse_url(self.artifact_url)
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise ValueError("QERL_HEARTBEAT_SECONDS must be at most half of QERL_LEASE_SECONDS "
                             "(a lease must survive one missed heartbeat)")
        return self

    @property
    def embedded(self) -> bool:
        """No broker configured: the queue is the in-process worker thread."""
        return self.redis_url is None

    @property
    def is_sqlite(self) -> bool:
        return str(self.database_url).startswith("sqlite")

    @property
    def should_migrate(self) -> bool:
        return self.embedded if self.auto_migrate is None else self.auto_migrate

    @property
    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def client_config_path(self) -> Path:
        return (self.config_path or Path.home() / ".config" / "qerl" / "config.json").expanduser()


@lru_cache
def _check_webhook(url: str, secret: str | None) -> None:
    import base64
    import binascii
    from urllib.parse import urlsplit

    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise ValueError(f"QERL_WEBHOOK_URL must be an http(s) URL such as https://hooks.example.com/qerl; got {url!r}")
    if not secret:
        raise ValueError("QERL_WEBHOOK_URL needs QERL_WEBHOOK_SECRET, the key its events are signed with "
                         "(whsec_ + base64 of 24-64 random bytes, as Standard Webhooks)")
    if secret.startswith("whsec_"):
        try:
            if not base64.b64decode(secret[6:], validate=True):
                raise ValueError
        except (binascii.Error, ValueError):
            raise ValueError("QERL_WEBHOOK_SECRET: after whsec_ must come base64 of the key bytes, e.g. "
                             "whsec_$(openssl rand -base64 32)") from None


def get_settings() -> Settings:
    """The process-wide settings; tests change the environment and call ``cache_clear()``."""
    return Settings()
