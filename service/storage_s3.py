"""The bucket behind a store set by ``ARTIFACT_URL=s3://bucket/prefix`` (``pip install "qerl[s3]"``).

Any S3-compatible server: boto3 takes the endpoint, region and credentials from its usual places
(``AWS_ENDPOINT_URL`` for MinIO, Ceph or a cloud's S3 API, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, or ``~/.aws``). Objects are named
``<prefix>/<the artifact's relative path>``; large files go up and down in parts (boto3's
transfer manager). The sha256 recorded in the database rides along as object metadata, for
anyone reading the bucket directly; reads check the bytes against the database, not against it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from service.storage import StoreUnavailable

F = TypeVar("F", bound=Callable[..., Any])


class S3ConfigError(ValueError):
    """ARTIFACT_URL cannot be used (its form, or boto3 missing)."""


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix ending in "/" or empty) of ``s3://bucket[/prefix]``."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise S3ConfigError(f"ARTIFACT_URL must look like s3://bucket or s3://bucket/prefix, not {url!r} (the "
                            "server's address goes in AWS_ENDPOINT_URL)")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def _answers(fn: F) -> F:
    """A bucket that does not answer, or refuses, raises StoreUnavailable naming the bucket; a
    missing object stays FileNotFoundError."""
    @functools.wraps(fn)
    def wrapped(self: "S3Remote", *args: Any, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError
        from boto3.exceptions import Boto3Error

        try:
            return fn(self, *args, **kw)
        except (BotoCoreError, ClientError, Boto3Error) as exc:
            raise StoreUnavailable(f"the artifact bucket {self.url} failed ({type(exc).__name__}: "
                                   f"{str(exc)[:300]})") from exc
    return wrapped  # type: ignore[return-value]


class S3Remote:
    def __init__(self, url: str) -> None:
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise S3ConfigError('ARTIFACT_URL names an S3 bucket but boto3 is not installed: pip install "qerl[s3]"') \
                from None
        # retries with back-off on throttling and 5xx (the "standard" mode), on every call
        self.client = boto3.client("s3", config=Config(retries={"max_attempts": 8, "mode": "standard"}))

    def key(self, rel: str) -> str:
        return self.prefix + rel.strip("/")

    @_answers
    def upload(self, local: Path, rel: str, sha256: str | None = None) -> None:
        extra = {"Metadata": {"sha256": sha256}} if sha256 else None
        self.client.upload_file(str(local), self.bucket, self.key(rel), ExtraArgs=extra)

    @_answers
    def download(self, rel: str, dest: Path) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.download_file(self.bucket, self.key(rel), str(dest))
        except ClientError as exc:
            if _status(exc) == 404:
                raise FileNotFoundError(f"{self.url.rstrip('/')}/{rel}") from None
            raise

    @_answers
    def delete(self, rel: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(rel))  # no error when it is gone

    @_answers
    def delete_prefix(self, rel: str) -> None:
        keys = [o["Key"] for page in self._pages(self.key(rel) + "/") for o in page.get("Contents", ())]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

    @_answers
    def names(self, rel: str) -> list[str]:
        folder = self.key(rel) + "/"
        out: list[str] = []
        for page in self._pages(folder, delimiter="/"):
            out += [o["Key"][len(folder):] for o in page.get("Contents", ())]
            out += [p["Prefix"][len(folder):].rstrip("/") for p in page.get("CommonPrefixes", ())]
        return out

    @_answers
    def check(self) -> None:
        self.client.head_bucket(Bucket=self.bucket)

    def _pages(self, prefix: str, delimiter: str | None = None):  # type: ignore[no-untyped-def]
        kw = {"Bucket": self.bucket, "Prefix": prefix, **({"Delimiter": delimiter} if delimiter else {})}
        return self.client.get_paginator("list_objects_v2").paginate(**kw)


def _status(exc: Exception) -> int | None:
    meta = getattr(exc, "response", {}).get("ResponseMetadata", {})
    code = getattr(exc, "response", {}).get("Error", {}).get("Code")
    if code in ("404", "NoSuchKey", "NotFound"):
        return 404
    return meta.get("HTTPStatusCode")
