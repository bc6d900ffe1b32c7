"""A small HTTP client for what the OpenAI SDK does not cover (adapters, metrics, SSE).

Server URL and key come from arguments, then ``QERL_BASE_URL`` / ``QERL_API_KEY``, then the
local config file the embedded server writes (``$QERL_CONFIG`` or ~/.config/qerl/config.json).
"""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

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


TERMINAL_STATES = ("succeeded", "failed", "cancelled")
PAUSED = "paused"  # not finished: POST .../resume queues it again
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class ServerEvent:
    """One server-sent event: ``id`` is the stream cursor (send it back as Last-Event-ID)."""

    id: str | None
    event: str | None
    data: Any


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

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    def delete(self, path: str) -> Any:
        return self._check(self.http.delete(path)).json()

    # -- resources -------------------------------------------------------------------------
    def create_job(self, body: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.post("/v1/fine_tuning/jobs", body, headers)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/v1/fine_tuning/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")

    def delete_adapter(self, adapter_id_or_model: str) -> dict[str, Any]:
        """By adapter id (``adapter-...``) or fine-tuned model name (``ft:...``): row and archive go."""
        if adapter_id_or_model.startswith("adapter-"):
            return self.delete(f"/v1/adapters/{adapter_id_or_model}")
        return self.delete(f"/v1/models/{adapter_id_or_model}")

    def pause(self, job_id: str) -> dict[str, Any]:
        return self.post(f"/v1/fine_tuning/jobs/{job_id}/pause")

    def resume(self, job_id: str) -> dict[str, Any]:
        return self.post(f"/v1/fine_tuning/jobs/{job_id}/resume")

    def list_jobs(self, *, status: str | None = None, limit: int = 20, after: str | None = None,
                  metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """One page: {"data": [...], "has_more": bool}, newest first; ``metadata``: pairs every job has."""
        pairs = {f"metadata[{k}]": v for k, v in (metadata or {}).items()}
        return self.get("/v1/fine_tuning/jobs", status=status, limit=limit, after=after, **pairs)

    def all_jobs(self, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """Every job with these metadata pairs, newest first (all pages)."""
        jobs: list[dict[str, Any]] = []
        while True:
            page = self.list_jobs(limit=100, after=jobs[-1]["id"] if jobs else None, metadata=metadata)
            jobs += page["data"]
            if not page.get("has_more") or not page["data"]:
                return jobs

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        """Every checkpoint the job has recorded, newest first (all pages)."""
        found: list[dict[str, Any]] = []
        after = None
        while True:
            page = self.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", limit=100, after=after)
            found += page["data"]
            if not page.get("has_more") or not page["data"]:
                return found
            after = page["data"][-1]["id"]

    def delete_checkpoint(self, job_id: str, checkpoint_id: str) -> dict[str, Any]:
        return self.delete(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}")

    def upload_file(self, path: Path, purpose: str = "fine-tune") -> dict[str, Any]:
        path = Path(path)
        with path.open("rb") as fh:
            resp = self.http.post("/v1/files", data={"purpose": purpose},
                                  files={"file": (path.name, fh, "application/jsonl")},
                                  timeout=httpx.Timeout(30.0, write=None, read=300.0))
        return self._check(resp).json()

    def files(self) -> list[dict[str, Any]]:
        return self.get("/v1/files")["data"]

    def adapters(self) -> list[dict[str, Any]]:
        return self.get("/v1/adapters")["data"]

    def models(self) -> list[dict[str, Any]]:
        return self.get("/v1/models")["data"]

    def metrics(self, job_id: str, after_step: int | None = None) -> list[dict[str, Any]]:
        """Every step's metrics in step order (all pages)."""
        out: list[dict[str, Any]] = []
        while True:
            page = self.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", after_step=after_step)
            out.extend(page["data"])
            if not page.get("has_more") or not page["data"]:
                return out
            after_step = page["data"][-1]["step"]

    def samples(self, job_id: str, step: int | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        """The samples the job reported at ``step`` (default: its newest step), train and eval."""
        params = {k: v for k, v in (("step", step), ("kind", kind)) if v is not None}
        return self.get(f"/v1/fine_tuning/jobs/{job_id}/samples", **params)["data"]

    def events(self, job_id: str, after: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return self.get(f"/v1/fine_tuning/jobs/{job_id}/events", after=after, limit=limit)["data"]

    def stream_events(self, job_id: str, last_event_id: str | None = None) -> Iterator[dict[str, Any]]:
        """The job's events as they happen (decoded JSON payloads); ends when the server closes."""
        for ev in self.stream_server_events(job_id, last_event_id):
            if ev.event != "done" and isinstance(ev.data, dict):
                yield ev.data

    def stream_server_events(self, job_id: str, last_event_id: str | None = None) -> Iterator[ServerEvent]:
        """Like ``stream_events`` but with each event's SSE ``id`` (for resuming after a disconnect).
        The server ends the stream with an ``event: done`` frame ({"status": ...}) once the job is over."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        with self.http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events", headers=headers,
                              timeout=httpx.Timeout(30.0, read=None)) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            yield from parse_sse(resp.iter_lines())

    def adapter(self, adapter_id: str) -> dict[str, Any]:
        return self.get(f"/v1/adapters/{adapter_id}")

    def adapter_id_of(self, ref: str) -> str:
        """The adapter a reference names: a succeeded job's (``ftjob-...``), a fine-tuned model's
        (``ft:...``), or an adapter id as it is."""
        if ref.startswith("ftjob-"):
            job = self.job(ref)
            if not job["qerl"].get("adapter_id"):
                raise QerlError(409, f"job {ref} is {job['status']} and has no adapter yet; wait for it to succeed "
                                     f"(qerl jobs watch {ref})")
            return job["qerl"]["adapter_id"]
        if ref.startswith("ft:"):
            named = [a["id"] for a in self.adapters() if a["name"] == ref]
            if not named:
                raise QerlError(404, f"no fine-tuned model {ref} in this project (qerl adapters list); for a kept "
                                     "checkpoint's LoRA: qerl adapters download JOB --checkpoint STEP -o DIR")
            return named[0]
        return ref

    def download_adapter(self, adapter_id: str, out_dir: Path,
                         progress: Callable[[int, int], None] | None = None) -> Path:
        """Download the adapter's tar.gz, check its sha256 against the server's, extract into out_dir.

        The archive holds the PEFT files at its root, so ``out_dir`` is ready for
        ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest``. Files listed with a sha256 in
        ``qerl_manifest.json`` are checked too."""
        return self._download(f"/v1/adapters/{adapter_id}/content", f"adapter {adapter_id}", out_dir, progress)

    def download_checkpoint(self, job_id: str, checkpoint_id: str, out_dir: Path,
                            progress: Callable[[int, int], None] | None = None) -> Path:
        """The LoRA of one of the job's checkpoints as a PEFT adapter, checked and extracted as
        ``download_adapter`` does (while the server still keeps that checkpoint)."""
        return self._download(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/content",
                              f"checkpoint {checkpoint_id}", out_dir, progress)

    def download_file(self, file_id: str, dest: Path) -> Path:
        """A file's content (an upload, or a job's results file ``step_metrics.csv``) written to
        ``dest`` once its sha256 matches the server's (a temporary name until then)."""
        dest = Path(dest)
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            self._fetch_verified(f"/v1/files/{file_id}/content", f"file {file_id}", tmp, None)
            tmp.replace(dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def delete_file(self, file_id: str) -> dict[str, Any]:
        return self.delete(f"/v1/files/{file_id}")

    def _download(self, path: str, what: str, out_dir: Path, progress: Callable[[int, int], None] | None) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{path.rstrip('/').split('/')[-2]}.tar.gz.part"
        try:
            self._fetch_verified(path, what, tmp, progress)
            with tarfile.open(tmp) as tar:
                tar.extractall(out_dir, filter="data")
        finally:
            tmp.unlink(missing_ok=True)
        verify_adapter_dir(out_dir)
        return out_dir

    def _fetch_verified(self, path: str, what: str, tmp: Path, progress: Callable[[int, int], None] | None) -> None:
        """GET ``path`` into ``tmp``; QerlError unless its sha256 is the server's X-Checksum-Sha256."""
        digest = hashlib.sha256()
        with self.http.stream("GET", path, timeout=httpx.Timeout(30.0, read=300.0)) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            expected = resp.headers.get("X-Checksum-Sha256") or resp.headers.get("etag", "").strip('"')
            total = int(resp.headers.get("content-length") or 0)
            with tmp.open("wb") as fh:
                for chunk in resp.iter_bytes(1 << 16):
                    fh.write(chunk)
                    digest.update(chunk)
                    if progress:
                        progress(len(chunk), total)
        if not expected:
            raise QerlError(502, f"{what}: the server sent no X-Checksum-Sha256 header; "
                                 "the download cannot be verified")
        if digest.hexdigest() != expected:
            raise QerlError(502, f"{what}: sha256 {digest.hexdigest()} does not match the "
                                 f"server's {expected}; download it again")


def verify_adapter_dir(path: Path) -> dict[str, Any]:
    """Check an extracted adapter: the PEFT files exist and match the manifest's sha256s.

    Returns the manifest ({} when the archive has none)."""
    path = Path(path)
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise QerlError(502, f"the adapter archive lacks {', '.join(missing)}; it is not a PEFT adapter")
    manifest_path = path / "qerl_manifest.json"
    if not manifest_path.is_file():
        return {}
    manifest = json.loads(manifest_path.read_text())
    for name, want in _manifest_hashes(manifest).items():
        file = path / name
        if not file.is_file():
            raise QerlError(502, f"qerl_manifest.json lists {name}, which the archive lacks")
        got = _sha256_file(file)
        if got != want:
            raise QerlError(502, f"{name}: sha256 {got} does not match the manifest's {want}")
    return manifest


def _manifest_hashes(manifest: dict[str, Any]) -> dict[str, str]:
    """{file name: sha256} from the manifest's ``files`` (a mapping, or a list of {name/path, sha256})."""
    files = manifest.get("files") or manifest.get("sha256") or {}
    out: dict[str, str] = {}
    if isinstance(files, dict):
        for name, value in files.items():
            want = value.get("sha256") if isinstance(value, dict) else value
            if isinstance(want, str):
                out[name] = want
    elif isinstance(files, list):
        for entry in files:
            if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
                name = entry.get("name") or entry.get("path")
                if isinstance(name, str):
                    out[name] = entry["sha256"]
    return {k: v for k, v in out.items() if "/" not in k and not k.startswith(".")}


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def parse_sse(lines: Iterator[str]) -> Iterator[ServerEvent]:
    """Server-sent events from text lines (the WHATWG rules: ``data:`` lines join with newlines,
    a blank line dispatches, ``:`` starts a comment/keep-alive). JSON payloads are decoded."""
    data: list[str] = []
    event_id: str | None = None
    event_type: str | None = None
    for line in lines:
        if not line:
            if data:
                text = "\n".join(data)
                try:
                    payload: Any = json.loads(text)
                except json.JSONDecodeError:
                    payload = text
                yield ServerEvent(event_id, event_type, payload)
            data, event_type = [], None
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "id":
            event_id = value
        elif field == "event":
            event_type = value
