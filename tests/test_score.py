"""engine.score: one adapter scored on test rows as the worker scores it, without the CLI. On the
held-out rows of a real training run on the tiny model it gives what `qerl eval --json` reports
(the run's own held-out evaluation), row for row; the rows and the grader are checked before any
model loads; a loading choice that cannot work names the option; a stop request ends it with
nothing."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from engine.score import (AdapterLoadError, AdapterOptionError, evaluate_adapter, load_adapted, read_manifest,
                          read_test_rows)
from engine.types import TrainError
from qerl.cli import app
from tests import test_cli_eval
from tests.test_cli_eval import GRADER, METRICS

trained = test_cli_eval.trained  # 4 steps on the tiny model, 4 prompts held out (each device)

RECORD_KEYS = {"adapter", "index", "line", "messages", "completion", "reward", "scores", "finish_reason", "tokens",
               "base_completion", "base_reward", "base_finish_reason", "base_tokens"}


def _cpu_only(device: str) -> None:
    if device != "cpu":
        pytest.skip("checked once, on the CPU run's adapter")


def test_scores_the_held_out_rows_as_qerl_eval_does(trained, tmp_path):
    adapter, result, test, device = trained
    out = tmp_path / "rows.jsonl"
    run = CliRunner().invoke(app, ["eval", str(adapter), "--file", str(test), "--device", device, "--json",
                                   "--output", str(out)])
    assert run.exit_code == 0, run.output
    cli = json.loads(run.stdout.strip().splitlines()[-1])

    got = evaluate_adapter(adapter, read_test_rows(test), device=device, ref=str(adapter))
    assert got is not None
    assert (got.model, got.quantization, got.grader, got.rows, got.max_new_tokens) == (
        cli["model"], cli["quantization"], cli["grader"], cli["rows"], cli["max_new_tokens"]) == (
        "tiny", "nvfp4", "similar", 4, 8)
    assert got.device == str(torch.device(device))
    assert got.base is not None
    for scored, said in ((got.fine_tuned, cli["fine_tuned"]), (got.base, cli["base"])):
        assert set(scored) == {f"eval/{k}" for k in said}
        for key, value in said.items():
            assert scored[f"eval/{key}"] == pytest.approx(value, abs=1e-9), key
    for key in METRICS:
        assert got.fine_tuned[f"eval/{key}"] == pytest.approx(result.metrics[f"eval/{key}"], abs=1e-9), key
    assert len(got.records) == 4 and all(set(r) == RECORD_KEYS for r in got.records)
    assert [r["line"] for r in got.records] == [1, 2, 3, 4]
    assert json.loads(json.dumps(got.records)) == [json.loads(line) for line in out.read_text().splitlines()]

    alone = evaluate_adapter(adapter, read_test_rows(test)[:2], device=device, compare=False)
    assert alone is not None and alone.base is None and alone.rows == 2
    assert [set(r) for r in alone.records] == [RECORD_KEYS - {k for k in RECORD_KEYS if k.startswith("base_")}] * 2
    assert {r["adapter"] for r in alone.records} == {""}


def test_rows_and_grader_are_checked_before_the_model_loads(trained, tmp_path, monkeypatch):
    import engine.model

    adapter, _, _, device = trained
    _cpu_only(device)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(engine.model, "load_model", no_model)
    typo = tmp_path / "typo.jsonl"
    typo.write_text('{"prompt": "a", "answer": "e"}\n{"prompt": "b", "answr": "e"}\n')
    with pytest.raises(TrainError) as missing:
        evaluate_adapter(adapter, read_test_rows(typo), device="cpu", where="typo.jsonl")
    assert missing.value.code == "invalid_file"
    assert str(missing.value).startswith("typo.jsonl: the grader reads fields every row must have")
    assert "item.answer is in 1 of 2 rows (the first without it: line 2)" in str(missing.value)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "e"}\n{"text": "b"}\n')
    with pytest.raises(TrainError) as bad_line:
        read_test_rows(bad)
    assert bad_line.value.code == "invalid_file" and "line 2: missing 'prompt' or 'messages'" in str(bad_line.value)
    with pytest.raises(TrainError, match="no rows"):
        evaluate_adapter(adapter, [], device="cpu")
    with pytest.raises(ValueError, match="grader.operation"):
        evaluate_adapter(adapter, read_test_rows(typo), device="cpu",
                         grader={"type": "string_check", "input": "{{sample.output_text}}", "reference": "x",
                                 "operation": "nope"})


def test_a_manifest_without_a_grader_needs_one_given(trained, tmp_path):
    adapter, _, test, device = trained
    _cpu_only(device)
    bare = tmp_path / "bare"
    shutil.copytree(adapter, bare)
    manifest = read_manifest(bare)
    del manifest["grader"]
    (bare / "qerl_manifest.json").write_text(json.dumps(manifest))
    rows = read_test_rows(test)[:1]
    with pytest.raises(ValueError, match="records no grader"):
        evaluate_adapter(bare, rows, device="cpu")
    given = evaluate_adapter(bare, rows, grader=GRADER, max_new_tokens=4, device="cpu", compare=False)
    assert given is not None and (given.grader, given.max_new_tokens, given.rows) == ("similar", 4, 1)
    assert given.records[0]["tokens"] <= 4


def test_loading_choices_that_cannot_work_name_the_option(trained, tmp_path):
    adapter, _, _, device = trained
    _cpu_only(device)
    with pytest.raises(AdapterOptionError) as fmt:
        load_adapted(adapter, None, "int8", "cpu")
    assert fmt.value.option == "quantization" and "got 'int8'" in str(fmt.value)
    with pytest.raises(AdapterOptionError) as dev:
        load_adapted(adapter, None, None, "no-such-device")
    assert dev.value.option == "device"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterLoadError) as load:
        load_adapted(adapter, str(empty), None, "cpu")
    assert str(load.value).startswith(f"cannot load {empty} with the adapter in {adapter}: ")


def test_a_stop_request_ends_it_with_nothing(trained):
    adapter, _, test, device = trained
    _cpu_only(device)
    assert evaluate_adapter(adapter, read_test_rows(test), device="cpu", should_stop=lambda: True) is None
