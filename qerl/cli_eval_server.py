"""`qerl eval ADAPTER... --file test.jsonl --on-server`: the scoring runs on the server's workers
(POST /v1/evaluations), where the base's GPU is, instead of on this machine. The test file is
uploaded once, an evaluation created per adapter, and each one followed until it ends; its scores
and every row's answers (its results file) come back in the shapes of a local run."""
from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl.client import Client, QerlError

ENDED = ("succeeded", "failed", "cancelled")


@dataclass
class ServerScore:
    ref: str
    evaluation: dict[str, Any]  # the ended evaluation as the server shows it
    rows: list[dict[str, Any]]  # every test row's answers and rewards (engine.score.row_records)


def score_on_server(refs: list[str], file: Path | None, dataset: dict[str, Any] | None, grader: dict[str, Any] | None,
                    *, limit: int | None, max_new_tokens: int | None, compare: bool, base_url: str | None,
                    api_key: str | None, say: Callable[[str], None], poll_seconds: float = 1.0) -> list[ServerScore]:
    """One evaluation per adapter of ``refs`` on ``file`` or a task's fresh questions (``dataset``:
    task, size, seed; the first with the base alone where
    ``compare``: it is the same for all), waited for; ValueError when one does not succeed (those
    still running are cancelled: their numbers would not be printed)."""
    body: dict[str, Any] = {}
    body.update({k: v for k, v in (("grader", grader), ("limit", limit), ("max_new_tokens", max_new_tokens))
                 if v is not None})
    with Client(base_url=base_url, api_key=api_key) as client:
        rows = {"file": client.upload_file(file)["id"]} if file is not None else {"dataset": dataset}
        made: list[dict[str, Any]] = []
        try:
            for ref in refs:
                made.append(client.post("/v1/evaluations", {"model": ref, **rows, **body,
                                                            "compare_base": compare and not made}))
                say(f"evaluation {made[-1]['id']} of {ref}: {_status(made[-1])}")
            ended = _wait(client, [ev["id"] for ev in made], refs, say, poll_seconds)
        except BaseException:
            for ev in made:  # a refused one, an error or Ctrl-C: nothing keeps running unseen
                try:
                    client.post(f"/v1/evaluations/{ev['id']}/cancel")
                except QerlError:
                    pass  # it ended meanwhile
            raise
        return [ServerScore(ref, ev, _rows(client, ev)) for ref, ev in zip(refs, ended)]


def _status(ev: dict[str, Any]) -> str:
    place = ev.get("queue_position")
    return f"{ev['status']} (place {place} in the queue)" if ev["status"] == "queued" and place else ev["status"]


def _wait(client: Client, ids: list[str], refs: list[str], say: Callable[[str], None],
          poll_seconds: float) -> list[dict[str, Any]]:
    """The evaluations once every one has ended; QerlError at the first that did not succeed."""
    seen = {i: "" for i in ids}
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(ids):
        for i, ref in zip(ids, refs):
            if i in done:
                continue
            ev = client.get(f"/v1/evaluations/{i}")
            if _status(ev) != seen[i]:
                seen[i] = _status(ev)
                say(f"evaluation {i} of {ref}: {seen[i]}")
            if ev["status"] in ENDED:
                if ev["status"] != "succeeded":
                    why = ev.get("error") or {}
                    raise ValueError(f"evaluation {i} of {ref} {ev['status']}"
                                     + (f" ({why.get('code')}): {why.get('message')}" if why.get("message") else ""))
                done[i] = ev
        if len(done) < len(ids):
            time.sleep(poll_seconds)
    return [done[i] for i in ids]


def _rows(client: Client, ev: dict[str, Any]) -> list[dict[str, Any]]:
    if not ev.get("result_files"):
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_file(ev["result_files"][0], Path(tmp) / "rows.jsonl")
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
