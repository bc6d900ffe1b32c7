"""/v1/files against Postgres and SQLite: upload, list, get, content, delete, and bad uploads
that must answer OpenAI's error shape and leave no row and no file behind."""
from __future__ import annotations

import hashlib
from pathlib import Path

from sqlalchemy import func, select

from service.models import File
from tests.conftest import STRING_CHECK, jsonl, training_rows


def upload(client, key, data: bytes, *, name: str = "train.jsonl", purpose: str | None = "fine-tune"):
    form = {"purpose": purpose} if purpose is not None else {}
    return client.post("/v1/files", headers=key.headers, files={"file": (name, data, "application/jsonl")}, data=form)


def assert_error(resp, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def files_on_disk(settings) -> list[Path]:
    root = Path(settings.artifact_dir)
    return sorted(p for p in (root / "files").rglob("*") if p.is_file()) + \
        sorted(p for p in (root / "tmp").rglob("*") if p.is_file())


def file_rows(db_sessions, project: str) -> int:
    with db_sessions() as s:
        return s.scalar(select(func.count()).select_from(File).where(File.project == project))


def test_upload_list_get_content_delete(client, key_a, api_settings):
    data = jsonl(training_rows(3))
    resp = upload(client, key_a, data)
    assert resp.status_code == 200, resp.text
    f = resp.json()
    assert f["object"] == "file" and f["purpose"] == "fine-tune" and f["status"] == "processed"
    assert f["bytes"] == len(data) and f["filename"] == "train.jsonl"
    assert f["qerl"] == {"rows": 3, "prompts": 3, "fields": {"messages": 3, "answer": 3},
                         "sha256": hashlib.sha256(data).hexdigest()}
    assert isinstance(f["created_at"], int)

    second = upload(client, key_a, jsonl(training_rows(1)), name="b.jsonl").json()
    listed = client.get("/v1/files", headers=key_a.headers).json()
    assert listed["object"] == "list" and [x["id"] for x in listed["data"]] == [second["id"], f["id"]]
    page = client.get("/v1/files", headers=key_a.headers, params={"limit": 1}).json()
    assert [x["id"] for x in page["data"]] == [second["id"]] and page["has_more"] is True
    page2 = client.get("/v1/files", headers=key_a.headers, params={"limit": 1, "after": second["id"]}).json()
    assert [x["id"] for x in page2["data"]] == [f["id"]] and page2["has_more"] is False
    asc = client.get("/v1/files", headers=key_a.headers, params={"order": "asc"}).json()
    assert [x["id"] for x in asc["data"]] == [f["id"], second["id"]]

    assert client.get(f"/v1/files/{f['id']}", headers=key_a.headers).json() == f
    content = client.get(f"/v1/files/{f['id']}/content", headers=key_a.headers)
    assert content.status_code == 200 and content.content == data
    assert content.headers["x-checksum-sha256"] == hashlib.sha256(data).hexdigest()

    on_disk = Path(api_settings.artifact_dir) / f"files/{f['id']}.jsonl"
    assert on_disk.read_bytes() == data
    deleted = client.delete(f"/v1/files/{f['id']}", headers=key_a.headers)
    assert deleted.json() == {"id": f["id"], "object": "file", "deleted": True}
    assert not on_disk.exists()
    assert_error(client.get(f"/v1/files/{f['id']}", headers=key_a.headers), 404, code="not_found")
    assert_error(client.get(f"/v1/files/{f['id']}/content", headers=key_a.headers), 404)
    assert_error(client.delete(f"/v1/files/{f['id']}", headers=key_a.headers), 404)
    assert [x["id"] for x in client.get("/v1/files", headers=key_a.headers).json()["data"]] == [second["id"]]


def test_jsonl_errors_name_each_line(client, key_a, db_sessions, api_settings):
    before = files_on_disk(api_settings)
    bad = b'{"prompt": "ok"}\n{"prompt": 3}\nnot json\n\n{"messages": [{"role": "user"}]}\n[1]\n'
    err = assert_error(upload(client, key_a, bad), 400, param="file", code="invalid_file_format")
    for fragment in ("line 2:", "line 3:", "line 5:", "line 6:"):
        assert fragment in err["message"]
    assert "line 1:" not in err["message"]
    assert file_rows(db_sessions, key_a.project) == 0
    assert files_on_disk(api_settings) == before


def test_non_jsonl_uploads_are_refused(client, key_a, db_sessions, api_settings):
    before = files_on_disk(api_settings)
    assert_error(upload(client, key_a, b"\x89PNG\r\n\x1a\n\x00\x00binary", name="x.png"), 400,
                 param="file", code="invalid_file_format")
    assert_error(upload(client, key_a, b"prompt,answer\n1+1,2\n", name="x.csv"), 400, param="file")
    assert_error(upload(client, key_a, b""), 400, param="file")
    assert file_rows(db_sessions, key_a.project) == 0
    assert files_on_disk(api_settings) == before


def test_missing_fields_and_wrong_content_type(client, key_a, db_sessions):
    resp = client.post("/v1/files", headers=key_a.headers, data={"purpose": "fine-tune"},
                       files={"other": ("x", b"1")})
    assert_error(resp, 422, param="file", code="missing_required")
    assert_error(upload(client, key_a, jsonl(training_rows(1)), purpose=None), 422, param="purpose")
    assert_error(upload(client, key_a, jsonl(training_rows(1)), purpose="assistants"), 422, param="purpose")
    assert_error(client.post("/v1/files", headers=key_a.headers, json={"file": "x"}), 400,
                 code="invalid_content_type")
    assert file_rows(db_sessions, key_a.project) == 0


def test_oversized_upload_413_leaves_nothing(make_client, key_a, db_sessions, api_settings):
    small = make_client(max_upload_bytes=1000)
    before = files_on_disk(api_settings)
    row = b'{"prompt": "' + b"x" * 80 + b'"}\n'
    # just over the per-file limit: refused while copying into the store
    err = assert_error(upload(small, key_a, row * 13), 413, param="file", code="file_too_large")
    assert "1000 bytes" in err["message"]
    # far over: refused by Content-Length before the body is read
    assert_error(upload(small, key_a, row * 2000), 413, code="file_too_large")

    # a chunked body (no Content-Length) is cut off while it streams
    def chunks():
        for _ in range(2000):
            yield row

    boundary = "qerlboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"t.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode()

    def body():
        yield head
        yield from chunks()
        yield f"\r\n--{boundary}--\r\n".encode()

    resp = small.post("/v1/files", headers={**key_a.headers, "Content-Type": f"multipart/form-data; boundary={boundary}"},
                      content=body())
    assert_error(resp, 413, code="file_too_large")
    assert file_rows(db_sessions, key_a.project) == 0
    assert files_on_disk(api_settings) == before
    assert upload(small, key_a, row * 5).status_code == 200  # under the limit still works


def test_delete_refused_while_a_job_uses_the_file(client, key_a):
    f = upload(client, key_a, jsonl(training_rows(40))).json()
    job = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={
        "model": "smollm2-135m-instruct", "training_file": f["id"],
        "method": {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}})
    assert job.status_code == 200, job.text
    err = assert_error(client.delete(f"/v1/files/{f['id']}", headers=key_a.headers), 409, code="file_in_use")
    assert job.json()["id"] in err["message"]
    assert client.get(f"/v1/files/{f['id']}/content", headers=key_a.headers).status_code == 200
    assert client.post(f"/v1/fine_tuning/jobs/{job.json()['id']}/pause", headers=key_a.headers).status_code == 200
    assert_error(client.delete(f"/v1/files/{f['id']}", headers=key_a.headers), 409, code="file_in_use")  # resumable
    assert client.post(f"/v1/fine_tuning/jobs/{job.json()['id']}/cancel", headers=key_a.headers).status_code == 200
    assert client.delete(f"/v1/files/{f['id']}", headers=key_a.headers).json()["deleted"] is True
