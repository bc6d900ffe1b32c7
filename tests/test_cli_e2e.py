"""The ``qerl`` CLI against a live embedded server (subprocess), through a whole job on the tiny
model with the real engine: upload, create, watch (progress rendered, exit 0), events, list,
download (sha256 checked) and PEFT loading the downloaded adapter."""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import re
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from qerl.client import Client

from tests._client_server import JOB_SPEC_YAML, STEPS, TRAIN_ROWS, CliJob, Served, cli_job, qerl_server  # noqa: F401 (fixtures)
from tests.conftest import jsonl

pytestmark = pytest.mark.timeout(900)


def test_create_and_watch_render_progress_and_exit_0(cli_job: CliJob, qerl_server: Served) -> None:
    assert cli_job.watch.returncode == 0, (cli_job.watch.stdout, cli_job.watch.stderr)
    out = cli_job.watch.stdout
    # one line per step with the live numbers, a closing line (piped: no bar), the outcome
    for step in range(1, STEPS + 1):
        line = next((l for l in out.splitlines() if l.startswith(f"step {step}/{STEPS} ")), None)
        assert line is not None, out
        assert re.search(r"reward \d\.\d{3}", line) and re.search(r"entropy \d", line) and "tok/s" in line, line
        assert re.search(r"sigma \d\.\de[+-]\d\d", line), line
    assert re.search(rf"^succeeded  {STEPS}/{STEPS} steps  reward \d\.\d{{3}}  entropy .*tok/s \d+$", out, re.M), out
    assert "━" not in out and "…" not in out, out
    again = qerl_server.qerl("jobs", "watch", cli_job.job_id)  # a finished job: its last numbers too
    assert re.search(rf"^succeeded  {STEPS}/{STEPS} steps  reward \d\.\d{{3}}", again.stdout, re.M), again.stdout
    assert f"Job {cli_job.job_id} succeeded" in out
    job = cli_job.job
    assert job["status"] == "succeeded" and job["qerl"]["progress"] == {"step": STEPS, "total_steps": STEPS, "stopped_early": False}
    # the YAML spec and the flags both reached the server
    assert job["model"] == "tiny" and job["training_file"] == cli_job.file_id and job["seed"] == 3
    assert job["metadata"] == {"origin": "test"} and job["user_provided_suffix"] == "cli"
    spec = job["qerl"]["spec"]
    assert spec["steps"] == STEPS and spec["lora"]["r"] == 4 and spec["rollout"]["num_generations"] == 2
    assert job["method"]["reinforcement"]["grader"]["type"] == "text_similarity"


def test_list_get_and_events(cli_job: CliJob, qerl_server: Served) -> None:
    listed = qerl_server.qerl("jobs", "list")
    assert listed.returncode == 0 and cli_job.job_id in listed.stdout and "succeeded" in listed.stdout
    mine = qerl_server.qerl("jobs", "list", "--metadata", "origin=test", "--json")
    assert cli_job.job_id in [j["id"] for j in json.loads(mine.stdout)["data"]], mine.stderr
    other = qerl_server.qerl("jobs", "list", "--metadata", "origin=elsewhere", "--json")
    assert json.loads(other.stdout)["data"] == [], other.stderr
    piped = {k: v for k, v in qerl_server.env.items() if k != "COLUMNS"}  # stdout a pipe: not cut at 80 columns
    for args, whole in ((("jobs", "list"), (cli_job.job_id, cli_job.job["fine_tuned_model"])),
                        (("files", "list"), (cli_job.file_id,)),
                        (("adapters", "list"), (cli_job.job["qerl"]["adapter_id"], cli_job.job["fine_tuned_model"])),
                        (("models", "list"), (cli_job.job["fine_tuned_model"], "adapter", cli_job.job["model"],
                                              cli_job.job_id)),
                        (("models", "list"), (cli_job.job["model"], "base"))):
        shown = qerl_server.qerl(*args, env=piped)
        assert shown.returncode == 0 and any(all(w in line for w in whole) for line in shown.stdout.splitlines()), \
            shown.stdout
    narrow = qerl_server.qerl("jobs", "list", env={**piped, "COLUMNS": "60"})  # ids fold in their cell, whole
    column = "".join(line.split("│")[1].strip() for line in narrow.stdout.splitlines() if line.startswith("│"))
    assert narrow.returncode == 0 and cli_job.job_id in column and "…" not in column, narrow.stdout
    got = qerl_server.qerl("jobs", "get", cli_job.job_id)
    assert got.returncode == 0 and cli_job.job["fine_tuned_model"] in got.stdout
    assert cli_job.job["qerl"]["adapter_id"] in got.stdout
    # its settings as the job body and the defaults made them (the YAML's qerl fields)
    shown = " ".join(got.stdout.split())
    for want in ("algorithm dapo", "LoRA r=4, alpha=4", "learning rate 1e-05 (cosine, warmup 0.1)",
                 "rollouts 2 prompts x 2 samples a step, up to 8 tokens, temperature 1",
                 "AQN sigma 0.01 -> 0.0005 in 10 stages", "evaluation 2 held-out prompts, at the start and the end",
                 "grader text_similarity similarity"):
        assert want in shown, got.stdout
    # --follow on a finished job replays the whole log and stops by itself
    follow = qerl_server.qerl("jobs", "events", cli_job.job_id, "--follow", "--json", timeout=60)
    assert follow.returncode == 0, follow.stderr
    streamed = [json.loads(l) for l in follow.stdout.splitlines()]
    listed_events = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{cli_job.job_id}/events",
                              params={"limit": 1000}, headers=qerl_server.headers).json()["data"]
    assert [e["id"] for e in streamed] == [e["id"] for e in reversed(listed_events)]
    assert [e["data"]["step"] for e in streamed if e["type"] == "metrics"] == list(range(1, STEPS + 1))
    plain = qerl_server.qerl("jobs", "events", cli_job.job_id)
    assert plain.returncode == 0 and f"Step {STEPS}/{STEPS}" in plain.stdout


def test_the_results_file_holds_every_steps_metrics(cli_job: CliJob, qerl_server: Served, tmp_path: Path) -> None:
    [results] = cli_job.job["result_files"]
    got = qerl_server.qerl("jobs", "get", cli_job.job_id)
    assert results in got.stdout and f"qerl files download {results}" in cli_job.watch.stdout
    listed = json.loads(qerl_server.qerl("files", "list", "--json").stdout)
    assert {"id": results, "filename": "step_metrics.csv", "purpose": "fine-tune-results"}.items() <= next(
        f for f in listed if f["id"] == results).items()
    to_stdout = qerl_server.qerl("files", "download", results, "-o", "-")
    assert to_stdout.returncode == 0, to_stdout.stderr
    table = list(csv.DictReader(io.StringIO(to_stdout.stdout)))
    metrics = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{cli_job.job_id}/metrics", params={"limit": 1000},
                        headers=qerl_server.headers).json()["data"]
    assert [int(r["step"]) for r in table] == [m["step"] for m in metrics]
    assert [m["step"] for m in metrics if m["step"] > 0] == list(range(1, STEPS + 1))
    for row, m in zip(table, metrics):
        assert {k: float(v) for k, v in row.items() if v and k != "step"} == m["values"]
    raw = httpx.get(f"{qerl_server.url}/v1/files/{results}/content", headers=qerl_server.headers)
    assert raw.headers["content-type"].startswith("text/csv") and raw.text == to_stdout.stdout
    only = httpx.get(f"{qerl_server.url}/v1/files", params={"purpose": "fine-tune-results"},
                     headers=qerl_server.headers).json()["data"]
    assert results in [f["id"] for f in only] and {f["purpose"] for f in only} == {"fine-tune-results"}
    saved = qerl_server.qerl("files", "download", results, "-o", str(tmp_path / "m.csv"))
    assert saved.returncode == 0 and (tmp_path / "m.csv").read_text() == to_stdout.stdout, saved.stderr
    # files delete: an upload nobody uses goes; the listing no longer has it. Its upload says that
    # its 3 rows ask 2 distinct questions (what a held-out split can take)
    (tmp_path / "extra.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n' * 2
                                          + '{"prompt": "What is 2 + 2?", "answr": "4"}\n')
    said = qerl_server.qerl("files", "upload", str(tmp_path / "extra.jsonl"))
    assert said.returncode == 0 and "3 rows (2 distinct prompts)" in said.stdout, (said.stdout, said.stderr)
    assert "\nfields: answer (in 2 of 3 rows), answr (in 1 of 3 rows), prompt\n" in said.stdout, said.stdout
    extra = said.stdout.split()[0]
    line = next(x for x in qerl_server.qerl("files", "list").stdout.splitlines() if extra in x)
    assert [c.strip() for c in line.split("│")][5:7] == ["3", "2"], line  # rows, prompts
    gone = qerl_server.qerl("files", "delete", extra)
    assert gone.returncode == 0 and f"deleted {extra}" in gone.stdout, gone.stderr
    assert extra not in [f["id"] for f in json.loads(qerl_server.qerl("files", "list", "--json").stdout)]
    # a results file is not training data
    bad = qerl_server.qerl("jobs", "create", "--model", "tiny", "--training-file", results, "--steps", "1")
    assert bad.returncode == 1 and "purpose=fine-tune" in bad.stdout + bad.stderr


def test_download_verifies_and_peft_loads_the_adapter(cli_job: CliJob, qerl_server: Served, tmp_path: Path,
                                                       tiny_model_dir: Path) -> None:
    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter_id = cli_job.job["qerl"]["adapter_id"]
    listed = qerl_server.qerl("adapters", "list")
    assert listed.returncode == 0 and adapter_id in listed.stdout
    out_dir = tmp_path / "adapter"
    # by job id: the CLI finds the job's adapter
    dl = qerl_server.qerl("adapters", "download", cli_job.job_id, "-o", str(out_dir))
    assert dl.returncode == 0, dl.stderr
    meta = httpx.get(f"{qerl_server.url}/v1/adapters/{adapter_id}", headers=qerl_server.headers).json()
    assert f"sha256 verified {meta['sha256']}" in dl.stdout

    # independently: the archive's sha256 is what the server states, and the CLI extracted it as is
    resp = httpx.get(f"{qerl_server.url}/v1/adapters/{adapter_id}/content", headers=qerl_server.headers)
    assert hashlib.sha256(resp.content).hexdigest() == resp.headers["X-Checksum-Sha256"] == meta["sha256"]
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert {"adapter_config.json", "adapter_model.safetensors", "qerl_manifest.json"} <= set(members)
    for name, data in members.items():
        assert (out_dir / name).read_bytes() == data, name
    assert not list(out_dir.glob(".*.part"))

    # PEFT loads the directory on the base model and holds exactly the downloaded weights
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out_dir)
    saved = load_file(out_dir / "adapter_model.safetensors")
    loaded = get_peft_model_state_dict(model)
    assert set(saved) == set(loaded) and saved
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[name].float(), tensor.float(), rtol=0, atol=0, msg=name)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        tuned = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    assert tuned.shape == (1, 4, base.config.vocab_size)
    assert (tuned - plain).abs().max() > 1e-6, "the trained adapter does not change the base model's logits"


def test_errors_print_the_server_message(cli_job: CliJob, qerl_server: Served) -> None:
    missing = qerl_server.qerl("jobs", "get", "ftjob-doesnotexist")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "(404 not_found): No fine-tuning job found with id 'ftjob-doesnotexist'" in missing.stderr
    finished = qerl_server.qerl("jobs", "cancel", cli_job.job_id)
    assert finished.returncode == 1 and "(409" in finished.stderr and "Traceback" not in finished.stderr
    bad_model = qerl_server.qerl("jobs", "create", "--model", "no-such-model", "--dataset", "products")
    assert bad_model.returncode == 1 and "unknown model 'no-such-model'" in bad_model.stderr
    bad_key = qerl_server.qerl("jobs", "list", "--api-key", "wrong")
    assert bad_key.returncode == 1 and "(401" in bad_key.stderr
    # the URL and key from the environment win over the local config
    env = dict(qerl_server.env, QERL_CONFIG="/nonexistent/config.json", QERL_BASE_URL=qerl_server.url,
               QERL_API_KEY=qerl_server.api_key)
    assert cli_job.job_id in qerl_server.qerl("jobs", "list", env=env).stdout


def test_watch_exits_non_zero_when_the_job_is_cancelled(qerl_server: Served) -> None:
    created = qerl_server.qerl("jobs", "create", "--model", "tiny", "--dataset", "products", "--dataset-size", "40",
                               "--steps", "50", "--set", "qerl.data.eval_size=4", "--set", "qerl.device=cpu",
                               "--set", "qerl.rollout.max_new_tokens=4", "--set", "qerl.prompts_per_step=1", "--json")
    assert created.returncode == 0, created.stderr
    job_id = json.loads(created.stdout)["id"]
    cancel = qerl_server.qerl("jobs", "cancel", job_id)
    assert cancel.returncode == 0 and job_id in cancel.stdout, (cancel.stdout, cancel.stderr)
    watch = qerl_server.qerl("jobs", "watch", job_id, "--interval", "0.3", timeout=300)
    assert watch.returncode == 2, (watch.stdout, watch.stderr)
    assert f"Job {job_id} cancelled" in watch.stdout


def test_pause_watch_and_resume_from_the_terminal(qerl_server: Served) -> None:
    steps = 300
    created = qerl_server.qerl("jobs", "create", "--model", "tiny", "--dataset", "products", "--dataset-size", "40",
                               "--steps", str(steps), "--set", "qerl.data.eval_size=4", "--set", "qerl.device=cpu",
                               "--set", "qerl.rollout.max_new_tokens=4", "--set", "qerl.prompts_per_step=1",
                               "--set", "qerl.checkpoint_interval=0", "--json")
    assert created.returncode == 0, created.stderr
    job_id = json.loads(created.stdout)["id"]
    url = f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}"
    deadline = time.monotonic() + 120
    while httpx.get(url, headers=qerl_server.headers).json()["qerl"]["progress"]["step"] < 2:
        assert time.monotonic() < deadline, qerl_server.log_tail()
        time.sleep(0.2)
    pause = qerl_server.qerl("jobs", "pause", job_id)
    assert pause.returncode == 0 and f"{job_id} pausing" in pause.stdout, (pause.stdout, pause.stderr)
    watch = qerl_server.qerl("jobs", "watch", job_id, "--interval", "0.3", timeout=120)
    assert watch.returncode == 3, (watch.stdout, watch.stderr)
    paused = httpx.get(url, headers=qerl_server.headers).json()
    at = paused["qerl"]["progress"]["step"]
    assert paused["status"] == "paused" and 2 <= at < steps
    assert f"Job {job_id} paused at step {at}/{steps}; resume it with: qerl jobs resume {job_id}" in watch.stdout
    again = qerl_server.qerl("jobs", "resume", job_id)
    assert again.returncode == 0 and f"{job_id} queued" in again.stdout, (again.stdout, again.stderr)
    watch = qerl_server.qerl("jobs", "watch", job_id, "--interval", "0.3", timeout=300)
    assert watch.returncode == 0 and f"Job {job_id} succeeded" in watch.stdout, (watch.stdout, watch.stderr)
    with Client(base_url=qerl_server.url, api_key=qerl_server.api_key) as client:
        metrics = client.metrics(job_id)
        messages = [e["message"] for e in client.events(job_id, limit=1000)]
    assert [m["step"] for m in metrics if m["step"] > 0] == list(range(1, steps + 1))
    assert f"Resuming from checkpoint step {at} (attempt 2)" in messages  # not from step 0
    finished = qerl_server.qerl("jobs", "resume", job_id)
    assert finished.returncode == 1 and "(409" in finished.stderr and "only paused jobs" in finished.stderr


def test_watch_exits_1_with_the_reason_when_the_job_fails(cli_job: CliJob, qerl_server: Served, tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(JOB_SPEC_YAML)
    # passes the API's checks, fails in the engine: the prompts are longer in tokens than the job
    # lets a prompt be (only the tokenizer, in the worker, can count them)
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: " + "word " * 40}], "answer": "x"}
            for i in range(8)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    upload = qerl_server.qerl("files", "upload", str(tmp_path / "long.jsonl"), "--json")
    assert upload.returncode == 0, upload.stderr
    created = qerl_server.qerl("jobs", "create", str(tmp_path / "job.yaml"), "--training-file",
                               json.loads(upload.stdout)["id"], "--set", "qerl.data.max_prompt_tokens=16", "--json")
    assert created.returncode == 0, created.stderr
    job_id = json.loads(created.stdout)["id"]
    watch = qerl_server.qerl("jobs", "watch", job_id, "--interval", "0.3", timeout=300)
    assert watch.returncode == 1, (watch.stdout, watch.stderr)
    assert f"Job {job_id} failed: invalid_dataset: line " in watch.stdout
    assert "more than data.max_prompt_tokens=16" in watch.stdout


def test_adapters_delete_by_model_name_and_by_id(qerl_server: Served) -> None:
    made = []
    for _ in range(2):
        created = qerl_server.qerl("jobs", "create", "--model", "tiny", "--dataset", "products", "--dataset-size", "40",
                                   "--steps", "1", "--set", "qerl.data.eval_size=4", "--set", "qerl.device=cpu",
                                   "--set", "qerl.rollout.max_new_tokens=4", "--set", "qerl.prompts_per_step=1",
                                   "--json", "--watch")
        assert created.returncode == 0, (created.stdout, created.stderr)
        job_id = re.search(r"Job (ftjob-\w+) succeeded", created.stdout).group(1)
        made.append(httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}", headers=qerl_server.headers).json())
    none = qerl_server.qerl("jobs", "checkpoints", made[0]["id"])  # one step, none saved: said, not an empty table
    assert none.returncode == 0 and none.stdout.startswith(f"no checkpoints for {made[0]['id']} ("), none.stdout
    by_name, by_id = made[0]["fine_tuned_model"], made[1]["qerl"]["adapter_id"]
    for target in (by_name, by_id):
        gone = qerl_server.qerl("adapters", "delete", target)
        assert gone.returncode == 0 and f"deleted {target}" in gone.stdout, (gone.stdout, gone.stderr)
    left = {a["id"] for a in httpx.get(f"{qerl_server.url}/v1/adapters", params={"limit": 100},
                                       headers=qerl_server.headers).json()["data"]}
    assert made[0]["qerl"]["adapter_id"] not in left and by_id not in left
    again = qerl_server.qerl("adapters", "delete", by_name)
    assert again.returncode == 1 and "(404" in again.stderr and "Traceback" not in again.stderr


# a short job on a built-in task (the tiny model), for the tests that train a model further
SHORT = ("--dataset", "products", "--dataset-size", "40", "--set", "qerl.device=cpu", "--set",
         "qerl.rollout.max_new_tokens=4", "--set", "qerl.prompts_per_step=1", "--set", "qerl.data.eval_size=4")


def _cancel_and_wait(served: Served, job_id: str) -> None:
    httpx.post(f"{served.url}/v1/fine_tuning/jobs/{job_id}/cancel", headers=served.headers)
    deadline = time.monotonic() + 120
    while httpx.get(f"{served.url}/v1/fine_tuning/jobs/{job_id}", headers=served.headers).json()["status"] != "cancelled":
        assert time.monotonic() < deadline, f"job {job_id} did not cancel"
        time.sleep(0.3)


def test_a_fine_tuned_model_trains_further_from_its_lora(cli_job: CliJob, qerl_server: Served, tmp_path: Path) -> None:
    """model = ft:...: the job trains the parent's base with the parent's LoRA (shape inherited, weights
    unpacked bit for bit as its start), names its own model after the base; the parent cannot be
    deleted while such a job is unfinished; what cannot work is refused up front."""
    import torch
    from safetensors.torch import load_file

    parent = cli_job.job["fine_tuned_model"]
    api, h = qerl_server.url, qerl_server.headers
    common = SHORT
    child = qerl_server.qerl("jobs", "create", "--model", parent, "--steps", "1", *common, "--json", "--watch")
    assert child.returncode == 0, (child.stdout, child.stderr)
    child_id = re.search(r"Job (ftjob-\w+) succeeded", child.stdout).group(1)
    job = httpx.get(f"{api}/v1/fine_tuning/jobs/{child_id}", headers=h).json()
    parent_adapter = httpx.get(f"{api}/v1/adapters/{cli_job.job['qerl']['adapter_id']}", headers=h).json()
    spec = job["qerl"]["spec"]
    assert job["model"] == parent and spec["model"] == "tiny" and spec["lora"]["r"] == 4
    assert spec["init_adapter"] == f"adapters/{parent_adapter['id']}.tar.gz"
    assert job["fine_tuned_model"].startswith("ft:tiny:") and child_id.removeprefix("ftjob-") in job["fine_tuned_model"]
    mine = httpx.get(f"{api}/v1/adapters/{job['qerl']['adapter_id']}", headers=h).json()
    assert mine["base_model"] == "tiny"
    events = [e["message"] for e in httpx.get(f"{api}/v1/fine_tuning/jobs/{child_id}/events", params={"limit": 100},
                                              headers=h).json()["data"]]
    assert any("Starting from the LoRA in init-adapter/" in m for m in events), events
    got = qerl_server.qerl("adapters", "download", parent_adapter["id"], "-o", str(tmp_path / "parent"))
    assert got.returncode == 0, got.stderr
    start = qerl_server.data_dir / "data" / "artifacts" / "jobs" / child_id / "init-adapter"
    a, b = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "parent", start))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    for flags, param in ((("--set", "qerl.lora.r=8"), "qerl.lora.r"), (("--set", "qerl.init_adapter=/tmp/x"),
                                                                        "qerl.init_adapter")):
        bad = qerl_server.qerl("jobs", "create", "--model", parent, "--steps", "1", *common, *flags, "--json")
        assert bad.returncode == 1 and "(422" in bad.stderr and param in bad.stderr, (bad.stdout, bad.stderr)
    unknown = httpx.post(f"{api}/v1/fine_tuning/jobs", headers=h, json={
        "model": parent + "x", "qerl": {"dataset": {"source": "reasoning_gym", "task": "products"}}})
    assert unknown.status_code == 422 and unknown.json()["error"]["code"] == "model_not_found"
    assert unknown.json()["error"]["param"] == "model"

    running = qerl_server.qerl("jobs", "create", "--model", parent, "--steps", "300", *common, "--json")
    assert running.returncode == 0, running.stderr
    running_id = json.loads(running.stdout)["id"]
    try:
        busy = httpx.delete(f"{api}/v1/models/{parent}", headers=h)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_in_use", busy.text
        assert running_id in busy.json()["error"]["message"]
        assert httpx.get(f"{api}/v1/adapters/{parent_adapter['id']}", headers=h).status_code == 200
    finally:
        _cancel_and_wait(qerl_server, running_id)


def test_kept_checkpoint_loras_outlive_the_workdir_until_deleted(qerl_server: Served, tmp_path: Path) -> None:
    """qerl.keep_checkpoint_adapters: every checkpoint's LoRA is packed into the artifact store when
    it is saved, so all of them download after the engine pruned its checkpoints and after the
    workdir is gone (what QERL_JOB_FILES_RETENTION_SECONDS does); deleting a checkpoint or the
    fine-tuned model removes the archives, and the rows' qerl fields say what is kept."""
    import shutil

    import torch
    from safetensors.torch import load_file

    created = qerl_server.qerl("jobs", "create", "--model", "tiny", "--dataset", "products", "--dataset-size", "40",
                               "--steps", "3", "--set", "qerl.data.eval_size=4", "--set", "qerl.device=cpu",
                               "--set", "qerl.rollout.max_new_tokens=4", "--set", "qerl.prompts_per_step=1",
                               "--set", "qerl.checkpoint_interval=1", "--set", "qerl.keep_checkpoint_adapters=true",
                               "--json", "--watch")
    assert created.returncode == 0, (created.stdout, created.stderr)
    job_id = re.search(r"Job (ftjob-\w+) succeeded", created.stdout).group(1)
    artifacts = qerl_server.data_dir / "data" / "artifacts"
    workdir = artifacts / "jobs" / job_id
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert sorted(p.name for p in (workdir / "checkpoint-adapters").iterdir()) == [
        "step-000001", "step-000002", "step-000003"]  # the engine's own copies (hard links)
    base = f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}/checkpoints"
    listed = qerl_server.qerl("jobs", "checkpoints", job_id)
    assert listed.returncode == 0 and listed.stdout.count("kept (") == 3, (listed.stdout, listed.stderr)
    ckpts = {c["step_number"]: c for c in httpx.get(base, headers=qerl_server.headers).json()["data"]}
    assert sorted(ckpts) == [1, 2, 3]
    from_disk = httpx.get(f"{base}/{ckpts[3]['id']}/content", headers=qerl_server.headers)
    engine_copies = {step: load_file(workdir / "checkpoint-adapters" / f"step-{step:06d}" / "adapter_model.safetensors")
                     for step in ckpts}
    shutil.rmtree(workdir)  # the retention's removal: the workdir's checkpoints are gone
    for step, c in ckpts.items():
        kept = c["qerl"]
        assert kept["adapter_bytes"] > 0 and re.fullmatch(r"[0-9a-f]{64}", kept["adapter_sha256"]), c
        r = httpx.get(f"{base}/{c['id']}/content", headers=qerl_server.headers)
        assert r.status_code == 200 and r.headers["x-checksum-sha256"] == kept["adapter_sha256"]
        assert hashlib.sha256(r.content).hexdigest() == kept["adapter_sha256"] and len(r.content) == kept["adapter_bytes"]
        dl = qerl_server.qerl("adapters", "download", job_id, "--checkpoint", str(step), "-o", str(tmp_path / str(step)))
        assert dl.returncode == 0 and "sha256 verified" in dl.stdout, (dl.stdout, dl.stderr)
        got = load_file(tmp_path / str(step) / "adapter_model.safetensors")
        assert got.keys() == engine_copies[step].keys()
        assert all(torch.equal(got[k], engine_copies[step][k]) for k in got)  # that step's LoRA, bit for bit
        assert json.loads((tmp_path / str(step) / "qerl_manifest.json").read_text())["steps"] == step
    assert from_disk.content == httpx.get(f"{base}/{ckpts[3]['id']}/content", headers=qerl_server.headers).content

    # a kept checkpoint trains further: its LoRA is the new job's start; it and its model cannot be
    # deleted while such a job is unfinished; a step without a kept LoRA is refused naming the option
    name2 = ckpts[2]["fine_tuned_model_checkpoint"]
    child = qerl_server.qerl("jobs", "create", "--model", name2, "--steps", "1", *SHORT, "--json", "--watch")
    assert child.returncode == 0, (child.stdout, child.stderr)
    child_id = re.search(r"Job (ftjob-\w+) succeeded", child.stdout).group(1)
    start = load_file(artifacts / "jobs" / child_id / "init-adapter" / "adapter_model.safetensors")
    assert start.keys() == engine_copies[2].keys() and all(torch.equal(start[k], engine_copies[2][k]) for k in start)
    child_job = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{child_id}", headers=qerl_server.headers).json()
    assert child_job["model"] == name2 and child_job["fine_tuned_model"].startswith("ft:tiny:")
    running = qerl_server.qerl("jobs", "create", "--model", name2, "--steps", "300", *SHORT, "--json")
    assert running.returncode == 0, running.stderr
    running_id = json.loads(running.stdout)["id"]
    try:
        busy = httpx.delete(f"{base}/{ckpts[2]['id']}", headers=qerl_server.headers)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "checkpoint_in_use", busy.text
        model = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}", headers=qerl_server.headers).json()
        busy = httpx.delete(f"{qerl_server.url}/v1/models/{model['fine_tuned_model']}", headers=qerl_server.headers)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_in_use", busy.text
    finally:
        _cancel_and_wait(qerl_server, running_id)
    unkept = httpx.post(f"{qerl_server.url}/v1/fine_tuning/jobs", headers=qerl_server.headers, json={
        "model": name2.replace("ckpt-step-2", "ckpt-step-9"),
        "qerl": {"dataset": {"source": "reasoning_gym", "task": "products"}}})
    assert unkept.status_code == 422 and "keep_checkpoint_adapters" in unkept.json()["error"]["message"]

    # deleting one checkpoint: its row and archive go, the others stay
    gone = qerl_server.qerl("jobs", "checkpoints", job_id, "--delete", "1")
    assert gone.returncode == 0 and f"deleted checkpoint {ckpts[1]['id']}" in gone.stdout, (gone.stdout, gone.stderr)
    left = {c["step_number"] for c in httpx.get(base, headers=qerl_server.headers).json()["data"]}
    assert left == {2, 3}
    assert httpx.get(f"{base}/{ckpts[1]['id']}/content", headers=qerl_server.headers).status_code == 404
    store = artifacts / "checkpoints" / job_id
    assert sorted(p.name for p in store.iterdir()) == sorted(f"{ckpts[s]['id']}.tar.gz" for s in (2, 3))
    again = httpx.delete(f"{base}/{ckpts[1]['id']}", headers=qerl_server.headers)
    assert again.status_code == 404 and again.json()["error"]["param"] == "checkpoint_id"

    # deleting the fine-tuned model takes its checkpoints' archives too; the rows stay, marked not kept
    model = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}", headers=qerl_server.headers).json()
    assert httpx.delete(f"{qerl_server.url}/v1/models/{model['fine_tuned_model']}",
                        headers=qerl_server.headers).status_code == 200
    assert not store.exists()
    rows = httpx.get(base, headers=qerl_server.headers).json()["data"]
    assert {c["step_number"] for c in rows} == {2, 3}
    assert all(c["qerl"] == {"adapter_bytes": None, "adapter_sha256": None} for c in rows)
    r = httpx.get(f"{base}/{ckpts[2]['id']}/content", headers=qerl_server.headers)
    assert r.status_code == 404 and "keep_checkpoint_adapters" in r.json()["error"]["message"]
    events = [e["message"] for e in httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}/events",
                                              params={"limit": 100}, headers=qerl_server.headers).json()["data"]]
    assert any("with the LoRAs of 2 checkpoints" in m for m in events), events
    assert any(f"Checkpoint {ckpts[1]['id']} (step 1) was deleted" in m for m in events), events


def test_a_checkpoints_lora_downloads_as_a_peft_adapter_while_it_is_kept(qerl_server: Served, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    created = qerl_server.qerl("jobs", "create", "--model", "tiny", "--dataset", "products", "--dataset-size", "40",
                               "--steps", "3", "--set", "qerl.data.eval_size=4", "--set", "qerl.device=cpu",
                               "--set", "qerl.rollout.max_new_tokens=4", "--set", "qerl.prompts_per_step=1",
                               "--set", "qerl.checkpoint_interval=1", "--json", "--watch")
    assert created.returncode == 0, (created.stdout, created.stderr)
    job_id = re.search(r"Job (ftjob-\w+) succeeded", created.stdout).group(1)
    final = qerl_server.qerl("adapters", "download", job_id, "-o", str(tmp_path / "final"))
    assert final.returncode == 0, final.stderr
    got = {}
    for step in (2, 3):  # the newest two are kept
        dl = qerl_server.qerl("adapters", "download", job_id, "--checkpoint", str(step), "-o", str(tmp_path / str(step)))
        assert dl.returncode == 0 and "sha256 verified" in dl.stdout, (dl.stdout, dl.stderr)
        got[step] = load_file(tmp_path / str(step) / "adapter_model.safetensors")
        manifest = json.loads((tmp_path / str(step) / "qerl_manifest.json").read_text())
        assert manifest["steps"] == step
    last = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert got[3].keys() == last.keys() and all(torch.equal(got[3][k], last[k]) for k in last)  # step 3 is the end
    pruned = qerl_server.qerl("adapters", "download", job_id, "--checkpoint", "1", "-o", str(tmp_path / "1"))
    assert pruned.returncode == 1 and "no longer on disk" in pruned.stderr, pruned.stderr
    missing = qerl_server.qerl("adapters", "download", job_id, "--checkpoint", "9")
    assert missing.returncode == 1 and "no checkpoint at step 9" in missing.stderr

    ckpts = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}/checkpoints",
                      headers=qerl_server.headers).json()["data"]
    url = f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}/checkpoints/{ckpts[0]['id']}/content"
    a, b = (httpx.get(url, headers=qerl_server.headers) for _ in range(2))
    assert a.status_code == 200 and a.headers["content-type"] == "application/gzip"
    assert hashlib.sha256(a.content).hexdigest() == a.headers["x-checksum-sha256"] == b.headers["x-checksum-sha256"]
    assert httpx.get(url.replace(ckpts[0]["id"], "ftckpt-nope"), headers=qerl_server.headers).status_code == 404

    # `qerl generate` on a checkpoint's LoRA: by the checkpoint's name, or the job and --checkpoint
    args = ("--prompt", "Write sentence number 3.", "--max-new-tokens", "6", "--json", "--device", "cpu",
            "--no-compare")
    [two] = [c for c in ckpts if c["step_number"] == 2]
    by_name = qerl_server.qerl("generate", two["fine_tuned_model_checkpoint"], *args, timeout=300)
    assert by_name.returncode == 0, by_name.stderr
    cached = Path(qerl_server.env["QERL_CACHE_DIR"]) / "adapters" / two["id"]
    assert json.loads((cached / "qerl_manifest.json").read_text())["steps"] == 2  # step 2's LoRA, not the final one
    assert (cached / "adapter_model.safetensors").read_bytes() == (tmp_path / "2" / "adapter_model.safetensors").read_bytes()
    by_step = qerl_server.qerl("generate", job_id, "--checkpoint", "2", *args, timeout=300)
    assert by_step.returncode == 0 and "downloading" not in by_step.stdout + by_step.stderr, by_step.stderr
    rows = [[json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")] for r in (by_name, by_step)]
    assert rows[0] == rows[1] and len(rows[0]) == 1
    none_there = qerl_server.qerl("generate", job_id, "--checkpoint", "9", *args)
    assert none_there.returncode == 1 and "no checkpoint at step 9" in none_there.stderr, none_there.stderr
    clash = qerl_server.qerl("generate", two["fine_tuned_model_checkpoint"], "--checkpoint", "3", *args)
    assert clash.returncode == 2 and "names step 2" in clash.stderr + clash.stdout


def test_samples_show_what_the_model_wrote_at_a_step(cli_job: CliJob, qerl_server: Served) -> None:
    api = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{cli_job.job_id}/samples", params={"step": 1},
                    headers=qerl_server.headers).json()["data"]
    assert api and {x["kind"] for x in api} == {"train"} and all(x["step"] == 1 for x in api)
    shown = qerl_server.qerl("jobs", "samples", cli_job.job_id, "--step", "1")
    assert shown.returncode == 0, shown.stderr
    for x in api:
        assert f"step 1 train #{x['index']}  reward {x['reward']:.4g}" in shown.stdout
    as_json = json.loads(qerl_server.qerl("jobs", "samples", cli_job.job_id, "--step", "1", "--json").stdout)
    assert as_json == api
    newest = json.loads(qerl_server.qerl("jobs", "samples", cli_job.job_id, "--json").stdout)
    assert {x["step"] for x in newest} == {STEPS}  # the newest step's, evaluation included where it evaluated
    bad = qerl_server.qerl("jobs", "samples", cli_job.job_id, "--kind", "test")
    assert bad.returncode == 1 and "--kind must be train or eval" in bad.stdout + bad.stderr
    past = qerl_server.qerl("jobs", "samples", cli_job.job_id, "--step", "9")
    assert past.returncode == 0, past.stderr
    assert f"at step 9: the job has {STEPS} steps (it is at step {STEPS} of {STEPS})" in past.stdout, past.stdout


def test_generate_fetches_a_jobs_adapter_from_the_server(cli_job: CliJob, qerl_server: Served) -> None:
    """`qerl generate ftjob-...` downloads the job's adapter into the cache (once) and answers with
    it on the base its manifest names; the fine-tuned model's name finds the same adapter; `qerl
    eval ftjob-...` scores test rows with it and the job's own grader, from the manifest."""
    adapter_id = cli_job.job["qerl"]["adapter_id"]
    args = ("--prompt", "Write sentence number 3.", "--max-new-tokens", "6", "--json", "--device", "cpu")
    by_job = qerl_server.qerl("generate", cli_job.job_id, *args, timeout=300)
    assert by_job.returncode == 0, by_job.stderr
    cached = Path(qerl_server.env["QERL_CACHE_DIR"]) / "adapters" / adapter_id
    assert (cached / "adapter_config.json").is_file() and (cached / "qerl_manifest.json").is_file()
    assert not list(cached.parent.glob(".*.part"))
    [row] = [json.loads(line) for line in by_job.stdout.splitlines() if line.startswith("{")]
    assert (row["model"], row["quantization"]) == ("tiny", cli_job.job["qerl"]["spec"]["quantization"])
    assert row["tokens"] == len(row["token_ids"]) >= 1 and "base_completion" in row
    by_name = qerl_server.qerl("generate", cli_job.job["fine_tuned_model"], *args, timeout=300)
    assert by_name.returncode == 0, by_name.stderr
    assert "downloading" not in by_name.stdout + by_name.stderr  # the cached copy serves
    assert [json.loads(line) for line in by_name.stdout.splitlines() if line.startswith("{")] == [row]
    unknown = qerl_server.qerl("generate", "ft:tiny:nobody:x:y", *args)
    assert unknown.returncode == 1 and "no fine-tuned model ft:tiny:nobody:x:y" in unknown.stderr
    test = Path(qerl_server.env["QERL_CACHE_DIR"]) / "test.jsonl"  # `qerl eval` on rows like the training file's
    test.write_bytes(jsonl(TRAIN_ROWS[:3]))
    scored = qerl_server.qerl("eval", cli_job.job_id, "--file", str(test), "--json", "--device", "cpu", timeout=300)
    assert scored.returncode == 0, scored.stderr
    got = json.loads(scored.stdout.splitlines()[-1])
    assert (got["rows"], got["grader"], got["adapter"]) == (3, "similarity", str(cached))  # the job's own grader
    assert {"accuracy", "reward_mean"} <= set(got["fine_tuned"]) and set(got["base"]) == set(got["fine_tuned"])
    out = Path(qerl_server.env["QERL_CACHE_DIR"]) / "by-name"
    by_model = qerl_server.qerl("adapters", "download", cli_job.job["fine_tuned_model"], "-o", str(out))
    assert by_model.returncode == 0 and f"adapter {adapter_id} " in by_model.stdout, by_model.stderr
    assert (out / "adapter_model.safetensors").read_bytes() == (cached / "adapter_model.safetensors").read_bytes()


def test_eval_on_the_server_scores_as_a_local_eval_does(cli_job: CliJob, qerl_server: Served, tmp_path: Path) -> None:
    """`qerl eval ftjob-... --on-server` uploads the test rows and creates an evaluation (POST
    /v1/evaluations) that the server's worker runs: its numbers and every row's answers are those
    of `qerl eval` on this machine (both on the CPU), and the evaluation keeps them (its result and
    results file)."""
    test = tmp_path / "test.jsonl"
    test.write_bytes(jsonl(TRAIN_ROWS[:3]))
    local = qerl_server.qerl("eval", cli_job.job_id, "--file", str(test), "--json", "--device", "cpu",
                             "--output", str(tmp_path / "local.jsonl"), timeout=300)
    assert local.returncode == 0, local.stderr
    remote = qerl_server.qerl("eval", cli_job.job_id, "--file", str(test), "--json", "--on-server",
                              "--output", str(tmp_path / "remote.jsonl"), timeout=300)
    assert remote.returncode == 0, remote.stdout + remote.stderr + qerl_server.log_tail()
    here, there = json.loads(local.stdout.splitlines()[-1]), json.loads(remote.stdout.splitlines()[-1])
    assert (there["rows"], there["grader"], there["model"]) == (3, here["grader"], here["model"])
    assert there["evaluation"].startswith("evaljob-") and there["ref"] == cli_job.job_id
    for side in ("fine_tuned", "base"):
        assert set(there[side]) == set(here[side]) and there[side]
        assert all(abs(there[side][k] - here[side][k]) <= 1e-9 for k in here[side]), (side, here, there)
    rows_here = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    rows_there = [json.loads(line) for line in (tmp_path / "remote.jsonl").read_text().splitlines()]
    assert [(r["completion"], r["base_completion"], r["reward"]) for r in rows_there] == \
        [(r["completion"], r["base_completion"], r["reward"]) for r in rows_here]
    with Client(base_url=qerl_server.url, api_key=qerl_server.api_key) as client:
        ev = client.get(f"/v1/evaluations/{there['evaluation']}")
        assert ev["status"] == "succeeded" and ev["model"] == cli_job.job["fine_tuned_model"]
        assert ev["result"]["fine_tuned"] == there["fine_tuned"] and ev["result"]["device"] == "cpu"
        assert [e["id"] for e in client.get("/v1/evaluations")["data"]][0] == ev["id"]
        events = [e["message"] for e in client.get(f"/v1/evaluations/{ev['id']}/events")["data"]]
        assert any(m.startswith(f"Scoring 3 rows of {ev['file']} with {ev['model']}") for m in events), events
    table = qerl_server.qerl("eval", cli_job.job["fine_tuned_model"], "--file", str(test), "--on-server",
                             "--no-compare", "--limit", "2", timeout=300)
    assert table.returncode == 0 and "accuracy" in table.stdout and "base alone" not in table.stdout, table.stdout
    assert "2 rows of" in " ".join(table.stdout.split()) and "on the server" in table.stdout, table.stdout
    task = ("--task", "products", "--size", "3", "--seed", "11", "--max-new-tokens", "6", "--json")
    asked_here = qerl_server.qerl("eval", cli_job.job_id, *task, "--device", "cpu", timeout=300)
    asked_there = qerl_server.qerl("eval", cli_job.job_id, *task, "--on-server", timeout=300)
    assert asked_there.returncode == 0 and asked_here.returncode == 0, asked_there.stderr + asked_here.stderr
    here, there = json.loads(asked_here.stdout.splitlines()[-1]), json.loads(asked_there.stdout.splitlines()[-1])
    assert (there["task"], there["rows"], there["max_new_tokens"]) == ("products", 3, 6)  # fresh questions there too
    assert all(abs(there[side][k] - v) <= 1e-9 for side in ("fine_tuned", "base") for k, v in here[side].items())
    refused = qerl_server.qerl("eval", cli_job.job_id, "--file", str(test), "--on-server", "--device", "cpu")
    assert refused.returncode == 2 and "--on-server" in refused.stdout + refused.stderr
    listed = qerl_server.qerl("evaluations", "list")  # and `qerl evaluations` shows, one by one, what ran
    row = next(line for line in listed.stdout.splitlines() if ev["id"] in line)
    assert "succeeded" in row and f"{there['fine_tuned']['accuracy']:.3f}" in row, listed.stdout
    shown = qerl_server.qerl("evaluations", "get", ev["id"])
    assert shown.returncode == 0 and "base alone" in shown.stdout and ev["result_files"][0] in shown.stdout
    again = qerl_server.qerl("evaluations", "cancel", ev["id"])
    assert again.returncode == 1 and "409" in again.stdout + again.stderr


def test_empty_lists_say_so_and_how_to_fill_them(qerl_server: Served) -> None:
    """A project with nothing yet: each list says there is none and the command that makes one, not
    an empty table; a filter that matches nothing says which filter."""
    created = qerl_server.qerl("keys", "create", "--project", "empty-lists")
    secret = re.search(r"sk-qerl-[A-Za-z0-9_-]+", created.stdout)
    assert created.returncode == 0 and secret, created.stdout + created.stderr
    key = ("--api-key", secret.group(0))
    for args, said in ((("jobs", "list"), "no jobs yet (qerl jobs create job.yaml --training-file file-... submits one)"),
                       (("jobs", "list", "--status", "running", "--metadata", "team=a"),
                        "no jobs with status running and metadata team=a"),
                       (("files", "list"), "no files yet (qerl files upload train.jsonl uploads one)"),
                       (("adapters", "list"), "no adapters yet (a job that succeeds makes one)")):
        shown = qerl_server.qerl(*args, *key)
        assert shown.returncode == 0 and shown.stdout.strip() == said, shown.stdout + shown.stderr
    assert qerl_server.qerl("files", "list", *key, "--json").stdout.strip() == "[]"  # JSON stays JSON


@pytest.fixture(scope="module")
def side(qerl_server: Served, tmp_path_factory: pytest.TempPathFactory) -> tuple[Served, str]:
    """A project of its own on the same server (its key, and the training file uploaded there), so
    that the jobs the tests below make do not crowd the main project's lists, which others read."""
    from tests._client_server import TRAIN_ROWS, jsonl

    created = qerl_server.qerl("keys", "create", "--project", "e2e-side")
    secret = re.search(r"sk-qerl-[A-Za-z0-9_-]+", created.stdout)
    assert created.returncode == 0 and secret, created.stdout + created.stderr
    served = dataclasses.replace(qerl_server, api_key=secret.group(0),
                                 env={**qerl_server.env, "QERL_API_KEY": secret.group(0)})
    work = tmp_path_factory.mktemp("side")
    (work / "train.jsonl").write_bytes(jsonl(TRAIN_ROWS))
    upload = served.qerl("files", "upload", str(work / "train.jsonl"), "--json")
    assert upload.returncode == 0, upload.stderr
    return served, json.loads(upload.stdout)["id"]


def _side_job(side: tuple[Served, str], *args: str) -> str:
    """A job of the side project (the YAML job body on its file, then ``args``), watched to its end."""
    served, file_id = side
    yaml = served.data_dir / "side-job.yaml"
    yaml.write_text(JOB_SPEC_YAML)
    created = served.qerl("jobs", "create", str(yaml), "--training-file", file_id, *args, "--json")
    assert created.returncode == 0, created.stderr
    job_id = json.loads(created.stdout)["id"]
    watch = served.qerl("jobs", "watch", job_id, "--interval", "0.3", timeout=300)
    assert watch.returncode == 0, (watch.stdout, watch.stderr)
    return job_id


def test_compare_puts_jobs_side_by_side(side: tuple[Served, str]) -> None:
    """Two jobs on the same file that differ in their learning rate and LoRA rank: compare shows
    every setting with the differing ones marked, and what each reached as its metrics say (first
    and last training reward, held-out accuracy before and after); --diff keeps only the
    differences; --json the same numbers; fewer than two ids is an error."""
    from qerl.compare import results

    qerl_server = side[0]
    first = _side_job(side, "--steps", str(STEPS))
    other = _side_job(side, "--steps", "1", "--learning-rate", "2e-5", "--lora-r", "8")
    shown = qerl_server.qerl("jobs", "compare", first, other, env={**qerl_server.env, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    cells = {c[0]: c[1:] for c in ([x.strip() for x in line.split("│")[1:-1]] for line in shown.stdout.splitlines()
                                   if line.startswith("│"))}
    text = " ".join(shown.stdout.split())
    assert first in text and other in text
    assert "LoRA │ r=4, alpha=4 │ r=8, alpha=8" in text, shown.stdout
    assert "learning rate │ 1e-05 (cosine, warmup 0.1) │ 2e-05 (cosine, warmup 0.1)" in text, shown.stdout
    assert "grader │ text_similarity similarity │ text_similarity similarity" in text
    for job_id, column in ((first, 0), (other, 1)):
        job = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}", headers=qerl_server.headers).json()
        metrics = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}/metrics",
                            headers=qerl_server.headers).json()["data"]
        reached = dict(results(job, metrics))
        rewards = [m["values"]["reward_mean"] for m in metrics if "reward_mean" in m["values"]]
        assert reached["reward"].startswith(f"{rewards[0]:.3f}") and f"{rewards[-1]:.3f}" in reached["reward"], reached
        assert reached["held-out accuracy"].startswith(
            f"{next(m['values']['eval/accuracy'] for m in metrics if 'eval/accuracy' in m['values']):.3f}")
        assert reached["status"] == "succeeded"
        assert [cells[name][column] for name in reached] == list(reached.values()), shown.stdout
    diff = qerl_server.qerl("jobs", "compare", first, other, "--diff", env={**qerl_server.env, "COLUMNS": "250"})
    assert diff.returncode == 0 and "LoRA" in diff.stdout and "grader │" not in diff.stdout, diff.stdout
    assert "the same in all: model, quantization, training file, algorithm" in " ".join(diff.stdout.split())
    as_json = json.loads(qerl_server.qerl("jobs", "compare", first, other, "--json").stdout)
    assert as_json[other]["settings"]["learning rate"].startswith("2e-05") and as_json[other]["results"]["steps"] == "1/1"
    one = qerl_server.qerl("jobs", "compare", other)
    assert one.returncode == 1 and "two or more job ids" in one.stdout + one.stderr


def test_a_sweep_creates_a_job_per_value_or_none(side: tuple[Served, str], tmp_path: Path) -> None:
    """--sweep makes one job per value, tagged with the sweep, listed by it and named in the hint
    to compare them; a sweep whose second point the server refuses leaves no job to run (the first
    is cancelled) and names the point and the field; `qerl eval --sweep` scores its adapters."""
    qerl_server, file_id = side
    (tmp_path / "job.yaml").write_text(JOB_SPEC_YAML)
    args = ("jobs", "create", str(tmp_path / "job.yaml"), "--training-file", file_id, "--steps", "1")
    made = qerl_server.qerl(*args, "--sweep", "qerl.lora.r=[2, 4]", "--idempotency-key", "sweep-test-1")
    assert made.returncode == 0, (made.stdout, made.stderr)
    listed = json.loads(qerl_server.qerl("jobs", "list", "--metadata", "sweep=sweep-test-1", "--json").stdout)["data"]
    assert sorted(j["qerl"]["spec"]["lora"]["r"] for j in listed) == [2, 4]
    assert {j["metadata"]["sweep_point"] for j in listed} == {"qerl.lora.r=2", "qerl.lora.r=4"}
    assert "qerl jobs compare --sweep sweep-test-1 --diff" in made.stdout, made.stdout
    again = qerl_server.qerl(*args, "--sweep", "qerl.lora.r=[2, 4]", "--idempotency-key", "sweep-test-1", "--json")
    assert [j["id"] for j in json.loads(again.stdout)] == [j["id"] for j in reversed(listed)]  # retried: no new jobs
    for j in listed:
        assert qerl_server.qerl("jobs", "watch", j["id"], "--interval", "0.3", timeout=300).returncode == 0
    compared = json.loads(qerl_server.qerl("jobs", "compare", "--sweep", "sweep-test-1", "--json").stdout)
    assert list(compared) == [j["id"] for j in reversed(listed)]  # oldest first: the sweep's order
    assert [c["settings"]["LoRA"] for c in compared.values()] == ["r=2, alpha=2", "r=4, alpha=4"]
    assert all(c["results"]["status"] == "succeeded" for c in compared.values())
    lone = qerl_server.qerl("jobs", "compare", "--sweep", "no-such-sweep")
    assert lone.returncode == 1 and "sweep no-such-sweep has 0 job(s)" in lone.stdout + lone.stderr
    test = tmp_path / "test.jsonl"  # the sweep's adapters scored on test rows: as each alone, the base once
    test.write_bytes(jsonl(TRAIN_ROWS[:2]))
    scored = qerl_server.qerl("eval", "--sweep", "sweep-test-1", "--file", str(test), "--json", "--device", "cpu",
                              timeout=300)
    assert scored.returncode == 0, scored.stderr
    lines = [json.loads(line) for line in scored.stdout.splitlines() if line.startswith("{")]
    assert [x["ref"] for x in lines] == list(compared) and lines[0]["base"] == lines[1]["base"]
    alone = qerl_server.qerl("eval", lines[1]["ref"], "--file", str(test), "--json", "--device", "cpu", timeout=300)
    assert json.loads(alone.stdout.splitlines()[-1])["fine_tuned"] == lines[1]["fine_tuned"]

    # a sweep's jobs paused, resumed and cancelled together; the finished ones are left as they are
    long = ("jobs", "create", str(tmp_path / "job.yaml"), "--training-file", file_id, "--steps", "300",
            "--set", "qerl.checkpoint_interval=0", "--sweep", "qerl.lora.r=[2, 4]", "--idempotency-key", "sweep-test-3")
    assert qerl_server.qerl(*long).returncode == 0
    paused = qerl_server.qerl("jobs", "pause", "--sweep", "sweep-test-3")
    assert paused.returncode == 0 and len(re.findall(r"ftjob-\S+ (pausing|paused)", paused.stdout)) == 2, paused.stdout
    def states() -> list[str]:
        listed = qerl_server.qerl("jobs", "list", "--metadata", "sweep=sweep-test-3", "--json").stdout
        return sorted(j["status"] for j in json.loads(listed)["data"])

    deadline = time.monotonic() + 120
    while states() != ["paused", "paused"] and time.monotonic() < deadline:
        time.sleep(0.3)
    resumed = qerl_server.qerl("jobs", "resume", "--sweep", "sweep-test-3")
    assert resumed.returncode == 0 and resumed.stdout.count(" queued") == 2, resumed.stdout
    cancelled = qerl_server.qerl("jobs", "cancel", "--sweep", "sweep-test-3")
    assert cancelled.returncode == 0 and len(re.findall(r"ftjob-\S+ cancel", cancelled.stdout)) == 2
    assert qerl_server.qerl("jobs", "cancel", "--sweep", "sweep-test-1").stdout.strip().startswith(
        "no job of sweep sweep-test-1 is")  # both succeeded: nothing to cancel
    neither = qerl_server.qerl("jobs", "cancel")
    assert neither.returncode == 1 and "give a job id or --sweep ID" in neither.stdout + neither.stderr

    refused = qerl_server.qerl(*args, "--sweep", "qerl.lora.r=[2, -1]", "--idempotency-key", "sweep-test-2")
    assert refused.returncode == 1
    said = " ".join((refused.stdout + refused.stderr).split())
    assert "sweep point 2 of 2 (qerl.lora.r=-1)" in said and "lora.r" in said, said
    assert "the 1 jobs created before it were cancelled" in said, said
    left = json.loads(qerl_server.qerl("jobs", "list", "--metadata", "sweep=sweep-test-2", "--json").stdout)["data"]
    assert len(left) == 1 and left[0]["status"] in ("cancelled", "cancelling"), left


def test_a_job_that_stops_improving_ends_early_and_says_so(side: tuple[Served, str], tmp_path: Path) -> None:
    """qerl.early_stop_patience through the service: a job that cannot learn (a learning rate too
    small to move the LoRA) ends succeeded after its first evaluation that is no better than the
    start, its events, watch's closing line, its progress and `qerl jobs get` say why, and its
    adapter is there."""
    qerl_server, file_id = side
    (tmp_path / "job.yaml").write_text(JOB_SPEC_YAML)
    created = qerl_server.qerl("jobs", "create", str(tmp_path / "job.yaml"), "--training-file", file_id,
                               "--steps", "5", "--learning-rate", "1e-12", "--no-aqn", "--eval-interval", "1",
                               "--early-stop", "1", "--json")
    assert created.returncode == 0, created.stderr
    job_id = json.loads(created.stdout)["id"]
    watch = qerl_server.qerl("jobs", "watch", job_id, "--interval", "0.3", timeout=300)
    assert watch.returncode == 0, (watch.stdout, watch.stderr)
    assert f"Job {job_id} succeeded after 1 of 5 steps (stopped early: early_stop_patience)" in watch.stdout
    events = [e["message"] for e in httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}/events",
                                              params={"limit": 100}, headers=qerl_server.headers).json()["data"]]
    assert any(m.startswith("Stopping early at step 1/5: 1 evaluation since step 0 scored no higher") for m in events), events
    job = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}", headers=qerl_server.headers).json()
    assert job["qerl"]["adapter_id"] and job["qerl"]["progress"] == {"step": 1, "total_steps": 5, "stopped_early": True}
    got = qerl_server.qerl("jobs", "get", job_id)
    assert got.returncode == 0 and "1/5 steps (stopped early)" in got.stdout, got.stdout
