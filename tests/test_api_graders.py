"""/v1/fine_tuning/alpha/graders against Postgres and SQLite: validate (the checks job creation
makes, a 422 naming the field), run (the reward training would give, each grader type; python
graders that raise or never return reported in metadata.errors; a backtracking regex cut off
without freezing the API), body validation, auth, limits, the official ``openai`` SDK and the
``qerl graders`` CLI against a live server."""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from qerl.cli import app as cli_app
from service import grader_run
from service.routes import graders as graders_route
from tests._judge import KEY, start_judge
from tests.test_api_files import assert_error
from tests.test_api_jobs import MODEL, RG

VALIDATE, RUN = "/v1/fine_tuning/alpha/graders/validate", "/v1/fine_tuning/alpha/graders/run"
ANSWER = {"type": "string_check", "name": "answer", "input": "{{sample.output_text}}",
          "reference": "{{item.answer}}", "operation": "eq"}
FORMAT = {"type": "format", "name": "format", "pattern": r"<think>.*</think>\s*<answer>.*</answer>"}
MATH = {"type": "math_answer", "name": "answer", "reference": "{{item.solution}}"}
MULTI = {"type": "multi", "name": "reasoning", "graders": {"format": FORMAT, "answer": MATH},
         "calculate_output": "0.2 * format + 0.8 * answer"}
PY_OK = {"type": "python", "name": "py", "source": (
    "def grade(sample, item):\n"
    "    data = sample['output_json'] or {}\n"
    "    return 0.25 + 0.5 * (data.get('total') == item['total'])\n")}
PY_RAISES = {"type": "python", "source": "def grade(sample, item):\n    return 1 / len(item)\n"}
PY_LOOPS = {"type": "python", "source": "def grade(sample, item):\n    while True:\n        pass\n"}
PY_SLEEPS = {"type": "python", "source": "import time\ndef grade(sample, item):\n    time.sleep(60)\n    return 1.0\n"}
NO_ERRORS = {"formula_parse_error": False, "invalid_variable_error": False, "model_grader_parse_error": False,
             "model_grader_refusal_error": False, "model_grader_server_error": False,
             "model_grader_server_error_details": None, "other_error": False, "python_grader_runtime_error": False,
             "python_grader_runtime_error_details": None, "python_grader_server_error": False,
             "python_grader_server_error_type": None, "sample_parse_error": False,
             "truncated_observation_error": False, "unresponsive_reward_error": False}


def run(client, key, grader: dict, sample: str, item: dict | None = None, status: int = 200) -> dict:
    body = {"grader": grader, "model_sample": sample} | ({"item": item} if item is not None else {})
    resp = client.post(RUN, headers=key.headers, json=body)
    assert resp.status_code == status, resp.text
    return resp.json()


def assert_scored(result: dict, reward: float, scores: dict, sub_rewards: dict | None = None,
                  judged: tuple = (None, None)) -> None:
    assert result["reward"] == pytest.approx(reward, abs=1e-12), result
    assert result["metadata"]["scores"] == pytest.approx(scores, abs=1e-12)
    assert result["sub_rewards"] == pytest.approx(sub_rewards or {}, abs=1e-12)
    assert result["metadata"]["errors"] == NO_ERRORS and result["qerl"]["error"] is None
    assert (result["metadata"]["token_usage"], result["metadata"]["sampled_model_name"]) == judged
    assert result["model_grader_token_usage_per_model"] == {}
    assert 0 <= result["metadata"]["execution_time"] < 30


def lcs(a: str, b: str) -> int:
    """The longest common subsequence by the textbook O(len(a) * len(b)) table."""
    row = [0] * (len(b) + 1)
    for ca in a:
        prev_diag = 0
        for j, cb in enumerate(b, 1):
            prev_diag, row[j] = row[j], prev_diag + 1 if ca == cb else max(row[j], row[j - 1])
    return row[-1]


# -- validate --------------------------------------------------------------------------------
@pytest.mark.parametrize("grader,fields", [
    (ANSWER, ["answer"]), (MULTI, ["solution"]), (PY_OK, ["total"]),
    ({"type": "reasoning_gym", "task": "products"}, ["answer"]),
    ({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.ref}}",
      "evaluation_metric": "fuzzy_match", "pass_threshold": 0.8}, ["ref"]),
    ({"type": "text_similarity", "input": "{{item.a}} {{sample.output_text}}", "reference": "{{item.ref}}",
      "evaluation_metric": "rouge_l"}, ["a", "ref"]),
    (FORMAT, [])])
def test_validate_returns_the_grader_as_given_and_the_fields_rows_need(client, key_a, grader, fields):
    resp = client.post(VALIDATE, headers=key_a.headers, json={"grader": grader})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"grader": grader, "qerl": {"item_fields": fields}}


BAD = [  # (grader, param, words of the message)
    (ANSWER | {"operation": "contains"}, "grader.operation", "must be one of eq, ne, like, ilike"),
    ({**MULTI, "graders": {"format": FORMAT, "answer": ANSWER | {"operation": "equals"}}},
     "grader.graders.answer.operation", "got 'equals'"),
    (MULTI | {"calculate_output": "0.2 * format + 0.8 * correct"}, "grader.calculate_output",
     "unknown name 'correct'; the graders are answer, format"),
    (MULTI | {"calculate_output": "1e999 * format"}, "grader.calculate_output", "out of range"),
    ({**MULTI, "graders": {"format": FORMAT | {"pattern": "(<think>"}, "answer": MATH}},
     "grader.graders.format.pattern", "not a valid regular expression"),
    ({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "x", "evaluation_metric": "cosine"},
     "grader.evaluation_metric", "'cosine' is not available: it needs an embedding model"),
    ({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "x", "evaluation_metric": "rouge"},
     "grader.evaluation_metric", "must be one of fuzzy_match, bleu, gleu, meteor, rouge_1, rouge_2, rouge_3"),
    ({"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "x",
      "evaluation_metric": "fuzzy_match", "pass_threshold": 10**400}, "grader.pass_threshold", "finite number"),
    (ANSWER | {"input": "{{sample.text}}"}, "grader.input", "unknown template variable {{sample.text}}"),
    (ANSWER | {"labels": ["a"]}, "grader.labels", "is not a field of a string_check grader"),
    ({"type": "score_model", "model": "judge", "input": [{"role": "user", "content": "{{sample.output_text}}"}]},
     "grader.type", "model graders need a judge endpoint, and this server has none"),
    ({"type": "score_model", "model": "judge", "input": []}, "grader.input", "must be a non-empty list of messages"),
    ({"type": "label_model", "model": "judge", "input": [{"role": "user", "content": "x"}], "labels": ["a", "b"],
      "passing_labels": ["c"]}, "grader.passing_labels", "'c' not among labels"),
    (PY_OK | {"source": "def score(sample):\n    return 1\n"}, "grader.source", "grade(sample, item)"),
    (PY_OK | {"source": "def grade(sample, item) return 1"}, "grader.source", "does not parse"),
]


@pytest.mark.parametrize("grader,param,words", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_validate_names_the_field_and_job_creation_agrees(client, key_a, grader, param, words):
    err = assert_error(client.post(VALIDATE, headers=key_a.headers, json={"grader": grader}), 422, param,
                       "invalid_value")
    assert words in err["message"], err
    # the same checks as a job's: the same message, the field under method.reinforcement
    job = {"model": MODEL, "method": {"type": "reinforcement", "reinforcement": {"grader": grader}},
           "qerl": {"dataset": RG}}
    job_err = assert_error(client.post("/v1/fine_tuning/jobs", headers=key_a.headers, json=job), 422,
                           "method.reinforcement." + param)
    assert job_err["message"] == err["message"]
    # and run refuses it before grading anything
    assert run(client, key_a, grader, "x", status=422)["error"]["param"] == param


@pytest.mark.parametrize("body,param,code", [
    ({"grader": ANSWER, "extra": 1}, "extra", "invalid_value"),
    ({}, "grader", "missing_required"),
    ({"grader": "string_check"}, "grader", "invalid_value"),
])
def test_validate_body_is_checked(client, key_a, body, param, code):
    assert_error(client.post(VALIDATE, headers=key_a.headers, json=body), 422, param, code)


@pytest.mark.parametrize("body,param", [
    ({"grader": ANSWER, "model_sample": "4", "reference_answer": "4"}, "reference_answer"),
    ({"grader": ANSWER}, "model_sample"),
    ({"grader": ANSWER, "model_sample": 4}, "model_sample"),
    ({"grader": ANSWER, "model_sample": "4", "item": ["4"]}, "item"),
])
def test_run_body_is_checked(client, key_a, body, param):
    assert_error(client.post(RUN, headers=key_a.headers, json=body), 422, param)


def test_deeply_nested_bodies_are_refused(client, key_a):
    item: dict = {}
    for _ in range(40):
        item = {"a": item}
    err = assert_error(client.post(RUN, headers=key_a.headers, json={"grader": ANSWER, "model_sample": "x",
                                                                     "item": item}), 422)
    assert "nests deeper than" in err["message"]


# -- run: every grader type ------------------------------------------------------------------
def test_run_string_check(client, key_a):
    assert_scored(run(client, key_a, ANSWER, "42", {"answer": "42"}), 1.0, {"answer": 1.0})
    assert_scored(run(client, key_a, ANSWER, "42 ", {"answer": "42"}), 0.0, {"answer": 0.0})
    like = ANSWER | {"operation": "ilike", "name": "mentions"}
    result = run(client, key_a, like, "The capital is PARIS.", {"answer": "Paris"})
    assert_scored(result, 1.0, {"mentions": 1.0})
    assert result["metadata"]["name"] == "mentions" and result["metadata"]["type"] == "string_check"
    nested = ANSWER | {"reference": "{{item.meta.answers.1}}"}
    assert run(client, key_a, nested, "b", {"meta": {"answers": ["a", "b"]}})["reward"] == 1.0
    structured = ANSWER | {"input": "{{sample.output_json.answer}}"}  # a sample that is JSON, read by field
    assert run(client, key_a, structured, '{"answer": 42, "why": "6 x 7"}', {"answer": "42"})["reward"] == 1.0
    assert run(client, key_a, structured, "42", {"answer": "42"})["reward"] == 0.0


def test_run_text_similarity_is_the_lcs_ratio(client, key_a):
    grader = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}",
              "reference": "{{item.ref}}", "evaluation_metric": "fuzzy_match"}
    sample, ref = "the quick brown fox jumps over the lazy dog", "a quick brown dog leaps over lazy foxes"
    expected = 2 * lcs(sample, ref) / (len(sample) + len(ref))
    assert 0.3 < expected < 0.95
    assert_scored(run(client, key_a, grader, sample, {"ref": ref}), expected, {"close": expected})


def test_run_text_similarity_rouge_l_and_bleu_are_the_libraries(client, key_a):
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from rouge_score.rouge_scorer import RougeScorer

    sample, ref = "The quick brown fox jumps over the lazy dog.", "A quick brown dog leaps over lazy foxes."
    rouge_l = RougeScorer(["rougeL"]).score(ref, sample)["rougeL"].fmeasure
    hyp, ref_words = (re.findall(r"\w+|[^\w\s]", text.lower()) for text in (sample, ref))  # the grader's tokens
    bleu = sentence_bleu([ref_words], hyp, smoothing_function=SmoothingFunction().method1)
    assert 0.1 < rouge_l < 0.9 and 0.01 < bleu < 0.9
    for metric, expected in (("rouge_l", rouge_l), ("bleu", bleu)):
        grader = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}",
                  "reference": "{{item.ref}}", "evaluation_metric": metric}
        assert_scored(run(client, key_a, grader, sample, {"ref": ref}), expected, {"close": expected})


def test_run_math_answer(client, key_a):
    item = {"solution": "Half of 2,000 is 1,000.\n#### 1,000"}
    assert_scored(run(client, key_a, MATH, "so <answer>1000.0</answer>", item), 1.0, {"answer": 1.0})
    assert_scored(run(client, key_a, MATH, "so <answer>999</answer>", item), 0.0, {"answer": 0.0})
    assert run(client, key_a, MATH, "it is \\boxed{\\frac{3}{4}}", {"solution": "0.75"})["reward"] == 1.0


def test_run_format_with_a_weight(client, key_a):
    half = FORMAT | {"weight": 0.5}
    assert_scored(run(client, key_a, half, "<think>x</think> <answer>1</answer>"), 0.5, {"format": 0.5})
    assert_scored(run(client, key_a, half, "<answer>1</answer>"), 0.0, {"format": 0.0})


def test_run_multi_combines_named_sub_graders(client, key_a):
    item = {"solution": "12"}
    good_format = "<think>3*4</think><answer>11</answer>"
    assert_scored(run(client, key_a, MULTI, good_format, item), 0.2 * 1 + 0.8 * 0,
                  {"format": 1.0, "answer": 0.0}, {"format": 1.0, "answer": 0.0})
    assert_scored(run(client, key_a, MULTI, "<answer>12</answer>", item), 0.2 * 0 + 0.8 * 1,
                  {"format": 0.0, "answer": 1.0}, {"format": 0.0, "answer": 1.0})
    # nested, with a python grader: scores name every part, sub_rewards only what the formula combined
    outer = {"type": "multi", "graders": {"inner": MULTI, "py": PY_OK},
             "calculate_output": "max(inner, py) - 0.1 * min(inner, py)"}
    sample = '{"total": 12}'  # no tags: format 0; math_answer takes the last number, 12: answer 1
    inner, py = 0.2 * 0 + 0.8 * 1, 0.25 + 0.5
    assert_scored(run(client, key_a, outer, sample, item | {"total": 12}), max(inner, py) - 0.1 * min(inner, py),
                  {"inner": inner, "inner.format": 0.0, "inner.answer": 1.0, "py": py}, {"inner": inner, "py": py})


def test_run_python_grader_reads_sample_json_and_item(client, key_a):
    assert_scored(run(client, key_a, PY_OK, '{"total": 7}', {"total": 7}), 0.75, {"py": 0.75})
    assert_scored(run(client, key_a, PY_OK, "7", {"total": 7}), 0.25, {"py": 0.25})  # not JSON: output_json None


def test_run_reports_a_python_grader_that_raises(client, key_a):
    result = run(client, key_a, PY_RAISES, "x", {})
    errors = result["metadata"]["errors"]
    assert result["reward"] == 0.0 and result["metadata"]["scores"] == {} and result["sub_rewards"] == {}
    assert errors["python_grader_runtime_error"] is True and errors["unresponsive_reward_error"] is False
    assert "ZeroDivisionError" in errors["python_grader_runtime_error_details"]
    assert result["qerl"]["error"] == errors["python_grader_runtime_error_details"]
    assert {k for k, v in errors.items() if v not in (False, None)} == {"python_grader_runtime_error",
                                                                         "python_grader_runtime_error_details"}
    # a sub-grader that fails fails the whole multi grader, as it fails a training job
    multi = {"type": "multi", "graders": {"format": FORMAT, "py": PY_RAISES}, "calculate_output": "format + py"}
    failed = run(client, key_a, multi, "<think></think><answer></answer>", {})
    assert failed["reward"] == 0.0 and failed["metadata"]["errors"]["python_grader_runtime_error"] is True
    assert failed["metadata"]["type"] == "multi"


def test_run_reports_a_python_grader_that_never_returns(client, key_a):
    start = time.monotonic()
    result = run(client, key_a, PY_LOOPS, "x", {})
    errors = result["metadata"]["errors"]
    assert result["reward"] == 0.0
    assert errors["unresponsive_reward_error"] is True and errors["python_grader_runtime_error"] is True
    assert "CPU time limit (2 s per sample)" in errors["python_grader_runtime_error_details"]
    assert time.monotonic() - start < 15  # the sandbox's own limits (engine.rewards.python_grader.Limits)


def test_run_model_graders_ask_the_servers_judge(client, key_a, monkeypatch):
    judge, server = start_judge()
    monkeypatch.setenv("QERL_GRADER_BASE_URL", judge.url)
    monkeypatch.setenv("QERL_GRADER_API_KEY", KEY)
    prompt = [{"role": "user", "content": "reference: {{item.answer}}\nsample: {{sample.output_text}}"}]
    score = {"type": "score_model", "name": "judge", "model": "judge-7b", "input": prompt, "range": [0, 10]}
    label = {"type": "label_model", "name": "verdict", "model": "judge-7b", "input": prompt,
             "labels": ["correct", "incorrect"], "passing_labels": ["correct"]}
    try:
        used = len("reference: 19\nsample: It is 19.".split()) + 5  # the judge's reported usage
        assert_scored(run(client, key_a, score, "It is 19.", {"answer": "19"}), 5.0, {"judge": 5.0},
                      judged=(used, "judge-7b"))
        assert_scored(run(client, key_a, label, "20", {"answer": "19"}), 0.0, {"verdict": 0.0},
                      judged=(used - 2, "judge-7b"))
        assert judge.requests[0]["body"]["messages"] == [{"role": "user", "content": "reference: 19\nsample: It is 19."}]
        for behaviour, flag in (("refuse", "model_grader_refusal_error"), ("garbage", "model_grader_parse_error"),
                                ("not_found", "model_grader_server_error")):
            judge.behaviour = behaviour
            result = run(client, key_a, score, "19", {"answer": "19"})
            errors = result["metadata"]["errors"]
            assert result["reward"] == 0.0 and errors[flag] is True, result
            assert {k for k, v in errors.items() if v not in (False, None)} <= {flag, "model_grader_server_error_details"}
            assert result["qerl"]["error"]
        assert "HTTP 404" in errors["model_grader_server_error_details"] and judge.url in result["qerl"]["error"]
    finally:
        server.shutdown()


def test_run_reports_an_output_beyond_float_range(client, key_a):
    huge = {"type": "multi", "graders": {"format": FORMAT}, "calculate_output": "1e308 * format + 1e308 * format"}
    result = run(client, key_a, huge, "<think></think><answer></answer>", {})
    assert result["reward"] == 0.0 and result["metadata"]["errors"]["other_error"] is True
    assert "not finite" in result["qerl"]["error"]
    assert_scored(run(client, key_a, huge, "no tags", {}), 0.0, {"format": 0.0}, {"format": 0.0})  # 1e308 * 0


def test_run_item_missing_a_field_is_422(client, key_a):
    err = assert_error(client.post(RUN, headers=key_a.headers, json={"grader": MULTI, "model_sample": "1"}), 422,
                       "item", "invalid_value")
    assert "item.solution" in err["message"] and "read by grader.graders.answer.reference" in err["message"]


# -- run: limits -----------------------------------------------------------------------------
def _run_dirs_processes() -> set[str]:
    """Processes whose working directory is (or was) inside a run's scratch dir (service.grader_run)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                continue
            if "qerl-grader-run-" in cwd:
                found.add(f"{entry} {cwd}")
    return found


def test_a_backtracking_regex_is_cut_off_and_the_api_keeps_answering(live_server, key_a, monkeypatch):
    monkeypatch.setattr(grader_run, "BASE_S", 3.0)
    evil = {"type": "format", "pattern": "(a+)+$", "match": "search"}
    result: dict = {}
    before = _run_dirs_processes()

    def slow() -> None:
        resp = httpx.post(f"{live_server.url}{RUN}", headers=key_a.headers, timeout=60,
                          json={"grader": evil, "model_sample": "a" * 40 + "b"})
        result.update(resp.json(), status=resp.status_code)

    thread = threading.Thread(target=slow)
    start = time.monotonic()
    thread.start()
    time.sleep(0.5)
    latencies = []
    while thread.is_alive() and time.monotonic() - start < 30:
        t = time.monotonic()
        assert httpx.get(f"{live_server.url}/v1/models", headers=key_a.headers, timeout=10).status_code == 200
        latencies.append(time.monotonic() - t)
        time.sleep(0.2)
    thread.join(30)
    assert result["status"] == 200 and result["reward"] == 0.0, result
    assert result["metadata"]["errors"]["unresponsive_reward_error"] is True
    assert "did not finish within 3 s" in result["qerl"]["error"]
    assert 3 <= result["metadata"]["execution_time"] < 10
    assert len(latencies) >= 5 and max(latencies) < 1.5, latencies  # served while the regex ran
    assert _run_dirs_processes() - before == set()


def test_a_run_over_its_budget_leaves_no_sandbox_behind(client, key_a, monkeypatch):
    # a budget shorter than the python grader's own wall time: the run is killed while its sandbox sleeps
    monkeypatch.setattr(grader_run, "BASE_S", -9.0)  # 11 s per python grader: 2 s in all
    before = _run_dirs_processes()
    start = time.monotonic()
    result = run(client, key_a, PY_SLEEPS, "x", {})
    assert time.monotonic() - start < 8
    assert result["reward"] == 0.0 and result["metadata"]["errors"]["unresponsive_reward_error"] is True
    time.sleep(0.2)
    assert _run_dirs_processes() - before == set()


def test_runs_beyond_the_servers_share_are_429(client, key_a):
    taken = 0
    try:
        while graders_route.RUNS.acquire(blocking=False):
            taken += 1
        assert taken == graders_route.MAX_RUNS
        resp = client.post(RUN, headers=key_a.headers, json={"grader": ANSWER, "model_sample": "1",
                                                             "item": {"answer": "1"}})
        assert_error(resp, 429, code="too_many_grader_runs")
        assert resp.headers["Retry-After"] == str(graders_route.RETRY_AFTER_S)
    finally:
        for _ in range(taken):
            graders_route.RUNS.release()
    assert run(client, key_a, ANSWER, "1", {"answer": "1"})["reward"] == 1.0


# -- auth and rate limit ---------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [(VALIDATE, {"grader": ANSWER}),
                                       (RUN, {"grader": ANSWER, "model_sample": "1"})])
def test_a_key_is_required(client, path, body):
    assert_error(client.post(path, json=body), 401, code="invalid_api_key")
    assert_error(client.post(path, json=body, headers={"Authorization": "Bearer sk-qerl-nope"}), 401,
                 code="invalid_api_key")


def test_grader_calls_count_against_the_keys_rate_limit(make_client, key_a):
    limited = make_client(rate_limit_per_minute=2)
    assert limited.post(VALIDATE, headers=key_a.headers, json={"grader": ANSWER}).status_code == 200
    assert limited.post(RUN, headers=key_a.headers, json={"grader": ANSWER, "model_sample": "1",
                                                          "item": {"answer": "1"}}).status_code == 200
    resp = limited.post(RUN, headers=key_a.headers, json={"grader": ANSWER, "model_sample": "1"})
    assert_error(resp, 429, code="rate_limit_exceeded")
    assert int(resp.headers["Retry-After"]) >= 1


# -- the openai SDK and the CLI, against a live server ---------------------------------------
@pytest.fixture
def sdk(live_server, key_a) -> OpenAI:
    return OpenAI(base_url=f"{live_server.url}/v1", api_key=key_a.secret, max_retries=0, timeout=60)


def test_openai_sdk_validate_and_run(sdk: OpenAI, live_server):
    checked = sdk.fine_tuning.alpha.graders.validate(grader=MULTI)
    assert checked.grader is not None and checked.grader.type == "multi"
    assert checked.grader.calculate_output == MULTI["calculate_output"]

    result = sdk.fine_tuning.alpha.graders.run(grader=MULTI, model_sample="<think>.</think><answer>3</answer>",
                                               item={"solution": "#### 3"})
    assert result.reward == pytest.approx(1.0) and result.sub_rewards == {"format": 1.0, "answer": 1.0}
    assert result.metadata.type == "multi" and result.metadata.name == "reasoning"
    assert result.metadata.scores == {"format": 1.0, "answer": 1.0}
    assert result.metadata.errors.python_grader_runtime_error is False and result.metadata.token_usage is None
    assert result.api_model_grader_token_usage_per_model == {}

    failed = sdk.fine_tuning.alpha.graders.run(grader=PY_RAISES, model_sample="x")
    assert failed.reward == 0.0 and failed.metadata.errors.python_grader_runtime_error is True
    assert "ZeroDivisionError" in failed.metadata.errors.python_grader_runtime_error_details

    with pytest.raises(openai.UnprocessableEntityError) as exc:
        sdk.fine_tuning.alpha.graders.validate(grader=ANSWER | {"operation": "contains"})
    assert exc.value.param == "grader.operation" and exc.value.code == "invalid_value"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{live_server.url}/v1", api_key="sk-wrong", max_retries=0).fine_tuning.alpha.graders.run(
            grader=ANSWER, model_sample="1")


def test_cli_validate_and_run(live_server, key_a, tmp_path: Path):
    grader, item = tmp_path / "grader.json", tmp_path / "item.json"
    grader.write_text(json.dumps(MULTI))
    item.write_text(json.dumps({"solution": "12"}))
    server = ["--base-url", live_server.url, "--api-key", key_a.secret]
    runner = CliRunner()

    ok = runner.invoke(cli_app, ["graders", "validate", str(grader), *server])
    assert ok.exit_code == 0 and "valid: multi grader reasoning; every row must have solution" in ok.stdout, ok.output
    scored = runner.invoke(cli_app, ["graders", "run", str(grader), "--sample", "<think>.</think><answer>11</answer>",
                                     "--item", str(item), "--json", *server])
    assert scored.exit_code == 0, scored.output
    body = json.loads(scored.stdout)
    assert body["reward"] == pytest.approx(0.2) and body["sub_rewards"] == {"format": 1.0, "answer": 0.0}
    table = runner.invoke(cli_app, ["graders", "run", str(grader), "--sample", "<answer>12</answer>",
                                    "--item", str(item), *server])
    assert table.exit_code == 0 and "answer" in table.stdout, table.output
    assert re.match(r"reward 0\.8  \(multi [a-z_]+, [0-9.]+ ms\)\n", table.stdout), table.output  # one line

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(ANSWER | {"operation": "contains"}))
    refused = runner.invoke(cli_app, ["graders", "validate", str(bad), *server])
    assert refused.exit_code == 1 and "grader.operation must be one of eq, ne, like, ilike" in refused.output
    raising = tmp_path / "raises.json"
    raising.write_text(json.dumps(PY_RAISES))
    failed = runner.invoke(cli_app, ["graders", "run", str(raising), "--sample", "x", *server])
    assert failed.exit_code == 1 and "ZeroDivisionError" in failed.output, failed.output
