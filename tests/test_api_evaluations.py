"""/v1/evaluations: an evaluation of a fine-tuned model on an uploaded test file is queued as a job
row of its own kind (the training job's grader by default), listed apart from fine-tuning jobs,
cancelled as they are, and holds its adapter and file against deletion until it ends; a bad request
names the field and writes nothing. The worker's run of it is tested end to end in test_cli_e2e."""
from __future__ import annotations

from sqlalchemy import func, select

from service import queue
from service.models import Job, WebhookEvent
from tests.conftest import STRING_CHECK, jsonl, training_rows
from tests.test_api_adapters import finish_job_with_adapter
from tests.test_api_files import assert_error, upload
from tests.test_api_jobs import body


def _trained(client, key, db_sessions, settings, tmp_path):
    """A succeeded training job with its adapter, and a test file of rows its grader can read."""
    fid = upload(client, key, jsonl(training_rows(40))).json()["id"]
    job_id = client.post("/v1/fine_tuning/jobs", headers=key.headers, json=body(fid)).json()["id"]
    adapter = finish_job_with_adapter(db_sessions, settings, job_id, tmp_path)
    test_id = upload(client, key, jsonl(training_rows(5)), name="test.jsonl").json()["id"]
    return job_id, adapter, test_id


def _evaluations(db_sessions, project: str) -> int:
    with db_sessions() as s:
        return s.scalar(select(func.count()).select_from(Job).where(Job.project == project, Job.kind == "eval"))


def test_an_evaluation_is_queued_listed_apart_and_cancelled(client, key_a, key_b, db_sessions, api_settings,
                                                            tmp_path):
    job_id, adapter, test_id = _trained(client, key_a, db_sessions, api_settings, tmp_path)
    made = []
    for ref in (adapter.name, job_id, adapter.id):  # a fine-tuned model, its job or its adapter: the same LoRA
        resp = client.post("/v1/evaluations", headers=key_a.headers,
                           json={"model": ref, "file": test_id, "limit": 3, "metadata": {"by": ref[:8]}})
        assert resp.status_code == 200, resp.text
        made.append(resp.json())
    for ev in made:
        assert ev["object"] == "evaluation" and ev["id"].startswith("evaljob-") and ev["status"] == "queued"
        assert (ev["model"], ev["file"], ev["limit"], ev["compare_base"]) == (adapter.name, test_id, 3, True)
        assert ev["grader"] == STRING_CHECK  # the training job's own
        assert ev["result"] is None and ev["result_files"] == [] and ev["queue_position"] >= 1
    own_body = {"model": adapter.name, "file": test_id, "compare_base": False, "max_new_tokens": 16,
                "grader": {**STRING_CHECK, "operation": "like"}}
    once = {**key_a.headers, "Idempotency-Key": "eval-once"}
    own = client.post("/v1/evaluations", headers=once, json=own_body).json()
    assert client.post("/v1/evaluations", headers=once, json=own_body).json()["id"] == own["id"]  # a retry: the same
    assert_error(client.post("/v1/evaluations", headers=once, json={**own_body, "limit": 2}), 422,
                 "Idempotency-Key", "idempotency_key_reused")
    assert own["grader"]["operation"] == "like" and (own["compare_base"], own["max_new_tokens"]) == (False, 16)

    listed = client.get("/v1/evaluations", headers=key_a.headers).json()
    assert [e["id"] for e in listed["data"]] == [own["id"], *[e["id"] for e in reversed(made)]]  # newest first
    assert client.get("/v1/evaluations?status=queued&limit=2", headers=key_a.headers).json()["has_more"] is True
    by_model = client.get("/v1/evaluations", params={"model": adapter.name}, headers=key_a.headers).json()["data"]
    assert len(by_model) == 4 and client.get("/v1/evaluations?model=ft:other", headers=key_a.headers).json()["data"] == []
    jobs = client.get("/v1/fine_tuning/jobs", headers=key_a.headers).json()["data"]
    assert [j["id"] for j in jobs] == [job_id]  # evaluations are not fine-tuning jobs
    got = client.get(f"/v1/evaluations/{own['id']}", headers=key_a.headers).json()
    assert got["id"] == own["id"] and got["status"] == "queued"
    assert_error(client.get(f"/v1/fine_tuning/jobs/{own['id']}", headers=key_a.headers), 404)
    assert_error(client.get(f"/v1/evaluations/{job_id}", headers=key_a.headers), 404, "evaluation_id")
    events = client.get(f"/v1/evaluations/{own['id']}/events", headers=key_a.headers).json()["data"]
    assert [e["message"] for e in events] == [f"Created evaluation: {own['id']}"]
    assert_error(client.get(f"/v1/evaluations/{job_id}/events", headers=key_a.headers), 404, "evaluation_id")
    assert_error(client.get(f"/v1/fine_tuning/jobs/{own['id']}/events", headers=key_a.headers), 404)
    assert_error(client.post(f"/v1/fine_tuning/jobs/{own['id']}/cancel", headers=key_a.headers), 404)
    assert_error(client.get(f"/v1/evaluations/{own['id']}", headers=key_b.headers), 404)  # another project's
    assert client.get("/v1/evaluations", headers=key_b.headers).json()["data"] == []
    assert_error(client.post("/v1/evaluations", headers=key_b.headers, json={"model": adapter.name, "file": test_id}),
                 422, "model", "model_not_found")

    cancelled = client.post(f"/v1/evaluations/{own['id']}/cancel", headers=key_a.headers).json()
    assert cancelled["status"] == "cancelled"
    assert_error(client.post(f"/v1/evaluations/{own['id']}/cancel", headers=key_a.headers), 409,
                 "evaluation_id", "evaluation_not_cancellable")
    with db_sessions() as s:
        assert s.scalar(select(WebhookEvent.type).where(WebhookEvent.job_id == own["id"])) == "evaluation.cancelled"
    for ev in made:
        client.post(f"/v1/evaluations/{ev['id']}/cancel", headers=key_a.headers)


def test_an_evaluation_holds_its_adapter_and_file_until_it_ends(client, key_a, db_sessions, api_settings, tmp_path):
    _, adapter, test_id = _trained(client, key_a, db_sessions, api_settings, tmp_path)
    ev = client.post("/v1/evaluations", headers=key_a.headers, json={"model": adapter.name, "file": test_id}).json()
    assert_error(client.delete(f"/v1/models/{adapter.name}", headers=key_a.headers), 409, "model", "model_in_use")
    assert_error(client.delete(f"/v1/files/{test_id}", headers=key_a.headers), 409, "file_id", "file_in_use")
    with db_sessions() as s:  # a worker runs it and records its scores
        job = queue.claim(s, ev["id"], "test-worker", lease_seconds=60)
        scores = {"fine_tuned": {"accuracy": 0.6, "reward_mean": 0.6}, "base": {"accuracy": 0.2, "reward_mean": 0.2},
                  "rows": 5, "base_model": adapter.base_model, "quantization": "nvfp4", "device": "cpu",
                  "max_new_tokens": 64, "grader": "answer"}
        assert queue.finish(s, ev["id"], job.attempt, "succeeded", outcome=scores) == "succeeded"
        assert s.scalar(select(WebhookEvent.type).where(WebhookEvent.job_id == ev["id"])) == "evaluation.succeeded"
    done = client.get(f"/v1/evaluations/{ev['id']}", headers=key_a.headers).json()
    assert done["status"] == "succeeded" and done["result"] == scores and done["finished_at"] >= done["created_at"]
    assert client.delete(f"/v1/files/{test_id}", headers=key_a.headers).status_code == 200
    assert client.delete(f"/v1/models/{adapter.name}", headers=key_a.headers).status_code == 200
    gone = client.post("/v1/evaluations", headers=key_a.headers, json={"model": adapter.name, "file": test_id})
    assert_error(gone, 422, "model", "model_not_found")


def test_a_bad_evaluation_request_names_the_field_and_writes_nothing(client, key_a, db_sessions, api_settings,
                                                                     tmp_path):
    job_id, adapter, test_id = _trained(client, key_a, db_sessions, api_settings, tmp_path)
    results = upload(client, key_a, b"step,x\n1,2\n", name="r.csv", purpose="fine-tune")
    no_answer = upload(client, key_a, jsonl([{"prompt": "What is 2 + 2?"}] * 3), name="q.jsonl").json()["id"]
    before = _evaluations(db_sessions, key_a.project)
    cases = [
        ({"model": "ft:nothing:here:x:y", "file": test_id}, "model", "model_not_found"),
        ({"model": "ftjob-0123456789abcdef01234567", "file": test_id}, "model", "model_not_found"),
        ({"model": adapter.name, "file": "file-missing"}, "file", "file_not_found"),
        ({"model": adapter.name, "file": no_answer}, "file", None),  # the grader reads item.answer
        ({"model": adapter.name, "file": test_id, "grader": {"type": "string_check", "name": "x",
                                                             "input": "{{sample.output_text}}",
                                                             "reference": "{{item.answer}}", "operation": "nope"}},
         "grader.operation", None),
        ({"model": adapter.name, "file": test_id, "max_new_tokens": 0}, "max_new_tokens", None),
        ({"model": adapter.name, "file": test_id, "limit": 0}, "limit", None),
        ({"model": adapter.name}, "file", "missing_required"),
        ({"model": adapter.name, "file": test_id, "dataset": {"task": "products"}}, "file", "missing_required"),
        ({"model": adapter.name, "dataset": {"task": "no_such_task"}}, "dataset.task", None),
        ({"model": adapter.name, "dataset": {"task": "products", "size": 0}}, "size", None),
        ({"model": adapter.name, "dataset": {"task": "products", "rows": 3}}, "rows", None),
        ({"model": adapter.name, "file": test_id, "steps": 3}, "steps", None),
    ]
    if results.status_code == 200:  # a file that is no JSONL of rows is refused at upload already
        cases.append(({"model": adapter.name, "file": results.json()["id"]}, "file", None))
    for req, param, code in cases:
        err = assert_error(client.post("/v1/evaluations", headers=key_a.headers, json=req), 422, code=code)
        assert err["param"] == param or err["param"].endswith(param), (req, err)
    missing = client.post("/v1/evaluations", headers=key_a.headers, json={"model": adapter.name, "file": no_answer})
    assert "answer" in missing.json()["error"]["message"]
    assert _evaluations(db_sessions, key_a.project) == before


def test_fresh_questions_of_a_task_leave_out_those_the_model_trained_on(client, key_a, db_sessions, api_settings,
                                                                       tmp_path):
    """``dataset`` instead of a file: a reasoning-gym task's fresh questions, drawn as the worker
    will draw them. A model trained on every question its task's config has (single-digit products)
    leaves none to hold out: 422 naming ``dataset`` at once, not a failed evaluation later."""
    small = {"source": "reasoning_gym", "task": "products", "size": 400,
             "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    made = client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                       json={"model": body("x")["model"], "qerl": {"dataset": small}}).json()
    adapter = finish_job_with_adapter(db_sessions, api_settings, made["id"], tmp_path)
    before = _evaluations(db_sessions, key_a.project)
    err = assert_error(client.post("/v1/evaluations", headers=key_a.headers,
                                   json={"model": adapter.name, "dataset": {"task": "products"}}), 422, "dataset")
    assert "too few questions to hold any out" in err["message"]
    assert _evaluations(db_sessions, key_a.project) == before
    other = client.post("/v1/evaluations", headers=key_a.headers,  # another task: its own default config
                        json={"model": adapter.name, "dataset": {"task": "basic_arithmetic", "size": 5, "seed": 7}})
    assert other.status_code == 200, other.text
    ev = other.json()
    assert (ev["file"], ev["dataset"], ev["grader"]) == (None, {"task": "basic_arithmetic", "size": 5, "seed": 7},
                                                          {"type": "reasoning_gym", "name": "task"})
    client.post(f"/v1/evaluations/{ev['id']}/cancel", headers=key_a.headers)
