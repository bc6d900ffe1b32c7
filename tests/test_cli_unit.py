"""Unit tests of the client pieces that need no server: job bodies, spec files, SSE parsing,
download verification (an httpx MockTransport stands in for the server here only)."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile

import httpx
import pytest
import typer
from typer.testing import CliRunner

from qerl import cli_client, jobbody, watch
from qerl.client import Client, QerlError, parse_sse, verify_adapter_dir


def _body(**kw):
    args = dict(model=None, training_file=None, validation_file=None, dataset=None, dataset_size=None, grader=None,
                steps=None, prompts_per_step=None, num_generations=None, max_new_tokens=None, learning_rate=None,
                lora_r=None, quantization=None, algorithm=None, aqn=None, seed=None, suffix=None, metadata=[],
                overrides=[])
    args.update(kw)
    spec = args.pop("spec", None)
    return jobbody.build_job_body(spec, **args)


def test_flags_map_to_the_service_body():
    body = _body(model="tiny", dataset="products", dataset_size=50, steps=3, num_generations=4, learning_rate=2e-5,
                 lora_r=8, algorithm="grpo", aqn=False, seed=7, metadata=["team=rl"], eval_interval=5, early_stop=3,
                 grader='{"type": "reasoning_gym", "name": "t"}', overrides=["qerl.rollout.temperature=0.7"])
    assert body == {
        "model": "tiny", "seed": 7,
        "qerl": {"steps": 3, "rollout": {"num_generations": 4, "temperature": 0.7}, "optim": {"lr": 2e-5},
                 "lora": {"r": 8}, "rl": {"algorithm": "grpo"}, "aqn": {"enabled": False}, "eval_interval": 5,
                 "early_stop_patience": 3,
                 "dataset": {"source": "reasoning_gym", "task": "products", "size": 50}},
        "method": {"type": "reinforcement", "reinforcement": {"grader": {"type": "reasoning_gym", "name": "t"}}},
        "metadata": {"team": "rl"},
    }


def test_flags_override_the_spec_file_without_touching_the_rest(tmp_path):
    spec = {"model": "a", "training_file": "file-1", "qerl": {"steps": 10, "lora": {"r": 16, "alpha": 32}}}
    body = _body(spec=spec, model="b", lora_r=4)
    assert body["model"] == "b" and body["training_file"] == "file-1"
    assert body["qerl"] == {"steps": 10, "lora": {"r": 4, "alpha": 32}}
    assert spec["qerl"]["lora"]["r"] == 16  # the caller's dict is not modified


def test_bad_flags_name_the_fix():
    with pytest.raises(ValueError, match="--model"):
        _body(dataset="products")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _body(model="m", metadata=["novalue"])
    with pytest.raises(ValueError, match="a.b.c=VALUE"):
        _body(model="m", overrides=["qerl.steps"])
    with pytest.raises(ValueError, match="already a int"):
        _body(model="m", overrides=["qerl.steps=3", "qerl.steps.x=1"])
    with pytest.raises(ValueError, match="--grader must be a JSON object"):
        _body(model="m", grader="{not json")


def test_spec_files_json_and_yaml(tmp_path):
    body = {"model": "tiny", "qerl": {"steps": 2, "rollout": {"temperature": 0.5}}}
    (tmp_path / "a.json").write_text(json.dumps(body))
    (tmp_path / "b.yaml").write_text("model: tiny\nqerl:\n  steps: 2\n  rollout:\n    temperature: 0.5\n")
    (tmp_path / "c.spec").write_text("model: tiny\nqerl: {steps: 2, rollout: {temperature: 0.5}}\n")
    for name in ("a.json", "b.yaml", "c.spec"):
        assert jobbody.load_spec(str(tmp_path / name)) == body
    (tmp_path / "bad.json").write_text('{"model": ')
    with pytest.raises(ValueError, match="invalid JSON .*line 1"):
        jobbody.load_spec(str(tmp_path / "bad.json"))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must be an object"):
        jobbody.load_spec(str(tmp_path / "list.yaml"))


def test_parse_sse_follows_the_event_stream_rules():
    text = ("retry: 1000\n\n: keep-alive\n\nid: ftevent-1\nevent: message\ndata: {\"a\": 1}\n\n"
            "id: ftevent-2\ndata: line one\ndata: line two\n\nevent: done\ndata: {\"status\": \"succeeded\"}\n\n")
    events = list(parse_sse(iter(text.split("\n"))))
    assert [(e.id, e.event, e.data) for e in events] == [
        ("ftevent-1", "message", {"a": 1}),
        ("ftevent-2", None, "line one\nline two"),
        ("ftevent-2", "done", {"status": "succeeded"}),  # the id persists, as in browsers
    ]


def test_step_line_and_metric_events():
    values = {"reward_mean": 0.5, "accuracy": 0.25, "entropy": 1.2345, "aqn_sigma": 0.01,
              "rollout_tokens_per_s": 412.3, "step_s": 5.06, "kl": None}
    assert watch.step_line(3, 30, values) == ("step 3/30  reward 0.500  acc 0.25  entropy 1.234  "
                                                  "sigma 1.0e-02  412 tok/s  5.1 s")
    assert watch.step_line(4, 30, {"reward_mean": 0.0, "updates_skipped": 1.0}) == (
        "step 4/30  reward 0.000  no update: every group's samples scored alike")
    assert watch.step_line(5, 30, {"reward_mean": 0.0, "updates_skipped": 0.0}) == "step 5/30  reward 0.000"
    from worker.reporter import step_message
    assert step_message(4, 30, {"reward_mean": 0.0, "updates_skipped": 1.0}) == (
        "Step 4/30: reward_mean=0, updates_skipped=1 (no update: every group's samples scored alike)")
    assert watch._metric_values({"type": "metrics", "data": {"step": 3, "total_steps": 30, "kl": 0.1}}) == \
        (3, {"kl": 0.1})
    assert watch._metric_values({"type": "message", "data": None}) is None
    assert watch._eta(3, 30, [2.0, 4.0], None) == "ETA 0:01:21"
    assert watch._eta(30, 30, [], None) == "ETA 0:00:00"


def _tarball(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _client_serving(body: bytes, sha: str | None) -> Client:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer k"
        headers = {"X-Checksum-Sha256": sha} if sha else {}
        return httpx.Response(200, content=body, headers=headers)

    client = Client(base_url="http://qerl.test", api_key="k")
    client.http = httpx.Client(base_url=client.base_url, headers=client.http.headers,
                               transport=httpx.MockTransport(handler))
    return client


def _adapter_files(tamper: bool = False) -> dict[str, bytes]:
    cfg, weights = b'{"peft_type": "LORA"}', b"\x00\x01weights"
    manifest = {"files": {"adapter_config.json": hashlib.sha256(cfg).hexdigest(),
                          "adapter_model.safetensors": hashlib.sha256(weights).hexdigest()}}
    return {"adapter_config.json": cfg, "adapter_model.safetensors": weights + (b"x" if tamper else b""),
            "qerl_manifest.json": json.dumps(manifest).encode()}


def test_download_checks_sha256_and_extracts(tmp_path):
    data = _tarball(_adapter_files())
    got = []
    out = _client_serving(data, hashlib.sha256(data).hexdigest()).download_adapter(
        "adapter-1", tmp_path / "a", lambda n, total: got.append(n))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                     "qerl_manifest.json"]
    assert sum(got) == len(data)


def test_download_refuses_a_wrong_or_missing_checksum(tmp_path):
    data = _tarball(_adapter_files())
    with pytest.raises(QerlError, match="does not match the server's"):
        _client_serving(data, "0" * 64).download_adapter("adapter-1", tmp_path / "a")
    with pytest.raises(QerlError, match="no X-Checksum-Sha256"):
        _client_serving(data, None).download_adapter("adapter-1", tmp_path / "b")
    assert not any((tmp_path / "a").iterdir())  # nothing extracted, no partial file left


def test_extracted_files_are_checked_against_the_manifest(tmp_path):
    data = _tarball(_adapter_files(tamper=True))
    with pytest.raises(QerlError, match="adapter_model.safetensors: sha256 .* manifest"):
        _client_serving(data, hashlib.sha256(data).hexdigest()).download_adapter("adapter-1", tmp_path)
    (tmp_path / "x").mkdir()
    with pytest.raises(QerlError, match="lacks adapter_config.json"):
        verify_adapter_dir(tmp_path / "x")


def test_unreachable_server_prints_a_message_not_a_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("QERL_CONFIG", str(tmp_path / "none.json"))
    app = typer.Typer()
    cli_client.register(app)
    result = CliRunner().invoke(app, ["jobs", "list", "--base-url", "http://127.0.0.1:9", "--api-key", "k"])
    assert result.exit_code == 1
    assert "cannot reach the qerl server at http://127.0.0.1:9/" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    monkeypatch.delenv("QERL_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["jobs", "list", "--base-url", "http://127.0.0.1:9"])
    assert result.exit_code == 1 and "no API key" in result.output


def test_every_command_writes_whole_lines_into_a_log():
    """Each command's console, with its output in a file or a pipe (no terminal, no COLUMNS), is
    not cut or wrapped at rich's 80 columns (make demo's step lines, ids and paths stay whole);
    COLUMNS, where set, still rules."""
    import os
    import subprocess
    import sys

    modules = ("cli_client:out", "cli_engine:console", "cli_generate:console", "cli_plan:console", "demo:console")
    code = ("import importlib; print(*(getattr(importlib.import_module('qerl.' + m), a).width for m, a in "
            f"(x.split(':') for x in {modules!r})))")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    for columns, want in ((None, "400"), ("60", "60")):
        run_env = env if columns is None else {**env, "COLUMNS": columns}
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env, check=True)
        assert got.stdout.split() == [want] * len(modules), got


def test_python_m_qerl_is_the_qerl_command():
    """`python -m qerl` runs the same command as the `qerl` script (for a venv not on PATH)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "qerl", "jobs", "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "120"})
    assert done.returncode == 0, done.stderr
    assert "Usage: python -m qerl jobs" in done.stdout and "watch" in done.stdout, done.stdout


def test_compare_results_from_a_jobs_metrics():
    """What compare says a job reached, from its metrics rows: the first and last value of each
    metric over the steps that have it, '-' where none does, the time from start to finish, and
    a job early_stop_patience ended says so beside its steps."""
    from qerl.compare import results, side_by_side

    job = {"status": "succeeded", "qerl": {"progress": {"step": 3, "total_steps": 3}, "started_at": 100},
           "finished_at": 100 + 3725}
    metrics = [{"step": 0, "values": {"eval/accuracy": 0.25, "eval/reward_mean": 0.5}},
               {"step": 1, "values": {"reward_mean": 0.1, "rollout_tokens_per_s": 100.0}},
               {"step": 2, "values": {"reward_mean": float("nan"), "rollout_tokens_per_s": 300.0}},
               {"step": 3, "values": {"reward_mean": 0.4, "eval/accuracy": 0.75}}]
    assert results(job, metrics) == [
        ("status", "succeeded"), ("steps", "3/3"), ("time", "1h02m"), ("reward", "0.100 -> 0.400 (steps 1-3)"),
        ("held-out accuracy", "0.250 -> 0.750 (steps 0-3)"), ("held-out reward", "0.500 (step 0)"),
        ("rollout tokens/s", "200")]
    running = {"status": "running", "qerl": {"progress": {"step": 0, "total_steps": 5}, "started_at": 100}}
    assert dict(results(running, []))["reward"] == "-" and dict(results(running, []))["time"] == "-"
    early = {"status": "succeeded", "qerl": {"progress": {"step": 2, "total_steps": 6, "stopped_early": True}}}
    assert dict(results(early, []))["steps"] == "2/6 (stopped early)"
    assert side_by_side([[("a", "1"), ("b", "2")], [("b", "3"), ("c", "4")]]) == [
        ("a", ["1", "-"]), ("b", ["2", "3"]), ("c", ["-", "4"])]


def test_sweep_points_and_bodies():
    """--sweep values: every combination, the first field varying slowest; each body is the base
    with the point's fields set and the sweep named in its metadata; bad sweeps name the fix."""
    points = jobbody.sweep_points(["qerl.optim.lr=[1e-5, 2e-5]", 'qerl.rl.algorithm=["grpo", "dapo"]'])
    assert points == [{"qerl.optim.lr": 1e-5, "qerl.rl.algorithm": "grpo"}, {"qerl.optim.lr": 1e-5, "qerl.rl.algorithm": "dapo"},
                      {"qerl.optim.lr": 2e-5, "qerl.rl.algorithm": "grpo"}, {"qerl.optim.lr": 2e-5, "qerl.rl.algorithm": "dapo"}]
    base = {"model": "m", "metadata": {"team": "a"}, "qerl": {"optim": {"lr": 3e-5, "schedule": "constant"}}}
    bodies = jobbody.sweep_bodies(base, points, "s1")
    assert base["qerl"]["optim"]["lr"] == 3e-5  # the base is not changed
    assert bodies[3] == {"model": "m", "qerl": {"optim": {"lr": 2e-5, "schedule": "constant"}, "rl": {"algorithm": "dapo"}},
                         "metadata": {"team": "a", "sweep": "s1",
                                      "sweep_point": 'qerl.optim.lr=2e-05, qerl.rl.algorithm="dapo"'}}
    for bad, fragment in ((["qerl.lora.r=8"], "a JSON list"), (["qerl.lora.r=[]"], "a JSON list"),
                          (["=[1]"], "a JSON list"), (["qerl.lora.r=[4]", "qerl.lora.r=[8]"], "given twice"),
                          (["a=" + json.dumps(list(range(9))), "b=" + json.dumps(list(range(8)))], "72 jobs, more than 64")):
        with pytest.raises(ValueError, match=fragment):
            jobbody.sweep_points(bad)
    app = typer.Typer()
    cli_client.register(app)
    dry = CliRunner().invoke(app, ["jobs", "create", "--model", "m", "--sweep", "qerl.lora.r=[4,8]", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert [b["qerl"]["lora"]["r"] for b in json.loads(dry.stdout)] == [4, 8]
    watched = CliRunner().invoke(app, ["jobs", "create", "--model", "m", "--sweep", "qerl.lora.r=[4,8]", "--watch"])
    assert watched.exit_code == 1 and "--watch follows one job" in watched.output
