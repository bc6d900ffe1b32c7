"""score_model and label_model against a judge served over HTTP (tests/_judge.py): the requests
they send (rendered messages, JSON schema, sampling parameters, key), the rewards they read back
(JSON or prose), retries, failures named as the job would report them, concurrency, inside a
multi grader and through the training loop's grading."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from engine.evaluate import grade
from engine.rewards import build_grader
from engine.rewards import model_grader
from engine.rewards.model_grader import ModelGraderError
from engine.types import TrainError
from tests._judge import KEY, start_judge

PROMPT = [{"role": "system", "content": "You grade answers."},
          {"role": "user", "content": "Question: {{item.question}}\nreference: {{item.answer}}\n"
                                      "sample: {{sample.output_text}}"}]
SCORE = {"type": "score_model", "name": "judge", "model": "judge-7b", "input": PROMPT, "range": [0, 10],
         "sampling_params": {"temperature": 0.0, "seed": 3, "max_completions_tokens": 64}}
LABEL = {"type": "label_model", "name": "verdict", "model": "judge-7b", "input": PROMPT,
         "labels": ["correct", "incorrect"], "passing_labels": ["correct"]}
ITEM = {"question": "What is 12 + 7?", "answer": "19"}


@pytest.fixture
def judge(monkeypatch):
    j, server = start_judge()
    monkeypatch.setenv("QERL_GRADER_BASE_URL", j.url)
    monkeypatch.setenv("QERL_GRADER_API_KEY", KEY)
    monkeypatch.setattr(model_grader, "BACKOFF_S", (0.01, 0.02, 0.04))
    yield j
    server.shutdown()


def test_score_model_sends_the_rendered_messages_and_reads_the_judges_score(judge):
    g = build_grader(SCORE)
    assert g("19", ITEM) == (10.0, {"judge": 10.0})
    assert g("It is 19.", ITEM) == (5.0, {"judge": 5.0})
    assert g.score("It is 20.", ITEM) == 0.0
    req = judge.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == f"Bearer {KEY}"
    body = req["body"]
    assert body["model"] == "judge-7b" and body["temperature"] == 0.0 and body["seed"] == 3
    assert body["max_tokens"] == 64 and "max_completions_tokens" not in body
    assert body["messages"] == [{"role": "system", "content": "You grade answers."},
                                {"role": "user", "content": "Question: What is 12 + 7?\nreference: 19\nsample: 19"}]
    schema = body["response_format"]["json_schema"]
    assert schema["name"] == "score" and schema["schema"]["required"] == ["result"]
    # the judge's number is clipped to the range: [0, 1] unless given
    assert build_grader({k: v for k, v in SCORE.items() if k != "range"})("19", ITEM)[0] == 1.0
    assert g.max_score == 10.0  # full credit for accuracy is the top of the range


def test_label_model_passes_on_the_passing_labels(judge):
    g = build_grader(LABEL)
    assert [g(s, ITEM)[0] for s in ("19", "It is 19.", "20")] == [1.0, 1.0, 0.0]
    assert build_grader(LABEL | {"passing_labels": ["incorrect"]})("20", ITEM)[0] == 1.0
    enum = judge.requests[0]["body"]["response_format"]["json_schema"]["schema"]["properties"]["label"]["enum"]
    assert enum == ["correct", "incorrect"]


def test_a_judge_answering_in_prose_is_read_for_its_last_number_or_first_label(judge):
    judge.behaviour = "prose"
    assert build_grader(SCORE)("It is 19.", ITEM)[0] == 5.0  # "... Out of 10: 5"
    assert build_grader(LABEL)("20", ITEM)[0] == 0.0  # "My verdict: incorrect." ("correct" inside it is not a word)


@pytest.mark.parametrize("behaviour,kind,words,requests", [
    ("down", "server", "HTTP 503", 4),  # retried three times
    ("not_found", "server", "HTTP 404", 1),  # not retried
    ("refuse", "refusal", "refused to grade: I can't grade this.", 1),
    ("garbage", "parse", "holds no score: 'Hard to say.'", 1),
])
def test_judge_failures_are_grader_errors_naming_the_reason(judge, behaviour, kind, words, requests):
    judge.behaviour = behaviour
    with pytest.raises(ModelGraderError) as exc:
        build_grader(SCORE)("19", ITEM)
    assert exc.value.kind == kind and exc.value.code == "grader_error" and words in str(exc.value)
    if kind == "server":
        assert judge.url in str(exc.value) and "judge-7b" in str(exc.value)
    assert len(judge.requests) == requests


def test_transient_failures_are_retried(judge):
    judge.fail_first = 2
    assert build_grader(SCORE)("19", ITEM)[0] == 10.0 and len(judge.requests) == 3


def test_a_wrong_key_is_not_retried(judge, monkeypatch):
    monkeypatch.setenv("QERL_GRADER_API_KEY", "sk-wrong")
    with pytest.raises(ModelGraderError, match="HTTP 401"):
        build_grader(LABEL)("19", ITEM)
    assert len(judge.requests) == 1


def test_a_steps_samples_are_graded_concurrently(judge, monkeypatch):
    monkeypatch.setenv("QERL_GRADER_CONCURRENCY", "8")
    judge.delay_s = 0.25
    samples = [str(n) for n in range(16)]
    t0 = time.monotonic()
    got = build_grader(SCORE).batch(samples, [ITEM] * 16)
    elapsed = time.monotonic() - t0
    assert [s for s, _ in got] == [10.0 if n == "19" else (5.0 if "19" in n else 0.0) for n in samples]
    # at most 8 at once, and in parallel (serially 16 x 0.25 s); on a loaded machine the 8th may start late
    assert 4 <= judge.max_in_flight <= 8 and elapsed < 16 * 0.25 / 2, (judge.max_in_flight, elapsed)


def test_inside_a_multi_grader_and_the_training_loops_grading(judge):
    multi = build_grader({"type": "multi", "name": "both", "calculate_output": "0.1 * judge + 0.5 * exact",
                          "graders": {"judge": SCORE, "exact": {"type": "string_check", "input": "{{sample.output_text}}",
                                                                "reference": "{{item.answer}}", "operation": "eq"}}})
    completions = [SimpleNamespace(text=t) for t in ("19", "It is 19.", "7")]
    scores, parts, correct = grade(multi, completions, [ITEM] * 3)
    assert scores == pytest.approx([1.5, 0.5, 0.0]) and parts[1] == {"judge": 5.0, "exact": 0.0}
    assert len(judge.requests) == 3
    # the judge's reported usage, summed through the multi grader
    assert model_grader.judge_tokens(multi) == sum(
        sum(len(m["content"].split()) for m in r["body"]["messages"]) + 5 for r in judge.requests)
    judge.behaviour = "down"
    with pytest.raises(TrainError) as exc:  # the job fails grader_error, naming the judge
        grade(multi, completions, [ITEM] * 3)
    assert exc.value.code == "grader_error" and "HTTP 503" in str(exc.value)
    with pytest.raises(TrainError) as exc:  # a row without the field a template reads: the dataset's fault
        grade(build_grader(SCORE), completions[:1], [{"answer": "19"}])
    assert exc.value.code == "invalid_dataset" and "item.question" in str(exc.value)


@pytest.mark.parametrize("cfg,needle", [
    (SCORE | {"range": [1, 1]}, "grader.range must be [low, high] with low < high"),
    (SCORE | {"range": [0, True]}, "grader.range must be [low, high]"),
    (SCORE | {"input": [{"role": "judge", "content": "x"}]}, "grader.input.0.role must be one of system"),
    (SCORE | {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "grader.input.0.content.0 must be a text part"),
    (SCORE | {"input": [{"role": "user", "content": "{{item.a"}]}, "grader.input.0.content: unbalanced"),
    (SCORE | {"sampling_params": {"temperature": "hot"}}, "grader.sampling_params.temperature must be a number"),
    (SCORE | {"sampling_params": {"logprobs": True}}, "grader.sampling_params.logprobs is not a sampling parameter"),
    (SCORE | {"sampling_params": {"max_completions_tokens": 0}}, "max_completions_tokens must be an integer >= 1"),
    (LABEL | {"labels": ["a", "a"]}, "grader.labels must be a non-empty list of distinct strings"),
    (LABEL | {"passing_labels": ["maybe"]}, "grader.passing_labels: 'maybe' not among labels"),
    ({k: v for k, v in LABEL.items() if k != "labels"}, "grader.labels is required"),
])
def test_bad_configs_name_the_field(judge, cfg, needle):
    with pytest.raises(ValueError) as exc:
        build_grader(cfg)
    assert needle in str(exc.value)
    assert judge.requests == []


def test_without_a_judge_endpoint_the_grader_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.delenv("QERL_GRADER_BASE_URL", raising=False)
    with pytest.raises(ValueError) as exc:
        build_grader(SCORE)
    assert str(exc.value).startswith("grader.type: model graders need a judge endpoint")
    assert "QERL_GRADER_BASE_URL" in str(exc.value)


def test_content_parts_are_joined_as_text(judge):
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "reference: {{item.answer}}"},
                                          {"type": "input_text", "text": "sample: {{sample.output_text}}"}]}]
    assert build_grader(SCORE | {"input": parts})("19", ITEM)[0] == 10.0
    assert judge.requests[0]["body"]["messages"] == [{"role": "user", "content": "reference: 19\nsample: 19"}]


@pytest.mark.parametrize("name,value", [("QERL_GRADER_TIMEOUT_SECONDS", "soon"), ("QERL_GRADER_CONCURRENCY", "0")])
def test_a_bad_server_setting_is_named(judge, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as exc:
        build_grader(LABEL)
    assert str(exc.value).startswith(f"grader.type: the server's {name} must be a number above 0; got {value!r}")


def test_a_run_whose_judge_stays_down_stops_with_a_checkpoint_and_resumes_from_it(judge, tiny_model_dir, tmp_path):
    """The engine without the service (qerl train): the judge down from the first evaluation on."""
    from engine import NullReporter, TrainSpec, train
    from engine.types import GraderUnavailable
    from tests._worker_fixtures import tiny_spec

    grader = LABEL | {"input": [{"role": "user", "content": "reference: {{item.answer}}\nsample: {{sample.output_text}}"}]}
    spec = TrainSpec.from_dict(tiny_spec(str(tiny_model_dir), steps=2, grader=grader, data={"eval_size": 2}))
    judge.behaviour = "down"
    with pytest.raises(GraderUnavailable) as exc:
        train(spec, workdir=tmp_path, reporter=NullReporter(), should_stop=lambda: False)
    assert exc.value.code == "grader_unavailable" and "HTTP 503" in str(exc.value)
    assert exc.value.checkpoint.name == "step-000000" and "resume it once the judge answers again" in str(exc.value)
    judge.behaviour = "grade"
    result = train(spec, workdir=tmp_path, reporter=NullReporter(), should_stop=lambda: False,
                   resume_from=exc.value.checkpoint)
    assert (result.steps, result.stopped) == (2, False) and "eval/accuracy" in result.metrics
