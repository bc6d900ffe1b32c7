"""Hostile input against the API on Postgres and SQLite: malformed and oversized uploads, JSONL
bombs, path traversal in every id and filename, SQL-ish strings in every field, invalid UTF-8,
out-of-range hyperparameters, cross-project access to jobs, files and adapters, the per-key rate
limit, and the download checksum. Every answer must be a 4xx in OpenAI's error shape (never a
500), nothing may be written outside the artifact store, and no other project's data may leak."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from service.auth import hash_secret, revoke_key
from service.models import ApiKey, File, Job
from tests.conftest import STRING_CHECK, jsonl, training_rows
from tests.test_api_adapters import finish_job_with_adapter
from tests.test_api_files import assert_error, files_on_disk, upload

MODEL = "smollm2-135m-instruct"
RG_JOB = {"model": MODEL, "qerl": {"dataset": {"source": "reasoning_gym", "task": "products", "size": 40}}}
TRAVERSALS = ["../../../../etc/passwd", "..%2F..%2F..%2Fetc%2Fpasswd", "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
              "....//....//etc/passwd", "..\\..\\..\\windows\\win.ini", "/etc/passwd", "file-x/../../../etc",
              "%252e%252e%252fetc%252fpasswd", "..;/..;/etc/passwd", "files/../../../../etc/passwd"]
SQLISH = ["' OR '1'='1", "1; DROP TABLE jobs; --", "\" OR \"\"=\"", "%' OR 1=1 --", "x' UNION SELECT key_hash, "
          "project FROM api_keys --", "'); DELETE FROM files; --", "\\'; TRUNCATE api_keys CASCADE; --"]


def boundary_body(filename: bytes, content: bytes, purpose: bytes = b"fine-tune", boundary: bytes = b"qerlB0und"
                  ) -> tuple[bytes, str]:
    """A multipart body built byte by byte (clients refuse to send some of these names)."""
    b = b"--" + boundary
    body = (b + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n' + purpose + b"\r\n" + b +
            b'\r\nContent-Disposition: form-data; name="file"; filename="' + filename +
            b'"\r\nContent-Type: application/octet-stream\r\n\r\n' + content + b"\r\n" + b + b"--\r\n")
    return body, f"multipart/form-data; boundary={boundary.decode()}"


def raw_upload(client, key, filename: bytes, content: bytes, purpose: bytes = b"fine-tune"):
    body, ctype = boundary_body(filename, content, purpose)
    return client.post("/v1/files", content=body, headers={**key.headers, "Content-Type": ctype})


def no_500(resp) -> None:
    assert resp.status_code < 500, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}, resp.text


def counts(db_sessions) -> tuple[int, int, int]:
    with db_sessions() as s:
        return tuple(s.scalar(select(func.count()).select_from(t)) for t in (ApiKey, File, Job))  # type: ignore


# -- uploads -----------------------------------------------------------------------------------
def test_malformed_uploads_are_refused_and_leave_nothing(client, key_a, api_settings, db_sessions):
    before = files_on_disk(api_settings)
    cases = [
        (b"t.jsonl", b"", 400, "invalid_file_format"),  # empty
        (b"t.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), 400, "invalid_file_format"),
        (b"t.jsonl", b'{"prompt": "caf\xe9"}\n', 400, "invalid_file_format"),  # latin-1, not UTF-8
        (b"t.jsonl", b'{"prompt": "ok"}\n{"prompt": \xff\xfe}\n', 400, "invalid_file_format"),
        (b"t.jsonl", b'{"prompt": "a"}{"prompt": "b"}\n', 400, "invalid_file_format"),  # two objects on a line
        (b"t.jsonl", b"[1, 2, 3]\n", 400, "invalid_file_format"),
        (b"t.jsonl", b"\x00" * 4096, 400, "invalid_file_format"),
        (b"t.jsonl", b'{"prompt": "x"}\n', None, None),  # purpose invalid below
    ]
    for filename, content, status, code in cases[:-1]:
        err = assert_error(raw_upload(client, key_a, filename, content), status, param="file", code=code)
        assert "line" in err["message"] or "empty" in err["message"], err
        assert err["message"].endswith("Fix these lines and upload again." if content else "\"answer\": \"...\"}."), err
    assert_error(raw_upload(client, key_a, b"t.jsonl", b'{"prompt": "x"}\n', purpose=b"fine-\xfftune"), 422,
                 param="purpose")
    # a multipart body that ends early, and one whose boundary never appears
    body, ctype = boundary_body(b"t.jsonl", b'{"prompt": "x"}\n')
    no_500(client.post("/v1/files", content=body[: len(body) // 2], headers={**key_a.headers, "Content-Type": ctype}))
    no_500(client.post("/v1/files", content=b"garbage" * 100,
                       headers={**key_a.headers, "Content-Type": "multipart/form-data; boundary=nope"}))
    no_500(client.post("/v1/files", content=b"x", headers={**key_a.headers, "Content-Type": "multipart/form-data"}))
    # two files in one request: only one is accepted
    two = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
           + b'--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n{"prompt": "a"}\n\r\n' * 2
           + b"--B--\r\n")
    no_500(client.post("/v1/files", content=two, headers={**key_a.headers,
                                                           "Content-Type": "multipart/form-data; boundary=B"}))
    assert files_on_disk(api_settings) == before
    with db_sessions() as s:
        assert s.scalar(select(func.count()).select_from(File).where(File.project == key_a.project)) == 0


def test_jsonl_bombs(make_client, key_a, api_settings):
    small = make_client(max_upload_bytes=4 * 1024 * 1024)
    before = files_on_disk(api_settings)
    deep = b'{"prompt": "x", "a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n"  # 400 KB, 200k levels
    err = assert_error(upload(small, key_a, deep), 400, code="invalid_file_format")
    assert "nesting deeper than" in err["message"]
    deep_obj = b'{"prompt": "x", "a": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}\n"
    assert "nesting deeper than" in assert_error(upload(small, key_a, deep_obj), 400)["message"]
    huge_line = b'{"prompt": "' + b"x" * (3 * 1024 * 1024) + b'"}\n'  # one 3 MB line
    err = assert_error(upload(small, key_a, huge_line), 400, code="invalid_file_format")
    assert "line 1: longer than" in err["message"]
    many_errors = b"not json\n" * 100_000
    err = assert_error(upload(small, key_a, many_errors), 400)
    assert "more invalid lines" in err["message"] and len(err["message"]) < 5000  # bounded answer
    wide = json.dumps({"prompt": "x", **{f"k{i}": i for i in range(100_000)}}).encode() + b"\n"  # 1.5 MB object
    no_500(upload(small, key_a, wide))
    assert files_on_disk(api_settings) == before
    # a bomb in a JSON request body
    bomb = b'{"model": "x", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error(small.post("/v1/fine_tuning/jobs", content=bomb, headers={**key_a.headers,
                                                                           "Content-Type": "application/json"}), 400)
    nested = {"a": 1}
    for _ in range(400):
        nested = {"a": nested}
    no_500(small.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={**RG_JOB, "qerl": {**RG_JOB["qerl"],
                                                                                                "lora": nested}}))


# -- path traversal -----------------------------------------------------------------------------
def test_path_traversal_in_every_id_and_filename(client, key_a, api_settings, tmp_path, db_sessions):
    fid = upload(client, key_a, jsonl(training_rows(2))).json()["id"]
    paths = ["/v1/files/{}", "/v1/files/{}/content", "/v1/fine_tuning/jobs/{}", "/v1/fine_tuning/jobs/{}/events",
             "/v1/fine_tuning/jobs/{}/metrics", "/v1/fine_tuning/jobs/{}/checkpoints", "/v1/adapters/{}",
             "/v1/adapters/{}/content", "/v1/models/{}"]
    for evil in TRAVERSALS:
        for template in paths:
            resp = client.get(template.format(evil), headers=key_a.headers)
            assert resp.status_code in (400, 404, 422), (template, evil, resp.status_code, resp.text)
            assert "root:" not in resp.text and "[fonts]" not in resp.text
        for method, template in [("DELETE", "/v1/files/{}"), ("POST", "/v1/fine_tuning/jobs/{}/cancel"),
                                 ("POST", "/v1/fine_tuning/jobs/{}/pause"), ("POST", "/v1/fine_tuning/jobs/{}/resume"),
                                 ("DELETE", "/v1/adapters/{}"), ("DELETE", "/v1/models/{}")]:
            assert client.request(method, template.format(evil), headers=key_a.headers).status_code in (400, 404, 405)
        for path in ["/v1/files", "/v1/fine_tuning/jobs", "/v1/adapters", "/v1/fine_tuning/jobs/x/checkpoints",
                     "/v1/fine_tuning/jobs/x/events"]:
            no_500(client.get(path, params={"after": evil}, headers=key_a.headers))
        no_500(client.get("/v1/fine_tuning/jobs/x/events", headers={**key_a.headers, "Accept": "text/event-stream",
                                                                    "Last-Event-ID": evil}))
        for field in ("training_file", "validation_file"):
            job = {"model": MODEL, field: evil, "method": {"type": "reinforcement",
                                                           "reinforcement": {"grader": STRING_CHECK}}}
            if field == "validation_file":
                job["training_file"] = fid
            assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=job), 422, param=field)
        assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={**RG_JOB, "model": evil}), 422,
                     param="model")
        bad_data = {**RG_JOB, "qerl": {**RG_JOB["qerl"], "data": {"train_file": evil}}}
        assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=bad_data), 422)
    # filenames are metadata only: stored files are named by id under the store, whatever the name says
    target = tmp_path / "pwned.jsonl"
    names = [f"../../../../../../..{target}".encode(), str(target).encode(), b"..\\..\\..\\pwned.jsonl",
             b"a/../../b.jsonl", b'x"; filename*=utf-8\'\'evil.sh', b"\xff\xfe.jsonl", b"a\r\nX-Injected: 1"]
    for name in names:
        resp = raw_upload(client, key_a, name, jsonl(training_rows(1)))
        no_500(resp)
        if resp.status_code == 200:
            body = resp.json()
            with db_sessions() as s:
                assert s.get(File, body["id"]).path == f"files/{body['id']}.jsonl"
            got = client.get(f"/v1/files/{body['id']}/content", headers=key_a.headers)
            assert got.status_code == 200 and got.content == jsonl(training_rows(1))
            assert "x-injected" not in got.headers and "\n" not in got.headers.get("content-disposition", "")
    assert not target.exists()
    root = Path(api_settings.artifact_dir).resolve()
    assert all(root in p.resolve().parents for p in root.rglob("*"))


# -- SQL-ish strings ---------------------------------------------------------------------------
def test_sql_ish_strings_in_every_field(client, key_a, key_b, db_sessions):
    fid = upload(client, key_a, jsonl(training_rows(40))).json()["id"]
    other = upload(client, key_b, jsonl(training_rows(40))).json()["id"]
    before = counts(db_sessions)
    made = 0
    for i, evil in enumerate(SQLISH):
        for template in ["/v1/files/{}", "/v1/fine_tuning/jobs/{}", "/v1/fine_tuning/jobs/{}/events",
                         "/v1/adapters/{}", "/v1/models/{}", "/v1/files/{}/content"]:
            assert client.get(template.format(evil), headers=key_a.headers).status_code in (400, 404), evil
        assert client.delete(f"/v1/files/{evil}", headers=key_a.headers).status_code in (400, 404)
        for verb in ("cancel", "pause", "resume"):
            assert client.post(f"/v1/fine_tuning/jobs/{evil}/{verb}", headers=key_a.headers).status_code in (400, 404)
        for path, params in [("/v1/files", {"after": evil, "purpose": evil}), ("/v1/fine_tuning/jobs", {"after": evil}),
                             ("/v1/fine_tuning/jobs", {"status": evil}), ("/v1/adapters", {"after": evil}),
                             ("/v1/files", {"limit": evil}), ("/v1/files", {"order": evil})]:
            resp = client.get(path, params=params, headers=key_a.headers)
            no_500(resp)
            if resp.status_code == 200:
                assert all(o.get("organization_id", key_a.project) == key_a.project for o in resp.json()["data"])
                assert other not in resp.text
        no_500(client.get("/v1/files", headers={"Authorization": f"Bearer {evil}"}))
        assert client.get("/v1/files", headers={"Authorization": f"Bearer {evil}"}).status_code == 401
        # stored literally, returned literally
        job = {"model": MODEL, "training_file": fid, "suffix": evil[:64], "metadata": {evil[:64]: evil},
               "method": {"type": "reinforcement", "reinforcement": {"grader": {**STRING_CHECK, "name": evil,
                                                                                "reference": evil}}}}
        resp = client.post("/v1/fine_tuning/jobs", headers={**key_a.headers, "Idempotency-Key": evil + str(i)},
                           json=job)
        assert resp.status_code == 200, resp.text
        made += 1
        got = client.get(f"/v1/fine_tuning/jobs/{resp.json()['id']}", headers=key_a.headers).json()
        assert got["user_provided_suffix"] == evil[:64] and got["metadata"] == {evil[:64]: evil}
        assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={**job, "training_file": evil}),
                     422, param="training_file")
        assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={**job, "model": evil}), 422)
        resp = raw_upload(client, key_a, evil.encode(), jsonl(training_rows(1)), purpose=evil.encode())
        assert_error(resp, 422, param="purpose")
        ok = raw_upload(client, key_a, evil.encode(), jsonl(training_rows(1)))
        assert ok.status_code == 200 and ok.json()["filename"] == evil
        made += 1
    keys, files, jobs = counts(db_sessions)
    assert keys == before[0] and files + jobs == before[1] + before[2] + made  # nothing dropped, nothing extra
    with db_sessions() as s:  # the tables are intact
        for table in ("api_keys", "files", "jobs", "job_events"):
            assert s.execute(text(f"SELECT count(*) FROM {table}")).scalar() > 0
    assert client.get(f"/v1/files/{other}", headers=key_b.headers).status_code == 200


# -- invalid UTF-8 and NUL -----------------------------------------------------------------------
def test_invalid_utf8_and_nul_anywhere(client, key_a):
    json_h = {**key_a.headers, "Content-Type": "application/json"}
    for raw in [b'{"model": "\xff\xfe"}', b'{"model": "smollm2-135m-instruct", "suffix": "\xc3\x28"}',
                b'\xef\xbb\xbf{"model": 1}', b"\x00\x00\x00{", b'{"model": "\xed\xa0\x80"}']:
        resp = client.post("/v1/fine_tuning/jobs", content=raw, headers=json_h)
        assert resp.status_code in (400, 422), (raw, resp.text)
        no_500(resp)
    for value in ["\ud800", "a\u0000b"]:
        for field in ("suffix", "model"):
            resp = client.post("/v1/fine_tuning/jobs", headers=json_h,
                               content=json.dumps({**RG_JOB, field: value}).encode())
            no_500(resp)
            assert resp.status_code in (400, 422), resp.text
        resp = client.post("/v1/fine_tuning/jobs", headers=json_h,
                           content=json.dumps({**RG_JOB, "metadata": {"k": value}}).encode())
        no_500(resp)
    for path in ["/v1/files/%ff%fe", "/v1/fine_tuning/jobs/%c3%28", "/v1/files/%00", "/v1/fine_tuning/jobs/a%00b",
                 "/v1/adapters/%ed%a0%80/content", "/v1/models/%ff"]:
        resp = client.get(path, headers=key_a.headers)
        assert resp.status_code in (400, 404), (path, resp.status_code, resp.text)
        no_500(resp)
    for query in ["after=%00", "after=%ed%b3%bf", "purpose=a%00", "status=%00", "after=%ff%00", "limit=%00",
                  "after=%C0%AF", "%ff=%fe"]:
        for path in ["/v1/files", "/v1/fine_tuning/jobs", "/v1/adapters", "/v1/fine_tuning/jobs/x/events"]:
            no_500(client.get(f"{path}?{query}", headers=key_a.headers))
    assert client.get("/v1/files", headers={"Authorization": b"Bearer \xff\xfe\x00"}).status_code == 401
    assert client.get("/v1/files", headers={"Authorization": b"\xffearer x"}).status_code == 401


# -- hyperparameters ---------------------------------------------------------------------------
HYPER = "method.reinforcement.hyperparameters"


@pytest.mark.parametrize("field,value,allowed", [
    ("batch_size", -1, "[1, 4096]"), ("batch_size", 0, "[1, 4096]"), ("batch_size", 10**30, "[1, 4096]"),
    ("n_epochs", -3, "[1, 1000]"), ("n_epochs", 10**12, "[1, 1000]"), ("eval_interval", -1, "[0, 1000000]"),
    ("eval_samples", 10**9, "[0, 100000]"), ("learning_rate_multiplier", -1.0, "(0, 1000]"),
    ("learning_rate_multiplier", 0.0, "(0, 1000]"), ("learning_rate_multiplier", 1e308, "(0, 1000]"),
    ("compute_multiplier", 1e9, "(0, 64]"), ("compute_multiplier", -0.5, "(0, 64]"),
])
def test_out_of_range_hyperparameters_name_the_allowed_range(client, key_a, field, value, allowed, db_sessions):
    body = {"model": MODEL, "qerl": RG_JOB["qerl"], "method": {"type": "reinforcement", "reinforcement": {
        "grader": {"type": "reasoning_gym", "name": "task"}, "hyperparameters": {field: value}}}}
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body), 422,
                       param=f"{HYPER}.{field}")
    assert allowed in err["message"] and str(value)[:8] in err["message"], err


@pytest.mark.parametrize("qerl,param,allowed", [
    ({"lora": {"r": 0}}, "qerl.lora.r", "[1, 1024]"), ({"lora": {"r": 10**9}}, "qerl.lora.r", "[1, 1024]"),
    ({"steps": -5}, "qerl.steps", "[1, 1000000]"), ({"steps": 10**20}, "qerl.steps", "[1, 1000000]"),
    ({"rollout": {"temperature": -1}}, "qerl.rollout.temperature", "[0.0, 10.0]"),
    ({"rollout": {"num_generations": 10**6}}, "qerl.rollout.num_generations", "[2, 256]"),
    ({"rollout": {"max_new_tokens": 10**9}}, "qerl.rollout.max_new_tokens", "[1, 32768]"),
    ({"max_runtime_s": -1}, "qerl.max_runtime_s", "(0, 2592000]"),
    ({"max_gpu_memory_gib": -1}, "qerl.max_gpu_memory_gib", "(0, 100000]"),
    ({"max_gpu_memory_gib": 0}, "qerl.max_gpu_memory_gib", "(0, 100000]"),
    ({"max_gpu_memory_gib": "8"}, "qerl.max_gpu_memory_gib", "must be a number"),
    ({"max_gpu_memory_gib": True}, "qerl.max_gpu_memory_gib", "must be a number"),
    ({"memory_plan": "off"}, "qerl.memory_plan", "must be true or false"),
    ({"optim": {"lr": 1e9}}, "qerl.optim.lr", "(0.0, 1.0]"),
    ({"aqn": {"sigma_start": -1e-2}}, "qerl.aqn.sigma_start", "(0.0, 1.0]"),
    ({"prompts_per_step": 10**40}, "qerl.prompts_per_step", "[1, 4096]"),
])
def test_out_of_range_qerl_fields_name_the_allowed_range(client, key_a, qerl, param, allowed, db_sessions):
    body = {**RG_JOB, "qerl": {**RG_JOB["qerl"], **qerl}}
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body), 422, param=param)
    assert allowed in err["message"], err
    with db_sessions() as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.project == key_a.project)) == 0


def test_non_finite_and_huge_numbers(client, key_a):
    json_h = {**key_a.headers, "Content-Type": "application/json"}
    rg = '{"source": "reasoning_gym", "task": "products"}'
    for raw in ['"seed": 1e400', '"seed": -1', '"seed": 99999999999999999999999999999',
                f'"qerl": {{"dataset": {rg}, "optim": {{"lr": NaN}}}}',
                f'"qerl": {{"dataset": {rg}, "steps": Infinity}}',
                '"qerl": {"dataset": {"source": "reasoning_gym", "task": "products", "size": -Infinity}}']:
        body = '{"model": "%s", %s}' % (MODEL, raw if '"qerl"' in raw else raw + f', "qerl": {{"dataset": {rg}}}')
        resp = client.post("/v1/fine_tuning/jobs", content=body.encode(), headers=json_h)
        assert resp.status_code == 422, (body, resp.text)


# -- auth and isolation -------------------------------------------------------------------------
def test_another_project_cannot_read_cancel_delete_or_download(client, key_a, key_b, db_sessions, api_settings,
                                                               tmp_path):
    fid = upload(client, key_a, jsonl(training_rows(2))).json()["id"]
    queued_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=RG_JOB).json()["id"]
    done_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={**RG_JOB, "suffix": "a"}).json()["id"]
    adapter = finish_job_with_adapter(db_sessions, api_settings, done_id, tmp_path)
    for method, path in [("GET", f"/v1/adapters/{adapter.id}"), ("GET", f"/v1/adapters/{adapter.id}/content"),
                         ("GET", f"/v1/models/{adapter.name}"), ("POST", f"/v1/fine_tuning/jobs/{queued_id}/cancel"),
                         ("POST", f"/v1/fine_tuning/jobs/{queued_id}/pause"),
                         ("POST", f"/v1/fine_tuning/jobs/{queued_id}/resume"),
                         ("DELETE", f"/v1/adapters/{adapter.id}"), ("DELETE", f"/v1/models/{adapter.name}"),
                         ("DELETE", f"/v1/files/{fid}"), ("GET", f"/v1/files/{fid}/content"),
                         ("GET", f"/v1/fine_tuning/jobs/{done_id}")]:
        resp = client.request(method, path, headers=key_b.headers)
        assert_error(resp, 404, code="not_found")
        assert adapter.sha256 not in resp.text and "adapter_model" not in resp.text
        assert key_a.project not in resp.text.replace(path.rsplit("/", 1)[-1], "")  # only the id asked for is echoed
    assert client.get("/v1/adapters", headers=key_b.headers).json()["data"] == []
    assert adapter.name not in client.get("/v1/models", headers=key_b.headers).text
    # B uses A's file id in a job: unknown in B's project
    job = {"model": MODEL, "training_file": fid, "method": {"type": "reinforcement",
                                                            "reinforcement": {"grader": STRING_CHECK}}}
    assert_error(client.post("/v1/fine_tuning/jobs", headers=key_b.headers, json=job), 422, param="training_file")
    # nothing of A's changed
    assert client.get(f"/v1/fine_tuning/jobs/{queued_id}", headers=key_a.headers).json()["status"] == "queued"
    assert client.get(f"/v1/files/{fid}", headers=key_a.headers).status_code == 200
    assert client.get(f"/v1/adapters/{adapter.id}/content", headers=key_a.headers).status_code == 200


def test_revoked_and_malformed_keys(client, key_a, db_sessions):
    for header in ["", "Bearer", "Bearer ", "bearer\tsk", "Token " + key_a.secret, key_a.secret,
                   "Bearer " + key_a.secret[:-1], "Bearer " + key_a.secret + "x", "Bearer " + "A" * 10_000,
                   "Bearer " + hash_secret(key_a.secret)]:  # the stored hash is not a key
        resp = client.get("/v1/fine_tuning/jobs", headers={"Authorization": header})
        assert_error(resp, 401, code="invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer" and len(resp.text) < 1000
    assert client.get("/v1/fine_tuning/jobs", headers=key_a.headers).status_code == 200
    with db_sessions() as s:
        key = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(key_a.secret)))
        assert revoke_key(s, key.id)
    for method, path in [("GET", "/v1/files"), ("POST", "/v1/files"), ("POST", "/v1/fine_tuning/jobs"),
                         ("GET", "/v1/adapters"), ("GET", "/v1/models"), ("POST", "/v1/fine_tuning/jobs/x/cancel")]:
        assert_error(client.request(method, path, headers=key_a.headers), 401, code="invalid_api_key")


def test_rate_limit_per_key_with_retry_after(make_client, key_a, key_b):
    limited = make_client(rate_limit_per_minute=60)  # 60 at once, then one per second
    codes = [limited.get("/v1/models", headers=key_a.headers).status_code for _ in range(60)]
    assert codes == [200] * 60
    resp = limited.get("/v1/fine_tuning/jobs", headers=key_a.headers)
    assert_error(resp, 429, code="rate_limit_exceeded")
    wait = int(resp.headers["retry-after"])
    assert 1 <= wait <= 2 and "60 requests per minute" in resp.json()["error"]["message"]
    assert limited.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=RG_JOB).status_code == 429  # writes too
    assert limited.get("/v1/models", headers=key_b.headers).status_code == 200  # per key
    for _ in range(5):  # bad keys are refused before the limiter: they neither pass nor drain anyone's bucket
        assert limited.get("/v1/models", headers={"Authorization": "Bearer sk-qerl-wrong"}).status_code == 401
    time.sleep(wait)
    assert limited.get("/v1/models", headers=key_a.headers).status_code == 200  # Retry-After was honest


# -- data safety -------------------------------------------------------------------------------
def test_downloads_check_the_recorded_sha256(client, key_a, db_sessions, api_settings, tmp_path):
    data = jsonl(training_rows(3))
    f = upload(client, key_a, data).json()
    assert f["qerl"]["sha256"] == hashlib.sha256(data).hexdigest()
    got = client.get(f"/v1/files/{f['id']}/content", headers=key_a.headers)
    assert got.content == data and got.headers["x-checksum-sha256"] == f["qerl"]["sha256"]
    stored = Path(api_settings.artifact_dir) / "files" / f"{f['id']}.jsonl"
    stored.write_bytes(data[:-5] + b"XXXX\n")  # bit rot of the same size
    err = assert_error(client.get(f"/v1/files/{f['id']}/content", headers=key_a.headers), 503, code="artifact_corrupt")
    assert "sha256" in err["message"]
    stored.write_bytes(data)
    assert client.get(f"/v1/files/{f['id']}/content", headers=key_a.headers).content == data
    stored.unlink()
    assert_error(client.get(f"/v1/files/{f['id']}/content", headers=key_a.headers), 503, code="artifact_missing")

    job_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=RG_JOB).json()["id"]
    adapter = finish_job_with_adapter(db_sessions, api_settings, job_id, tmp_path)
    archive = Path(api_settings.artifact_dir) / adapter.path
    good = archive.read_bytes()
    assert hashlib.sha256(client.get(f"/v1/adapters/{adapter.id}/content", headers=key_a.headers).content
                          ).hexdigest() == adapter.sha256
    archive.write_bytes(good[: len(good) // 2])  # truncated
    assert_error(client.get(f"/v1/adapters/{adapter.id}/content", headers=key_a.headers), 503, code="artifact_corrupt")
    archive.write_bytes(good)


def test_uploads_are_written_to_a_temp_name_then_renamed(client, key_a, api_settings, monkeypatch):
    """Watch the store's file system calls during one upload: bytes go to tmp/*.part, fsync, then
    one os.replace onto files/<id>.jsonl; nothing is ever opened for writing under files/."""
    import builtins
    import os

    from service import storage

    opened, replaced, real_open, real_replace = [], [], builtins.open, os.replace

    def spy_open(file, mode="r", *a, **kw):
        if "w" in mode or "a" in mode:
            opened.append(Path(file))
        return real_open(file, mode, *a, **kw)

    def spy_replace(src, dst, *a, **kw):
        replaced.append((Path(src), Path(dst)))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(storage, "open", spy_open, raising=False)
    monkeypatch.setattr(storage.os, "replace", spy_replace)
    f = upload(client, key_a, jsonl(training_rows(2))).json()
    root = Path(api_settings.artifact_dir).resolve()
    assert [p.parent.name for p in opened] == ["tmp"] and opened[0].suffix == ".part"
    assert replaced == [(opened[0], root / "files" / f"{f['id']}.jsonl")]
    assert not opened[0].exists()


def test_deleting_a_file_of_a_queued_job_is_refused(client, key_a):
    fid = upload(client, key_a, jsonl(training_rows(2))).json()["id"]
    val = upload(client, key_a, jsonl(training_rows(2))).json()["id"]
    job = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={
        "model": MODEL, "training_file": fid, "validation_file": val,
        "method": {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}}).json()
    for file_id in (fid, val):
        err = assert_error(client.delete(f"/v1/files/{file_id}", headers=key_a.headers), 409, code="file_in_use")
        assert job["id"] in err["message"]
        assert client.get(f"/v1/files/{file_id}/content", headers=key_a.headers).status_code == 200
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=key_a.headers).status_code == 200
    for file_id in (fid, val):
        assert client.delete(f"/v1/files/{file_id}", headers=key_a.headers).status_code == 200
        assert client.get(f"/v1/files/{file_id}/content", headers=key_a.headers).status_code == 404
