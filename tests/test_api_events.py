"""Job events: the JSON list (newest first, ``after`` cursor) and the SSE stream against a live
server: resumes after ``Last-Event-ID``, delivers events written while it is open, ends when the
job is terminal."""
from __future__ import annotations

import json
import threading
import time

import httpx

from service import queue
from tests.conftest import jsonl, training_rows
from tests.test_api_jobs import body


def make_job(http: httpx.Client, headers: dict | None = None) -> str:
    fid = http.post("/v1/files", files={"file": ("t.jsonl", jsonl(training_rows(40)))},
                    data={"purpose": "fine-tune"}, headers=headers).json()["id"]
    resp = http.post("/v1/fine_tuning/jobs", json=body(fid), headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def add_events(db_sessions, job_id: str, messages: list[str]) -> None:
    with db_sessions() as s:  # as the worker writes them
        for m in messages:
            queue.add_event(s, job_id, 1, m, data={"m": m})
        s.commit()


def test_events_json_newest_first_with_after_cursor(client, key_a, key_b, db_sessions):
    h = key_a.headers
    job_id = make_job(client, h)
    add_events(db_sessions, job_id, [f"e{i}" for i in range(5)])
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}, headers=h).json()
    messages = [e["message"] for e in events["data"]]
    assert messages[:5] == ["e4", "e3", "e2", "e1", "e0"] and messages[5].startswith("Created fine-tuning job")
    assert all(e["object"] == "fine_tuning.job.event" and e["id"].startswith("ftevent-") for e in events["data"])
    assert events["data"][0]["data"] == {"m": "e4"} and events["data"][0]["level"] == "info"
    page = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 2}, headers=h).json()
    assert [e["message"] for e in page["data"]] == ["e4", "e3"] and page["has_more"] is True
    page2 = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 2, "after": page["last_id"]},
                       headers=h).json()
    assert [e["message"] for e in page2["data"]] == ["e2", "e1"]
    other = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers=key_b.headers)
    assert other.status_code == 404


def read_sse(resp: httpx.Response, out: list[dict], done: threading.Event) -> None:
    frame: dict = {}
    for line in resp.iter_lines():
        if line == "":
            if "data" in frame:
                out.append(frame)
            if frame.get("event") == "done":
                done.set()
                return
            frame = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(": ")
            frame[field] = value


def test_sse_resumes_after_last_event_id_and_ends_when_terminal(live_server, key_a, db_sessions):
    with httpx.Client(base_url=live_server.url, headers=key_a.headers, timeout=30) as http:
        job_id = make_job(http)
        add_events(db_sessions, job_id, ["old-1", "old-2"])
        listed = http.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]
        resume_from = next(e["id"] for e in listed if e["message"] == "old-1")

        frames: list[dict] = []
        done = threading.Event()
        headers = {"Accept": "text/event-stream", "Last-Event-ID": resume_from}
        with http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events", headers=headers) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            reader = threading.Thread(target=read_sse, args=(resp, frames, done))
            reader.start()
            deadline = time.monotonic() + 10
            while not frames and time.monotonic() < deadline:
                time.sleep(0.02)
            add_events(db_sessions, job_id, ["live-1", "live-2"])  # written while the stream is open
            while len(frames) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"
            assert done.wait(10), frames
            reader.join(5)

    messages = [json.loads(f["data"]).get("message") for f in frames if f.get("event") != "done"]
    assert messages == ["old-2", "live-1", "live-2", "The job was cancelled"]
    ids = [int(f["id"].removeprefix("ftevent-")) for f in frames if "id" in f]
    assert ids == sorted(ids) and ids[0] > int(resume_from.removeprefix("ftevent-"))
    assert frames[-1]["event"] == "done" and json.loads(frames[-1]["data"]) == {"status": "cancelled"}


def test_sse_of_a_finished_job_replays_and_closes(client, key_a):
    job_id = make_job(client, key_a.headers)
    client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=key_a.headers)
    resp = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers={**key_a.headers, "Accept": "text/event-stream"})
    text = resp.text
    assert "Created fine-tuning job" in text and "The job was cancelled" in text
    assert text.rstrip().endswith('data: {"status": "cancelled"}')
