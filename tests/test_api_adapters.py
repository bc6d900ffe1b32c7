"""Adapters and models: a finished job's adapter (written the way the worker writes it) is
listed, downloadable as tar.gz with its sha256 as checksum and ETag (If-None-Match -> 304), and
shows up in /v1/models as an ``ft:`` model next to the registry's base models."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from service import queue
from service.models import Adapter, new_id
from service.storage import ArtifactStore
from service.views import fine_tuned_model_name
from tests.conftest import jsonl, training_rows
from tests.test_api_files import assert_error, upload
from tests.test_api_jobs import MODEL, body
from worker.artifacts import pack_adapter


def finish_job_with_adapter(db_sessions, settings, job_id: str, tmp_path: Path) -> Adapter:
    src = tmp_path / "adapter"
    src.mkdir(parents=True)
    (src / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": MODEL}))
    (src / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)
    (src / "qerl_manifest.json").write_text(json.dumps({"steps": 2}))
    with db_sessions() as s:
        job = queue.claim(s, job_id, "test-worker", lease_seconds=60)
        adapter_id = new_id("adapter")
        blob = pack_adapter(src, ArtifactStore(settings.artifact_dir), f"{adapter_id}.tar.gz")  # the worker's packer
        adapter = Adapter(id=adapter_id, project=job.project, job_id=job_id, name=fine_tuned_model_name(job),
                          base_model=MODEL, path=blob.path, bytes=blob.bytes, sha256=blob.sha256,
                          manifest=blob.manifest)
        assert queue.finish(s, job_id, job.attempt, "succeeded", adapter=adapter) == "succeeded"
    return adapter


def test_adapter_listing_download_etag_and_models(client, key_a, key_b, db_sessions, api_settings, tmp_path):
    fid = upload(client, key_a, jsonl(training_rows(40))).json()["id"]
    job_id = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(fid, suffix="adder")).json()["id"]
    adapter = finish_job_with_adapter(db_sessions, api_settings, job_id, tmp_path)

    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key_a.headers).json()
    assert job["status"] == "succeeded" and job["qerl"]["adapter_id"] == adapter.id
    assert job["fine_tuned_model"] == adapter.name and adapter.name.startswith(f"ft:{MODEL}:")
    listed = client.get("/v1/adapters", headers=key_a.headers).json()
    assert [a["id"] for a in listed["data"]] == [adapter.id]
    got = client.get(f"/v1/adapters/{adapter.id}", headers=key_a.headers).json()
    assert got["object"] == "adapter" and got["job_id"] == job_id and got["sha256"] == adapter.sha256

    resp = client.get(f"/v1/adapters/{adapter.id}/content", headers=key_a.headers)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/gzip"
    assert hashlib.sha256(resp.content).hexdigest() == adapter.sha256 == resp.headers["x-checksum-sha256"]
    assert resp.headers["etag"] == f'"{adapter.sha256}"' and len(resp.content) == adapter.bytes
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors", "qerl_manifest.json"]
        assert tar.extractfile("adapter_model.safetensors").read() == bytes(range(256)) * 4
    cached = client.get(f"/v1/adapters/{adapter.id}/content",
                        headers={**key_a.headers, "If-None-Match": resp.headers["etag"]})
    assert cached.status_code == 304 and cached.content == b""
    stale = client.get(f"/v1/adapters/{adapter.id}/content", headers={**key_a.headers, "If-None-Match": '"other"'})
    assert stale.status_code == 200

    models = {m["id"]: m for m in client.get("/v1/models", headers=key_a.headers).json()["data"]}
    assert models[MODEL]["qerl"]["kind"] == "base"
    assert models[adapter.name]["qerl"] == {"kind": "adapter", "adapter_id": adapter.id, "base_model": MODEL,
                                            "job_id": job_id}
    assert client.get(f"/v1/models/{adapter.name}", headers=key_a.headers).json()["id"] == adapter.name
    assert adapter.name not in {m["id"] for m in client.get("/v1/models", headers=key_b.headers).json()["data"]}
    for path in (f"/v1/adapters/{adapter.id}", f"/v1/adapters/{adapter.id}/content", f"/v1/models/{adapter.name}"):
        assert_error(client.get(path, headers=key_b.headers), 404)


def test_deleting_a_fine_tuned_model_or_an_adapter_removes_row_and_archive(client, key_a, key_b, db_sessions,
                                                                           api_settings, tmp_path):
    fid = upload(client, key_a, jsonl(training_rows(40))).json()["id"]
    ids = [client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(fid, suffix=f"d{i}")).json()["id"]
           for i in range(2)]
    first, second = (finish_job_with_adapter(db_sessions, api_settings, jid, tmp_path / jid) for jid in ids)
    archive = api_settings.artifact_dir / first.path
    assert archive.is_file()

    # another project cannot delete it, and a base model is not deletable
    assert_error(client.delete(f"/v1/models/{first.name}", headers=key_b.headers), 404, code="not_found")
    assert_error(client.delete(f"/v1/adapters/{first.id}", headers=key_b.headers), 404, code="not_found")
    err = assert_error(client.delete(f"/v1/models/{MODEL}", headers=key_a.headers), 422, code="model_not_deletable",
                       param="model")
    assert "base model" in err["message"] and "ft:" in err["message"]
    assert archive.is_file() and client.get(f"/v1/models/{MODEL}", headers=key_a.headers).status_code == 200

    gone = client.delete(f"/v1/models/{first.name}", headers=key_a.headers)
    assert gone.status_code == 200 and gone.json() == {"id": first.name, "object": "model", "deleted": True}
    assert not archive.exists()
    for path in (f"/v1/adapters/{first.id}", f"/v1/adapters/{first.id}/content", f"/v1/models/{first.name}"):
        assert_error(client.get(path, headers=key_a.headers), 404)
    assert_error(client.delete(f"/v1/models/{first.name}", headers=key_a.headers), 404)  # once only
    job = client.get(f"/v1/fine_tuning/jobs/{ids[0]}", headers=key_a.headers).json()
    assert job["status"] == "succeeded" and job["qerl"]["adapter_id"] is None and job["fine_tuned_model"] == first.name
    events = client.get(f"/v1/fine_tuning/jobs/{ids[0]}/events", headers=key_a.headers).json()["data"]
    assert events[0]["message"] == f"The fine-tuned model {first.name} ({first.id}) was deleted"

    # by adapter id; the other adapter is untouched until then
    assert [a["id"] for a in client.get("/v1/adapters", headers=key_a.headers).json()["data"]] == [second.id]
    assert client.get(f"/v1/adapters/{second.id}/content", headers=key_a.headers).status_code == 200
    gone = client.delete(f"/v1/adapters/{second.id}", headers=key_a.headers)
    assert gone.json() == {"id": second.id, "object": "adapter", "deleted": True}
    assert not (api_settings.artifact_dir / second.path).exists()
    assert client.get("/v1/adapters", headers=key_a.headers).json()["data"] == []
    assert {m["qerl"]["kind"] for m in client.get("/v1/models", headers=key_a.headers).json()["data"]} == {"base"}


def test_a_job_from_a_fine_tuned_model_holds_it_until_the_job_ends(client, key_a, key_b, db_sessions, api_settings,
                                                                  tmp_path):
    fid = upload(client, key_a, jsonl(training_rows(40))).json()["id"]
    parent_job = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(fid, suffix="p")).json()["id"]
    parent = finish_job_with_adapter(db_sessions, api_settings, parent_job, tmp_path)
    with db_sessions() as s:  # the LoRA shape the worker's manifest records
        row = s.get(Adapter, parent.id)
        row.manifest = {**row.manifest, "lora": {"r": 8, "alpha": 16.0, "dropout": 0.0, "use_rslora": False,
                                                 "target_modules": ["q_proj", "v_proj"]}}
        s.commit()

    resp = client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=body(fid, model=parent.name,
                                                                                 qerl={"lora": {"dropout": 0.1}}))
    assert resp.status_code == 200, resp.text
    child = resp.json()
    spec = child["qerl"]["spec"]
    assert child["model"] == parent.name and spec["model"] == MODEL and spec["init_adapter"] == parent.path
    assert spec["lora"] == {"r": 8, "alpha": 16.0, "dropout": 0.1, "use_rslora": False,
                            "target_modules": ["q_proj", "v_proj"]}
    bad = client.post("/v1/fine_tuning/jobs", headers=key_a.headers,
                      json=body(fid, model=parent.name, qerl={"lora": {"target_modules": ["q_proj"]}}))
    err = assert_error(bad, 422, param="qerl.lora.target_modules")
    assert "v_proj" in err["message"]
    assert_error(client.post("/v1/fine_tuning/jobs", headers=key_b.headers, json=body(fid, model=parent.name)),
                 422, code="model_not_found", param="model")  # another project's model does not exist for it

    err = assert_error(client.delete(f"/v1/models/{parent.name}", headers=key_a.headers), 409, code="model_in_use")
    assert child["id"] in err["message"]
    assert_error(client.delete(f"/v1/adapters/{parent.id}", headers=key_a.headers), 409, code="model_in_use")
    assert (api_settings.artifact_dir / parent.path).is_file()
    assert client.post(f"/v1/fine_tuning/jobs/{child['id']}/cancel", headers=key_a.headers).json()["status"] == \
        "cancelled"
    assert client.delete(f"/v1/models/{parent.name}", headers=key_a.headers).status_code == 200
    assert not (api_settings.artifact_dir / parent.path).exists()
