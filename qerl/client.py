"""A small HTTP client for what the OpenAI SDK does not cover (adapters, metrics, SSE).

Server URL and key come from arguments, then ``QERL_BASE_URL`` / ``QERL_API_KEY``, then the
local config file the embedded server writes (``$QERL_CONFIG`` or ~/.config/qerl/config.json).
"""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Iterator

import httpx


def config_path() -> Path:
    return Path(os.environ.get("QERL_CONFIG") or Path.home() / ".config" / "qerl" / "config.json")


def load_local_config() -> dict[str, Any]:
    path = config_path()
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


class QerlError(RuntimeError):
    """The server's error message (OpenAI's error shape), ready to print."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.code = status, message, code


class Client:
    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float = 30.0) -> None:
        local = load_local_config()
        self.base_url = (base_url or os.environ.get("QERL_BASE_URL") or local.get("base_url")
                         or "http://127.0.0.1:8000").rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.api_key = api_key or os.environ.get("QERL_API_KEY") or local.get("api_key")
        if not self.api_key:
            raise QerlError(401, "no API key: pass --api-key, set QERL_API_KEY, or start the embedded server "
                                 "once (it writes one to the local config)")
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {self.api_key}"})

    # -- plumbing --------------------------------------------------------------------------
    def _check(self, resp: httpx.Response) -> httpx.Response:
        if resp.status_code >= 400:
            try:
                err = resp.json()["error"]
                raise QerlError(resp.status_code, err.get("message", resp.text), err.get("code"))
            except (ValueError, KeyError, TypeError):
                raise QerlError(resp.status_code, resp.text[:500]) from None
        return resp

    def get(self, path: str, **params: Any) -> Any:
        return self._check(self.http.get(path, params={k: v for k, v in params.items() if v is not None})).json()

    def post(self, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> Any:
        return self._check(self.http.post(path, json=body or {}, headers=headers)).json()

    # -- resources -------------------------------------------------------------------------
    def create_job(self, body: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.post("/v1/fine_tuning/jobs", body, headers)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/v1/fine_tuning/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return self.get(f"/v1/fine_tuning/jobs/{job_id}/metrics")["data"]

    def events(self, job_id: str, after: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return self.get(f"/v1/fine_tuning/jobs/{job_id}/events", after=after, limit=limit)["data"]

    def stream_events(self, job_id: str, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        with self.http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events", headers=headers,
                              timeout=httpx.Timeout(30.0, read=None)) as resp:
            self._check(resp)
            data: list[str] = []
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].strip())
                elif not line and data:
                    yield json.loads("\n".join(data))
                    data = []

    def adapter(self, adapter_id: str) -> dict[str, Any]:
        return self.get(f"/v1/adapters/{adapter_id}")

    def download_adapter(self, adapter_id: str, out_dir: Path, progress=None) -> Path:
        """Download the adapter's tar.gz, check its sha256 against the server's, extract into out_dir."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{adapter_id}.tar.gz.part"
        digest = hashlib.sha256()
        with self.http.stream("GET", f"/v1/adapters/{adapter_id}/content") as resp:
            self._check(resp)
            expected = resp.headers.get("X-Checksum-Sha256") or resp.headers.get("etag", "").strip('"')
            total = int(resp.headers.get("content-length") or 0)
            with tmp.open("wb") as fh:
                for chunk in resp.iter_bytes(1 << 16):
                    fh.write(chunk)
                    digest.update(chunk)
                    if progress:
                        progress(len(chunk), total)
        if expected and digest.hexdigest() != expected:
            tmp.unlink(missing_ok=True)
            raise QerlError(502, f"adapter {adapter_id}: sha256 {digest.hexdigest()} does not match the server's {expected}")
        with tarfile.open(tmp) as tar:
            tar.extractall(out_dir, filter="data")
        tmp.unlink()
        return out_dir
