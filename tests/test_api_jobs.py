"""/v1/fine_tuning/jobs against Postgres and SQLite: create (request -> TrainSpec), every bad
input answering the right status in OpenAI's shape with no row left, list/retrieve/cancel,
pause/resume,
Idempotency-Key (sequential and 20 concurrent requests), metrics and checkpoints."""
from __future__ import annotations

import concurrent.futures
import re
import secrets

import httpx
import pytest
from sqlalchemy import func, select

from engine.spec import TrainSpec
from service import queue
from service.models import Checkpoint, File, Job, JobMetric
from tests.conftest import STRING_CHECK, jsonl, training_rows
from tests.test_api_files import assert_error, upload

MODEL = "smollm2-135m-instruct"
RG = {"source": "reasoning_gym", "task": "products", "size": 40}


def body(file_id: str, **over) -> dict:
    return {"model": MODEL, "training_file": file_id,
            "method": {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}, **over}


@pytest.fixture
def file_id(client, key_a) -> str:
    return upload(client, key_a, jsonl(training_rows(40))).json()["id"]


def job_count(db_sessions, project: str) -> int:
    with db_sessions() as s:
        return s.scalar(select(func.count()).select_from(Job).where(Job.project == project))


def test_create_maps_the_request_to_a_train_spec(client, key_a, file_id, db_sessions):
    req = body(file_id, seed=7, suffix="adder", metadata={"team": "math"},
               method={"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK, "hyperparameters": {
                   "n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 2.0, "compute_multiplier": 2}}},
               qerl={"quantization": "nf4", "algorithm": "grpo", "lora": {"r": 8}, "aqn": {"enabled": False}})
    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=req)
    assert resp.status_code == 200, resp.text
    job = resp.json()
    assert job["object"] == "fine_tuning.job" and job["id"].startswith("ftjob-")
    assert job["status"] == "queued" and job["model"] == MODEL and job["seed"] == 7
    assert job["training_file"] == file_id and job["validation_file"] is None
    assert job["user_provided_suffix"] == "adder" and job["metadata"] == {"team": "math"}
    assert job["organization_id"] == key_a.project and job["error"] is None and job["finished_at"] is None
    assert job["method"]["type"] == "reinforcement" and job["method"]["reinforcement"]["grader"] == STRING_CHECK
    assert job["hyperparameters"]["batch_size"] == 4 and job["hyperparameters"]["learning_rate_multiplier"] == 2.0
    spec = TrainSpec.from_dict(job["qerl"]["spec"])  # what the worker will run, valid as stored
    assert spec.quantization == "nf4" and spec.rl.algorithm == "grpo" and spec.lora.r == 8
    assert spec.aqn.enabled is False and spec.prompts_per_step == 4 and spec.rollout.num_generations == 8
    # ceil(2 epochs * 30 rows / 4): a quarter of the 40 rows' prompts is held out
    assert spec.optim.lr == pytest.approx(2e-5) and spec.steps == 15 and spec.data.eval_size == 10
    assert spec.data.train_file == f"files/{file_id}.jsonl" and spec.data.dataset is None
    assert job["qerl"]["progress"] == {"step": 0, "total_steps": 15, "stopped_early": False} and job["qerl"]["attempt"] == 0
    with db_sessions() as s:
        row = s.get(Job, job["id"])
        assert row.project == key_a.project and row.request["seed"] == 7 and row.spec == job["qerl"]["spec"]
        assert row.wakeup_sent_at is not None  # queue.wake ran after the commit


def test_create_with_a_builtin_dataset(client, key_a):
    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                       json={"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "qerl": {"dataset": RG, "steps": 3}})
    assert resp.status_code == 200, resp.text
    job = resp.json()
    assert job["model"] == MODEL and job["training_file"] is None and job["qerl"]["dataset"] == RG
    assert job["qerl"]["spec"]["grader"]["type"] == "reasoning_gym" and job["qerl"]["spec"]["steps"] == 3
    assert 0 <= job["seed"] < 2**31


def test_a_builtin_dataset_whose_package_cannot_be_imported_is_a_503_that_creates_nothing(
        client, key_a, db_sessions, monkeypatch):
    """reasoning-gym (or a package it imports) missing on the server is the server's install, not
    the request: 503 dataset_unavailable naming the package and what to do, and no job row."""
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={"model": MODEL, "qerl": {"dataset": RG}})
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["code"] == "dataset_unavailable" and err["param"] == "qerl.dataset", err
    assert "reasoning_gym cannot be imported here" in err["message"] and "training_file" in err["message"], err
    assert job_count(db_sessions, key_a.project) == 0


BAD = [  # (request body or raw bytes, status, param)
    (b'{"model": "smollm2-135m-instruct", ', 400, None),
    (b'["a list"]', 400, None),
    ({"model": 12, "qerl": {"dataset": RG}}, 422, "model"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "seed": "7"}, 422, "seed"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "surprise": 1}, 422, "surprise"),
    ({"qerl": {"dataset": RG}}, 422, "model"),
    ({"model": "gpt-4o", "qerl": {"dataset": RG}}, 422, "model"),
    ({"model": "/etc/passwd", "qerl": {"dataset": RG}}, 422, "model"),
    ({"model": MODEL}, 422, "training_file"),
    ({"model": MODEL, "training_file": "file-missing", "method": {"type": "reinforcement", "reinforcement":
                                                                  {"grader": STRING_CHECK}}}, 422, "training_file"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "method": {"type": "supervised"}}, 422, "method.type"),
    ({"model": MODEL, "qerl": {"dataset": RG, "lora": {"r": 0}}}, 422, "qerl.lora.r"),
    ({"model": MODEL, "qerl": {"dataset": RG, "quantization": "int3"}}, 422, "qerl.quantization"),
    ({"model": MODEL, "qerl": {"dataset": RG, "final_adapter": "best"}}, 422, "qerl.final_adapter"),
    ({"model": MODEL, "qerl": {"dataset": RG, "final_adapter": "best_eval", "data": {"eval_size": 0}}}, 422,
     "qerl.final_adapter"),
    ({"model": MODEL, "qerl": {"dataset": RG, "bogus": 1}}, 422, "qerl.bogus"),
    ({"model": MODEL, "qerl": {"dataset": RG, "optim": 3}, "method": {"type": "reinforcement", "reinforcement": {
        "grader": STRING_CHECK, "hyperparameters": {"learning_rate_multiplier": 2.0}}}}, 422, "qerl.optim"),
    ({"model": MODEL, "qerl": {"dataset": RG, "model": "/models/any"}}, 422, "qerl.model"),
    ({"model": MODEL, "qerl": {"dataset": RG, "grader": {"type": "python"}}}, 422, "qerl.grader"),
    ({"model": MODEL, "qerl": {"dataset": RG, "data": {"train_file": "/etc/passwd"}}}, 422, "qerl.data.train_file"),
    ({"model": MODEL, "qerl": {"dataset": {"source": "hub", "task": "x"}}}, 422, "qerl.dataset"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "method": {"type": "reinforcement", "reinforcement": {
        "grader": {**STRING_CHECK, "operation": "approx"}}}}, 422, "method.reinforcement.grader.operation"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "method": {"type": "reinforcement", "reinforcement": {
        "grader": {"type": "score_model", "model": "judge", "input": [{"role": "user", "content": "x"}]}}}}, 422,
     "method.reinforcement.grader.type"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "method": {"type": "reinforcement", "reinforcement": {
        "grader": STRING_CHECK, "hyperparameters": {"batch_size": "big"}}}}, 422,
     "method.reinforcement.hyperparameters.batch_size"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "suffix": "s" * 65}, 422, "suffix"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "metadata": {"k": "v" * 513}}, 422, "metadata.k"),
    # a built-in dataset no larger than the held-out evaluation set: rejected here, not in the worker
    ({"model": MODEL, "qerl": {"dataset": {**RG, "size": 8}, "data": {"eval_size": 8}}}, 422, "qerl.data.eval_size"),
    ({"model": MODEL, "qerl": {"dataset": RG, "data": {"eval_size": 40}}}, 422, "qerl.data.eval_size"),
    # a spec field set through an OpenAI hyperparameter: the error names the hyperparameter
    ({"model": MODEL, "qerl": {"dataset": RG}, "method": {"type": "reinforcement", "reinforcement": {
        "grader": STRING_CHECK, "hyperparameters": {"eval_samples": 40}}}}, 422,
     "method.reinforcement.hyperparameters.eval_samples"),
    ({"model": MODEL, "qerl": {"dataset": RG}, "hyperparameters": {"eval_samples": 40}}, 422,
     "hyperparameters.eval_samples"),
    # early stopping counts evaluations between the start and the end: none are asked for
    ({"model": MODEL, "qerl": {"dataset": RG, "early_stop_patience": 2}}, 422, "qerl.early_stop_patience"),
    # the task's name and config are reasoning-gym's to judge: checked before anything is queued
    ({"model": MODEL, "qerl": {"dataset": {**RG, "task": "no_such_task"}}}, 422, "qerl.dataset"),
    ({"model": MODEL, "qerl": {"dataset": {**RG, "config": {"min_digits": 3, "max_digits": 1}}}}, 422, "qerl.dataset"),
    ({"model": MODEL, "qerl": {"dataset": {**RG, "config": {"seed": 1}}}}, 422, "qerl.dataset"),
]


def test_a_small_training_file_holds_out_a_quarter_and_one_no_larger_than_the_eval_set_is_refused(
        client, key_a, db_sessions):
    """Without a validation file, data.eval_size rows are held out of the training file: 32 unless
    set, a quarter of a file of fewer than 128 rows (so a small file trains on most of its rows); an
    eval_size no smaller than the file is a 422 naming the field (or the hyperparameter that set it),
    not a job that fails once the worker loads it; with a validation file, or fewer held out, the
    same file is accepted."""
    small = upload(client, key_a, jsonl(training_rows(10))).json()["id"]
    large = upload(client, key_a, jsonl(training_rows(200))).json()["id"]
    method = {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}
    for file_id, extra, held in ((small, {}, 2), (large, {}, 32), (small, {"qerl": {"data": {"eval_size": 9}}}, 9),
                                 (small, {"validation_file": small}, 32)):
        resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id, method=method, **extra))
        assert resp.status_code == 200, resp.text
        assert resp.json()["qerl"]["spec"]["data"]["eval_size"] == held, resp.json()["qerl"]
    assert job_count(db_sessions, key_a.project) == 4
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                                   json=body(small, method=method, qerl={"data": {"eval_size": 10}})), 422,
                       param="qerl.data.eval_size")
    assert "10 rows" in err["message"] and "validation_file" in err["message"]
    hyper = {"type": "reinforcement",
             "reinforcement": {"grader": STRING_CHECK, "hyperparameters": {"eval_samples": 10}}}
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(small, method=hyper)),
                       422, param="method.reinforcement.hyperparameters.eval_samples")
    assert err["message"].startswith("method.reinforcement.hyperparameters.eval_samples: data.eval_size=10")
    assert job_count(db_sessions, key_a.project) == 4


def test_the_held_out_split_is_sized_by_distinct_prompts(client, key_a, db_sessions):
    """An upload counts its distinct questions (the final user turn, as the split compares them): a
    file of 40 rows asking 8 questions holds out 2 of them, not 10 (a quarter of its rows: more than
    it has questions, so the worker would fail the job); asking to hold out all 8 is a 422 saying the
    file has 8 distinct prompts in 40 rows."""
    rows = [{"messages": [{"role": "system", "content": f"Style {i}."}, {"role": "user", "content": f"Q{i % 8}?"}],
             "answer": "x"} for i in range(40)]
    file_id = upload(client, key_a, jsonl(rows)).json()["id"]
    with db_sessions() as s:
        assert s.get(File, file_id).prompts == 8
    method = {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}
    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id, method=method))
    assert resp.status_code == 200, resp.text
    assert resp.json()["qerl"]["spec"]["data"]["eval_size"] == 2
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                                   json=body(file_id, method=method, qerl={"data": {"eval_size": 8}})), 422,
                       param="qerl.data.eval_size")
    assert "8 distinct prompts (in 40 rows)" in err["message"], err["message"]
    assert job_count(db_sessions, key_a.project) == 1


def test_a_file_uploaded_before_uploads_counted_is_counted_by_its_first_job(client, key_a, db_sessions):
    """A file whose row has no field or prompt counts (uploaded before migrations 0006 and 0007) is
    counted when a job first uses it: the held-out split is sized by its distinct prompts, a grader
    reading a field some rows lack is refused at creation, and the counts stay with the file once
    a job is created (a refused job leaves it as it was)."""
    rows = [{"prompt": f"Q{i % 8}?", "answer": "x"} for i in range(39)] + [{"prompt": "Q9?", "answr": "x"}]
    file_id = upload(client, key_a, jsonl(rows)).json()["id"]

    def forget() -> None:
        with db_sessions() as s:
            f = s.get(File, file_id)
            f.fields, f.prompts = None, None
            s.commit()

    def counts() -> tuple:
        with db_sessions() as s:
            f = s.get(File, file_id)
            return f.fields, f.prompts

    forget()
    method = {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id, method=method)),
                       422, param="training_file")
    assert "item.answer is in 39 of 40 rows" in err["message"], err["message"]
    assert counts() == (None, None) and job_count(db_sessions, key_a.project) == 0
    grader = {**STRING_CHECK, "reference": "x"}  # reads no item field
    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                       json=body(file_id, method={"type": "reinforcement", "reinforcement": {"grader": grader}}))
    assert resp.status_code == 200, resp.text
    assert resp.json()["qerl"]["spec"]["data"]["eval_size"] == 2  # a quarter of 9 distinct prompts, not of 40 rows
    assert counts() == ({"prompt": 40, "answer": 39, "answr": 1}, 9)


def test_n_epochs_counts_the_rows_the_held_out_prompts_leave(client, key_a, db_sessions):
    """n_epochs passes over the training split: the file less the rows of its held-out prompts (all
    of a repeated prompt's rows go with it), the whole file with a validation file or nothing held
    out; a built-in task's questions less those held out."""
    rows = [{"prompt": f"Q{i % 8}?", "answer": "x"} for i in range(40)]  # 8 prompts, 5 rows each
    file_id = upload(client, key_a, jsonl(rows)).json()["id"]

    def steps(extra: dict, **hyper) -> int:
        method = {"type": "reinforcement", "reinforcement": {
            "grader": STRING_CHECK, "hyperparameters": {"n_epochs": 1, "batch_size": 5, **hyper}}}
        resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id, method=method, **extra))
        assert resp.status_code == 200, resp.text
        return resp.json()["qerl"]["spec"]["steps"]

    assert steps({}) == 6  # 2 of 8 prompts held out: 30 rows
    assert steps({}, eval_samples=4) == 4  # 20 rows
    assert steps({}, eval_samples=0) == 8
    assert steps({"validation_file": file_id}) == 8
    assert steps({"training_file": None, "qerl": {"dataset": {**RG, "size": 60}}}) == 9  # 60 - 15 questions
    assert job_count(db_sessions, key_a.project) == 5


def test_a_small_built_in_dataset_holds_out_a_quarter(client, key_a, db_sessions):
    """A built-in task of fewer than 128 questions holds out a quarter of them unless eval_size is set
    (it had been a 422 below 33 questions); one of 3 holds out none."""
    for size, held in ((8, 2), (60, 15), (500, 32), (3, 0)):
        resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                           json={"model": MODEL, "qerl": {"dataset": {**RG, "size": size}}})
        assert resp.status_code == 200, resp.text
        assert resp.json()["qerl"]["spec"]["data"]["eval_size"] == held
    assert job_count(db_sessions, key_a.project) == 4


def test_a_file_whose_rows_lack_a_field_the_grader_reads_is_refused_at_create(client, key_a, db_sessions):
    """Each upload's top-level fields are counted: a grader reading {{item.answer}} of a file some of
    whose rows lack it is a 422 naming the file, how many rows have it and the fields they have (a
    typo on either side shows), not a job that fails at its first rollout; checked for the
    validation file too; a grader that does not read the field takes the same file."""
    rows = training_rows(40)
    typo = [{"answr" if k == "answer" else k: v for k, v in r.items()} if i in (4, 11) else r
            for i, r in enumerate(rows)]
    bad = upload(client, key_a, jsonl(typo)).json()["id"]
    good = upload(client, key_a, jsonl(rows)).json()["id"]
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(bad)), 422,
                       param="training_file")
    assert err["message"] == (f"training_file {bad}: the grader reads fields every row must have: item.answer is "
                              "in 38 of 40 rows; the rows' fields are answer, answr, messages. Add 'answer' to every "
                              "row, or change what the grader reads"), err
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                                   json=body(good, validation_file=bad)), 422, param="validation_file")
    assert err["message"].startswith(f"validation_file {bad}: "), err
    assert job_count(db_sessions, key_a.project) == 0
    literal = {**STRING_CHECK, "reference": "4"}
    method = {"type": "reinforcement", "reinforcement": {"grader": literal}}
    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(bad, method=method))
    assert resp.status_code == 200, resp.text
    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(good, validation_file=good))
    assert resp.status_code == 200, resp.text


def test_a_python_grader_reading_a_field_rows_lack_is_refused_at_create(client, key_a, db_sessions):
    """A python grader whose code reads item["answer"] on every call is refused over a file some of
    whose rows lack it (it would raise KeyError at such a row's first sample); one that reads it
    with item.get, or only on some paths, takes the same file."""
    rows = training_rows(20)
    typo = [{"answr" if k == "answer" else k: v for k, v in r.items()} if i == 3 else r for i, r in enumerate(rows)]
    bad = upload(client, key_a, jsonl(typo)).json()["id"]

    def create(source: str) -> httpx.Response:
        method = {"type": "reinforcement", "reinforcement": {"grader": {"type": "python", "name": "py",
                                                                         "source": source}}}
        return client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(bad, method=method))

    err = assert_error(create("def grade(sample, item):\n"
                              "    return float(sample['output_text'].strip() == str(item['answer']))\n"),
                       422, param="training_file")
    assert "item.answer is in 19 of 20 rows" in err["message"], err
    assert job_count(db_sessions, key_a.project) == 0
    for source in ("def grade(sample, item):\n    return float(sample['output_text'] == item.get('answer'))\n",
                   "def grade(sample, item):\n    if 'answer' not in item:\n        return 0.0\n"
                   "    return float(sample['output_text'] == item['answer'])\n"):
        assert create(source).status_code == 200
    assert job_count(db_sessions, key_a.project) == 2


def test_rows_naming_no_task_for_a_reasoning_gym_grader_without_one_are_refused_at_create(client, key_a,
                                                                                        db_sessions):
    """A reasoning_gym grader without a task scores each row by the task the row names: a file where
    too few rows have a "task" (or "metadata") field for every row to name one is a 422 naming the
    grader and the counts; the grader with a task, or rows that all name one, are accepted."""
    rows = training_rows(40)
    named = [{**r, "task": "products"} for r in rows]
    some = [{**r, "task": "products"} if i % 2 else r for i, r in enumerate(rows)]
    ids = {name: upload(client, key_a, jsonl(r)).json()["id"] for name, r in
           (("none", rows), ("some", some), ("all", named))}
    rg = {"type": "reasoning_gym", "name": "rg"}
    multi = {"type": "multi", "calculate_output": "s + rg", "graders": {"s": STRING_CHECK, "rg": rg}}
    for created, grader in enumerate((rg, multi)):
        method = {"type": "reinforcement", "reinforcement": {"grader": grader}}
        for name, have in (("none", 0), ("some", 20)):
            err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                                           json=body(ids[name], method=method)), 422, param="training_file")
            assert err["message"] == (
                f"training_file {ids[name]}: the reasoning_gym grader 'rg' has no task, so every row must name "
                f"one (a \"task\" field or metadata.source_dataset): {have} of 40 rows have \"task\", 0 have "
                "\"metadata\"; set the grader's task, or give every row a task"), err
        assert job_count(db_sessions, key_a.project) == created
        resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(ids["all"], method=method))
        assert resp.status_code == 200, resp.text
    method = {"type": "reinforcement", "reinforcement": {"grader": {**rg, "task": "products"}}}
    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(ids["none"], method=method))
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("req,status,param", BAD, ids=[f"{i}-{b[1]}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_answer_openai_errors_and_create_nothing(client, key_a, db_sessions, req, status, param):
    if isinstance(req, bytes):
        resp = client.post("/v1/fine_tuning/jobs", headers={**key_a.headers, "Content-Type": "application/json"},
                           content=req)
    else:
        resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=req)
    err = assert_error(resp, status, param=param)
    assert resp.headers["x-should-retry"] == "false"
    if param:
        assert param.split(".")[-1] in err["message"] or "model" in err["message"]
    assert job_count(db_sessions, key_a.project) == 0


def test_a_value_no_form_of_a_field_accepts_is_one_message_naming_every_form(client, key_a, db_sessions):
    """batch_size takes an integer or "auto": a value that is neither names both (pydantic reports one
    error per form), and only errors at other fields count as more errors."""
    def create(hyper: dict) -> dict:
        method = {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK, "hyperparameters": hyper}}
        resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json={"model": MODEL, "method": method,
                                                                                 "qerl": {"dataset": RG}})
        return assert_error(resp, 422, param="method.reinforcement.hyperparameters.batch_size")

    err = create({"batch_size": "big"})
    assert err["message"] == ("Invalid value for 'method.reinforcement.hyperparameters.batch_size': Input should be "
                              "'auto' or a valid integer (got \"big\")."), err
    err = create({"batch_size": "big", "n_epochs": "many"})
    assert err["message"].endswith("(got \"big\"). (1 more error(s) in this request.)"), err
    assert job_count(db_sessions, key_a.project) == 0


def test_training_file_of_another_project_is_unknown(client, key_a, key_b, file_id, db_sessions):
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_b.headers, json=body(file_id)), 422,
                       param="training_file", code="file_not_found")
    assert "POST /v1/files" in err["message"]
    assert job_count(db_sessions, key_b.project) == 0


def test_list_retrieve_cancel(client, key_a, file_id):
    ids = [client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id)).json()["id"]
           for _ in range(3)]
    listed = client.get("/v1/fine_tuning/jobs", headers=key_a.headers).json()
    assert [j["id"] for j in listed["data"]] == ids[::-1] and listed["has_more"] is False
    page = client.get("/v1/fine_tuning/jobs", headers=key_a.headers, params={"limit": 2}).json()
    assert [j["id"] for j in page["data"]] == [ids[2], ids[1]] and page["has_more"] is True
    rest = client.get("/v1/fine_tuning/jobs", headers=key_a.headers, params={"after": ids[1]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]]

    cancelled = client.post(f"/v1/fine_tuning/jobs/{ids[0]}/cancel", headers=key_a.headers)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    got = client.get(f"/v1/fine_tuning/jobs/{ids[0]}", headers=key_a.headers).json()
    assert got["status"] == "cancelled"
    assert [j["id"] for j in client.get("/v1/fine_tuning/jobs", headers=key_a.headers,
                                        params={"status": "cancelled"}).json()["data"]] == [ids[0]]
    assert_error(client.get("/v1/fine_tuning/jobs", headers=key_a.headers, params={"status": "done"}), 422,
                 param="status")
    err = assert_error(client.post(f"/v1/fine_tuning/jobs/{ids[0]}/cancel", headers=key_a.headers), 409,
                       code="job_not_cancellable")
    assert "cancelled" in err["message"]
    assert_error(client.get("/v1/fine_tuning/jobs/ftjob-nope", headers=key_a.headers), 404)
    assert_error(client.post("/v1/fine_tuning/jobs/ftjob-nope/cancel", headers=key_a.headers), 404)


def test_a_queued_job_shows_its_place_in_the_queue(client, key_a, key_b, db_sessions):
    """Project A queues three jobs, then project B one: B's job comes right after A's first (the
    projects take turns), and the place reads the same on the job, in the list, on create and on
    resume; a job that is not queued has none."""
    def create(key):
        resp = client.post("/v1/fine_tuning/jobs", headers=key.headers,
                           json={"model": MODEL, "qerl": {"dataset": RG, "steps": 3}})
        assert resp.status_code == 200, resp.text
        return resp.json()

    made = [create(key_a) for _ in range(3)] + [create(key_b)]
    a1, a2, a3, b1 = (j["id"] for j in made)
    place = {j["id"]: client.get(f"/v1/fine_tuning/jobs/{j['id']}", headers=(key_b if j["id"] == b1 else key_a)
                                 .headers).json()["qerl"]["queue_position"] for j in made}
    assert place[b1] == place[a1] + 1 and place[a1] < place[b1] < place[a2] < place[a3], place
    assert made[0]["qerl"]["queue_position"] >= 1  # on create, before later jobs came
    listed = {j["id"]: j["qerl"]["queue_position"]
              for j in client.get("/v1/fine_tuning/jobs", headers=key_a.headers).json()["data"]}
    assert listed == {a1: place[a1], a2: place[a2], a3: place[a3]}
    with db_sessions() as s:
        assert queue.claim(s, a1, "test-worker", lease_seconds=60) is not None  # as a worker would
    running = client.get(f"/v1/fine_tuning/jobs/{a1}", headers=key_a.headers).json()
    assert running["status"] == "running" and running["qerl"]["queue_position"] is None
    moved = client.get(f"/v1/fine_tuning/jobs/{b1}", headers=key_b.headers).json()["qerl"]["queue_position"]
    assert moved == place[a1]  # one job ahead started: B's is where A's first was
    paused = client.post(f"/v1/fine_tuning/jobs/{a3}/pause", headers=key_a.headers).json()
    assert paused["status"] == "paused" and paused["qerl"]["queue_position"] is None
    resumed = client.post(f"/v1/fine_tuning/jobs/{a3}/resume", headers=key_a.headers).json()
    assert resumed["qerl"]["queue_position"] == client.get(
        f"/v1/fine_tuning/jobs/{a3}", headers=key_a.headers).json()["qerl"]["queue_position"] > moved


def test_the_cli_shows_a_queued_jobs_place(live_server, key_a):
    from typer.testing import CliRunner

    from qerl.cli import app

    job = httpx.post(f"{live_server.url}/v1/fine_tuning/jobs", headers=key_a.headers,
                     json={"model": MODEL, "qerl": {"dataset": RG, "steps": 3}}).json()
    place = httpx.get(f"{live_server.url}/v1/fine_tuning/jobs/{job['id']}",
                      headers=key_a.headers).json()["qerl"]["queue_position"]
    conn = ["--base-url", live_server.url, "--api-key", key_a.secret]
    got = CliRunner().invoke(app, ["jobs", "get", job["id"], *conn], env={"COLUMNS": "200"})
    assert got.exit_code == 0, got.output
    assert re.search(rf"queue position +{place} \(1: the next job a free worker takes\)", got.output), got.output
    listed = CliRunner().invoke(app, ["jobs", "list", *conn], env={"COLUMNS": "200"})
    assert f"queued #{place}" in listed.output, listed.output


def test_watch_says_where_a_queued_job_waits(live_server, key_a):
    """`qerl jobs watch` on a job no worker takes (this server runs none) prints its place in the
    queue once, then ends when the job is cancelled; into a file, with a plain closing line."""
    import io
    import threading

    from rich.console import Console

    from qerl.client import Client
    from qerl.watch import watch_job

    job_id = httpx.post(f"{live_server.url}/v1/fine_tuning/jobs", headers=key_a.headers,
                        json={"model": MODEL, "qerl": {"dataset": RG, "steps": 3}}).json()["id"]
    place = httpx.get(f"{live_server.url}/v1/fine_tuning/jobs/{job_id}",
                      headers=key_a.headers).json()["qerl"]["queue_position"]
    buf = io.StringIO()
    timer = threading.Timer(1.5, lambda: httpx.post(f"{live_server.url}/v1/fine_tuning/jobs/{job_id}/cancel",
                                                    headers=key_a.headers))
    timer.start()
    with Client(base_url=live_server.url, api_key=key_a.secret) as client:
        final = watch_job(client, job_id, Console(file=buf, width=200), interval=0.2)
    timer.join()
    assert final["status"] == "cancelled"
    said = [line for line in buf.getvalue().splitlines() if line.startswith("queued: position")]
    assert said == [f"queued: position {place} (1: the next job a free worker takes)"], buf.getvalue()
    # not a terminal: no progress bar (its last frame would be cut to the width), a plain closing line
    assert buf.getvalue().splitlines()[-1] == "cancelled  0/3 steps", buf.getvalue()
    assert "━" not in buf.getvalue() and "…" not in buf.getvalue(), buf.getvalue()


def test_cancel_of_a_running_job_asks_the_worker(client, key_a, file_id, db_sessions):
    job_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id)).json()["id"]
    with db_sessions() as s:
        assert queue.claim(s, job_id, "test-worker", lease_seconds=60) is not None  # as a worker would
        s.get(Job, job_id).step = 1  # one of ten steps done (total from the spec)
        s.commit()
    running = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key_a.headers).json()
    assert running["status"] == "running" and running["qerl"]["progress"]["step"] == 1
    assert running["estimated_finish"] >= running["qerl"]["started_at"] >= running["created_at"]
    resp = client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=key_a.headers).json()
    assert resp["status"] == "cancelling" and resp["qerl"]["cancel_requested"] is True
    assert resp["qerl"]["attempt"] == 1 and resp["finished_at"] is None
    again = client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=key_a.headers)
    assert again.status_code == 200 and again.json()["status"] == "cancelling"


def test_pause_and_resume_over_the_api(client, key_a, file_id, db_sessions, dispatched):
    queued, running = (client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id)).json()["id"]
                       for _ in range(2))
    paused = client.post(f"/v1/fine_tuning/jobs/{queued}/pause", headers=key_a.headers)
    assert paused.status_code == 200 and paused.json()["status"] == "paused" and paused.json()["finished_at"] is None
    assert [j["id"] for j in client.get("/v1/fine_tuning/jobs", headers=key_a.headers,
                                        params={"status": "paused"}).json()["data"]] == [queued]
    dispatched.clear()
    resumed = client.post(f"/v1/fine_tuning/jobs/{queued}/resume", headers=key_a.headers)
    assert resumed.status_code == 200 and resumed.json()["status"] == "queued"
    assert dispatched == [queued]  # a worker is told at once

    with db_sessions() as s:
        assert queue.claim(s, running, "test-worker", lease_seconds=60) is not None  # as a worker would
    pausing = client.post(f"/v1/fine_tuning/jobs/{running}/pause", headers=key_a.headers).json()
    assert pausing["status"] == "pausing" and pausing["qerl"]["cancel_requested"] is False
    err = assert_error(client.post(f"/v1/fine_tuning/jobs/{running}/resume", headers=key_a.headers), 409,
                       code="job_not_resumable", param="fine_tuning_job_id")
    assert "still pausing" in err["message"]
    with db_sessions() as s:
        assert queue.requeue(s, running, 1, "stopped") == "paused"  # as the runner does once the engine stops
    assert client.get(f"/v1/fine_tuning/jobs/{running}", headers=key_a.headers).json()["status"] == "paused"
    assert client.post(f"/v1/fine_tuning/jobs/{running}/pause", headers=key_a.headers).json()["status"] == "paused"
    cancelled = client.post(f"/v1/fine_tuning/jobs/{running}/cancel", headers=key_a.headers).json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    err = assert_error(client.post(f"/v1/fine_tuning/jobs/{running}/pause", headers=key_a.headers), 409,
                       code="job_not_pausable")
    assert "only queued or running jobs can be paused" in err["message"]
    err = assert_error(client.post(f"/v1/fine_tuning/jobs/{running}/resume", headers=key_a.headers), 409,
                       code="job_not_resumable")
    assert "only paused jobs can be resumed" in err["message"]
    for verb in ("pause", "resume"):
        assert_error(client.post(f"/v1/fine_tuning/jobs/ftjob-nope/{verb}", headers=key_a.headers), 404)


def test_a_projects_active_jobs_are_capped_by_max_active_jobs(make_client, key_a, key_b, file_id, db_sessions,
                                                               dispatched):
    capped = make_client(max_active_jobs=2)
    create = lambda key, **kw: capped.post("/v1/fine_tuning/jobs", headers=key.headers, json=body(file_id, **kw))
    idem = {"Idempotency-Key": f"k-{secrets.token_hex(4)}", **key_a.headers}
    first = capped.post("/v1/fine_tuning/jobs", headers=idem, json=body(file_id)).json()["id"]
    second = create(key_a).json()["id"]
    refused = create(key_a)
    err = assert_error(refused, 429, code="too_many_active_jobs")
    assert "2 jobs queued or running" in err["message"] and "QERL_MAX_ACTIVE_JOBS=2" in err["message"]
    assert refused.headers["Retry-After"] == "30" and refused.headers["x-should-retry"] == "false"  # SDKs: no retry
    assert job_count(db_sessions, key_a.project) == 2  # nothing written
    again = capped.post("/v1/fine_tuning/jobs", headers=idem, json=body(file_id))
    assert again.status_code == 200 and again.json()["id"] == first  # a replay is not a new job
    other = create(key_b, training_file=upload(capped, key_b, jsonl(training_rows(40))).json()["id"])
    assert other.status_code == 200  # the cap is per project
    # a paused job holds no worker: it does not count, but resuming it must fit under the cap
    assert capped.post(f"/v1/fine_tuning/jobs/{second}/pause", headers=key_a.headers).json()["status"] == "paused"
    third = create(key_a).json()["id"]
    err = assert_error(capped.post(f"/v1/fine_tuning/jobs/{second}/resume", headers=key_a.headers), 429,
                       code="too_many_active_jobs")
    assert f"then resume {second}" in err["message"]
    with db_sessions() as s:
        assert s.get(Job, second).status == "paused"
    assert capped.post(f"/v1/fine_tuning/jobs/{third}/cancel", headers=key_a.headers).json()["status"] == "cancelled"
    assert capped.post(f"/v1/fine_tuning/jobs/{second}/resume", headers=key_a.headers).json()["status"] == "queued"
    # running, pausing and cancelling jobs count too
    with db_sessions() as s:
        assert queue.claim(s, first, "test-worker", lease_seconds=60) is not None
    for state in ("running", "pausing", "cancelling"):
        with db_sessions() as s:
            s.get(Job, first).status = state
            s.commit()
        assert_error(create(key_a), 429, code="too_many_active_jobs")
    uncapped = make_client()  # the default: no cap
    assert uncapped.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id)).status_code == 200


def test_concurrent_creates_cannot_both_take_the_last_place(api_settings, key_a, db_sessions):
    from tests.conftest import LiveServer

    with LiveServer(api_settings.model_copy(update={"max_active_jobs": 3})) as server, \
            httpx.Client(base_url=server.url, headers=key_a.headers, timeout=60) as http:
        # a built-in dataset: no training file, whose row lock would serialize the requests anyway
        req = {"model": MODEL, "method": {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}},
               "qerl": {"dataset": RG}}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(lambda _: http.post("/v1/fine_tuning/jobs", json=req).status_code, range(12)))
    assert sorted(codes) == [200] * 3 + [429] * 9, codes
    assert job_count(db_sessions, key_a.project) == 3


def test_list_filters_by_metadata_as_openai_does(client, key_a, key_b, file_id):
    odd = 'we"ird\'key.$[0]'
    made = {name: client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id, **extra)).json()["id"]
            for name, extra in [("one", {"metadata": {"run": "1", "team": "a", odd: "x"}}),
                                ("two", {"metadata": {"run": "2", "team": "a"}}), ("bare", {})]}

    def listed(params) -> list[str]:
        resp = client.get("/v1/fine_tuning/jobs", headers=key_a.headers, params=params)
        assert resp.status_code == 200, resp.text
        return [j["id"] for j in resp.json()["data"]]

    assert listed({"metadata[run]": "1"}) == [made["one"]]
    assert listed({"metadata[team]": "a"}) == [made["two"], made["one"]]
    assert listed([("metadata[team]", "a"), ("metadata[run]", "2")]) == [made["two"]]
    assert listed({"metadata[team]": "b"}) == [] and listed({"metadata[nope]": ""}) == []
    assert listed({f"metadata[{odd}]": "x"}) == [made["one"]]
    assert listed({"metadata": "null"}) == [made["bare"]]
    assert listed({"metadata[team]": "a", "status": "queued", "limit": 1}) == [made["two"]]
    assert made["one"] not in [j["id"] for j in client.get("/v1/fine_tuning/jobs", headers=key_b.headers,
                                                           params={"metadata[run]": "1"}).json()["data"]]
    for bad in ({"metadata": "x"}, {"metadata[]": "1"}, [("metadata[run]", "1"), ("metadata[run]", "2")],
                [("metadata", "null"), ("metadata[run]", "1")], {f"metadata[{'k' * 65}]": "1"},
                {f"metadata[k{i}]": "v" for i in range(17)}):
        assert_error(client.get("/v1/fine_tuning/jobs", headers=key_a.headers, params=bad), 422, param="metadata")


def test_idempotency_key(client, key_a, file_id, db_sessions):
    idem = {"Idempotency-Key": f"k-{secrets.token_hex(4)}", **key_a.headers}
    first = client.post("/v1/fine_tuning/jobs", headers=idem, json=body(file_id, seed=1))
    second = client.post("/v1/fine_tuning/jobs", headers=idem, json=body(file_id, seed=1))
    assert first.status_code == second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    err = assert_error(client.post("/v1/fine_tuning/jobs", headers=idem, json=body(file_id, seed=2)), 422,
                       code="idempotency_key_reused")
    assert first.json()["id"] in err["message"]
    assert job_count(db_sessions, key_a.project) == 1
    other = client.post("/v1/fine_tuning/jobs", headers={**key_a.headers, "Idempotency-Key": "other"},
                        json=body(file_id, seed=1))
    assert other.json()["id"] != first.json()["id"] and job_count(db_sessions, key_a.project) == 2


def test_twenty_concurrent_requests_with_one_key_make_one_job(live_server, key_a, db_sessions):
    with httpx.Client(base_url=live_server.url, headers=key_a.headers, timeout=60) as http:
        fid = http.post("/v1/files", files={"file": ("t.jsonl", jsonl(training_rows(40)))},
                        data={"purpose": "fine-tune"}).json()["id"]
        headers = {"Idempotency-Key": f"race-{secrets.token_hex(4)}"}
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            futures = [pool.submit(http.post, "/v1/fine_tuning/jobs", json=body(fid, seed=3), headers=headers)
                       for _ in range(20)]
            responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 20, [r.text for r in responses if r.status_code != 200]
    assert len({r.json()["id"] for r in responses}) == 1
    assert job_count(db_sessions, key_a.project) == 1


def test_metrics_take_the_latest_attempt_and_checkpoints_list(client, key_a, file_id, db_sessions):
    job_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id)).json()["id"]
    with db_sessions() as s:  # rows as a worker writes them: step 2 re-run by attempt 2 after a resume
        s.add_all([JobMetric(job_id=job_id, step=1, attempt=1, values={"reward_mean": 0.1}),
                   JobMetric(job_id=job_id, step=2, attempt=1, values={"reward_mean": 0.2}),
                   JobMetric(job_id=job_id, step=2, attempt=2, values={"reward_mean": 0.25}),
                   JobMetric(job_id=job_id, step=3, attempt=2, values={"reward_mean": 0.3}),
                   Checkpoint(id="ftckpt-a", job_id=job_id, attempt=1, step=1, path="jobs/x/1", metrics={"loss": 1.0}),
                   Checkpoint(id="ftckpt-b", job_id=job_id, attempt=2, step=3, path="jobs/x/3", metrics={"loss": 0.5})])
        s.commit()
    metrics = client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", headers=key_a.headers).json()
    assert [(m["step"], m["attempt"], m["values"]["reward_mean"]) for m in metrics["data"]] == \
        [(1, 1, 0.1), (2, 2, 0.25), (3, 2, 0.3)]
    after = client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", headers=key_a.headers, params={"after_step": 1})
    assert [m["step"] for m in after.json()["data"]] == [2, 3]
    ckpts = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=key_a.headers).json()
    assert [(c["id"], c["step_number"]) for c in ckpts["data"]] == [("ftckpt-b", 3), ("ftckpt-a", 1)]
    first = ckpts["data"][0]
    assert first["object"] == "fine_tuning.job.checkpoint" and first["fine_tuning_job_id"] == job_id
    assert first["metrics"] == {"step": 3, "loss": 0.5}
    assert first["fine_tuned_model_checkpoint"].startswith(f"ft:{MODEL}:") and first["fine_tuned_model_checkpoint"].endswith(":ckpt-step-3")
    page = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=key_a.headers,
                      params={"after": "ftckpt-b"}).json()
    assert [c["id"] for c in page["data"]] == ["ftckpt-a"]


def test_samples_list_the_latest_attempts_by_step(client, key_a, key_b, file_id, db_sessions):
    from service.models import JobSample

    job_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(file_id)).json()["id"]
    url = f"/v1/fine_tuning/jobs/{job_id}/samples"
    assert client.get(url, headers=key_a.headers).json()["data"] == []  # nothing reported yet

    def sample(step, attempt, kind="train", index=0, text=""):
        return JobSample(job_id=job_id, attempt=attempt, step=step, kind=kind, index=index, prompt=f"p{step}",
                         completion=text or f"c{step}.{attempt}.{kind}.{index}", reward=step / 10 + index,
                         scores={"answer": 1.0}, finish_reason="stop", tokens=3)

    with db_sessions() as s:  # as workers write them: step 2 re-run by attempt 2 after a resume
        s.add_all([sample(0, 1, "eval"), sample(1, 1), sample(1, 1, index=1), sample(2, 1), sample(2, 1, "eval"),
                   sample(2, 2), sample(2, 2, index=1), sample(3, 2), sample(3, 2, "eval")])
        s.commit()

    def got(**params):
        resp = client.get(url, headers=key_a.headers, params=params)
        assert resp.status_code == 200, resp.text
        page = resp.json()
        return [(x["step"], x["kind"], x["index"], x["completion"]) for x in page["data"]], page["has_more"]

    newest, more = got()
    assert newest == [(3, "train", 0, "c3.2.train.0"), (3, "eval", 0, "c3.2.eval.0")] and more
    assert got(step=2) == ([(2, "train", 0, "c2.2.train.0"), (2, "train", 1, "c2.2.train.1"),
                            (2, "eval", 0, "c2.1.eval.0")], False)  # attempt 2 re-ran the step's rollouts only
    assert got(kind="eval", order="asc", limit=2) == ([(0, "eval", 0, "c0.1.eval.0"), (2, "eval", 0, "c2.1.eval.0")],
                                                      True)
    assert got(kind="eval", order="asc", limit=2, after_step=2) == ([(3, "eval", 0, "c3.2.eval.0")], False)
    assert [s for s, *_ in got(order="desc", limit=2, after_step=3)[0]] == [2, 2, 2, 1, 1]
    one = client.get(url, headers=key_a.headers, params={"step": 1}).json()["data"][1]
    assert one == {"object": "fine_tuning.job.sample", "step": 1, "kind": "train", "index": 1, "attempt": 1,
                   "prompt": "p1", "completion": "c1.1.train.1", "reward": 1.1, "scores": {"answer": 1.0},
                   "finish_reason": "stop", "tokens": 3, "created_at": one["created_at"]}
    assert_error(client.get(url, headers=key_b.headers), 404)  # another project's job
    assert_error(client.get(url, headers=key_a.headers, params={"kind": "test"}), 422, param="kind")
    assert_error(client.get(url, headers=key_a.headers, params={"limit": 101}), 422, param="limit")
