"""The official ``openai`` SDK against a live server: files, fine-tuning jobs (create,
retrieve, list, list_events with auto-pagination, pause, resume, cancel), checkpoints, and its
error classes."""
from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.conftest import STRING_CHECK, jsonl, training_rows
from tests.test_api_jobs import MODEL


@pytest.fixture
def sdk(live_server, key_a) -> OpenAI:
    return OpenAI(base_url=f"{live_server.url}/v1", api_key=key_a.secret, max_retries=0, timeout=30)


def test_openai_sdk_round_trip(sdk: OpenAI, key_b, live_server):
    f = sdk.files.create(file=("train.jsonl", jsonl(training_rows(40))), purpose="fine-tune")
    assert f.id.startswith("file-") and f.status == "processed" and f.bytes > 0
    assert sdk.files.retrieve(f.id).filename == "train.jsonl"
    assert [x.id for x in sdk.files.list()] == [f.id]
    assert sdk.files.content(f.id).read() == jsonl(training_rows(40))

    job = sdk.fine_tuning.jobs.create(
        model=MODEL, training_file=f.id, seed=11, suffix="sdk", metadata={"run": "1"},
        method={"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK,
                                                           "hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
        extra_body={"qerl": {"quantization": "nvfp4", "lora": {"r": 4}}})
    assert job.object == "fine_tuning.job" and job.status == "queued" and job.seed == 11
    assert job.method.type == "reinforcement" and job.method.reinforcement.grader.type == "string_check"
    assert job.hyperparameters.batch_size == 2 and job.metadata == {"run": "1"}
    assert job.model_extra["qerl"]["progress"] == {"step": 0, "total_steps": 15, "stopped_early": False}  # 1 epoch x 30 rows / 2: 10 held out

    again = sdk.fine_tuning.jobs.retrieve(job.id)
    assert again.id == job.id and again.created_at == job.created_at and again.training_file == f.id
    others = [sdk.fine_tuning.jobs.create(model=MODEL, training_file=f.id, method={
        "type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}).id for _ in range(2)]
    walked = [j.id for j in sdk.fine_tuning.jobs.list(limit=1)]  # auto-pagination with `after`
    assert walked == [others[1], others[0], job.id]
    assert [j.id for j in sdk.fine_tuning.jobs.list(metadata={"run": "1"})] == [job.id]  # metadata[run]=1
    assert [j.id for j in sdk.fine_tuning.jobs.list(metadata={"run": "2"})] == []

    paused = sdk.fine_tuning.jobs.pause(job.id)
    assert paused.status == "paused" and paused.finished_at is None
    assert sdk.fine_tuning.jobs.resume(job.id).status == "queued"
    cancelled = sdk.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    events = list(sdk.fine_tuning.jobs.list_events(job.id, limit=1))  # one per page, newest first
    assert [e.message for e in events][:2] == ["The job was cancelled", "The job was resumed; it is queued and "
                                                                        "will resume from step 0 (no checkpoint yet)"]
    assert events[-1].message.startswith("Created fine-tuning job") and len(events) == 4
    assert all(e.object == "fine_tuning.job.event" and e.level == "info" for e in events)
    assert list(sdk.fine_tuning.jobs.checkpoints.list(job.id)) == []

    with pytest.raises(openai.ConflictError) as exc:
        sdk.fine_tuning.jobs.cancel(job.id)
    assert exc.value.code == "job_not_cancellable"
    with pytest.raises(openai.ConflictError) as exc:
        sdk.fine_tuning.jobs.resume(job.id)
    assert exc.value.code == "job_not_resumable" and exc.value.param == "fine_tuning_job_id"
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        sdk.fine_tuning.jobs.create(model="gpt-4o-mini", training_file=f.id)
    assert exc.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        OpenAI(base_url=f"{live_server.url}/v1", api_key=key_b.secret, max_retries=0).fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{live_server.url}/v1", api_key="sk-wrong", max_retries=0).files.list()
    for j in others:
        sdk.fine_tuning.jobs.cancel(j)
    assert sdk.files.delete(f.id).deleted is True


def test_openai_sdk_deletes_a_fine_tuned_model(sdk: OpenAI, db_sessions, api_settings, tmp_path):
    from tests.test_api_adapters import finish_job_with_adapter

    f = sdk.files.create(file=("train.jsonl", jsonl(training_rows(40))), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(model=MODEL, training_file=f.id, method={
        "type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}})
    adapter = finish_job_with_adapter(db_sessions, api_settings, job.id, tmp_path)
    assert sdk.fine_tuning.jobs.retrieve(job.id).fine_tuned_model == adapter.name
    assert adapter.name in [m.id for m in sdk.models.list()]
    deleted = sdk.models.delete(adapter.name)
    assert deleted.id == adapter.name and deleted.deleted is True and deleted.object == "model"
    assert adapter.name not in [m.id for m in sdk.models.list()]
    with pytest.raises(openai.NotFoundError):
        sdk.models.delete(adapter.name)
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        sdk.models.delete(MODEL)
    assert exc.value.code == "model_not_deletable"
