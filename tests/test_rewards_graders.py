"""Graders: OpenAI shapes, templates, math extraction, the safe multi expression, reasoning-gym."""
from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from engine.rewards import build_grader
from engine.rewards.math_answer import extract_answer
from engine.rewards.text import SIMILARITY_METRICS, fuzzy_ratio

S = "{{sample.output_text}}"


def check(op, reference="{{item.answer}}"):
    return build_grader({"type": "string_check", "name": "s", "input": S, "reference": reference, "operation": op})


def test_string_check_operations():
    item = {"answer": "Paris"}
    assert check("eq")("Paris", item) == (1.0, {"s": 1.0})
    assert check("eq")("paris", item)[0] == 0.0
    assert check("ne")("Lyon", item)[0] == 1.0 and check("ne")("Paris", item)[0] == 0.0
    assert check("like")("It is Paris.", item)[0] == 1.0 and check("like")("It is PARIS.", item)[0] == 0.0
    assert check("ilike")("It is PARIS.", item)[0] == 1.0 and check("ilike")("Rome", item)[0] == 0.0


def test_templates_read_nested_fields_and_lists():
    item = {"meta": {"city": {"name": "Oslo"}}, "options": ["a", "Bergen"], "n": 42.0, "obj": {"k": [1, 2]}}
    assert check("eq", "{{ item.meta.city.name }}")("Oslo", item)[0] == 1.0
    assert check("eq", "{{item.options.1}}")("Bergen", item)[0] == 1.0
    assert check("eq", "x={{item.n}}")("x=42", item)[0] == 1.0  # integral floats print as integers
    assert check("eq", "{{item.obj}}")('{"k": [1, 2]}', item)[0] == 1.0  # objects print as JSON


def test_templates_read_the_sample_as_json():
    item = {"answer": "19", "unit": "km"}
    g = build_grader({"type": "string_check", "name": "s", "input": "{{sample.output_json.answer}}",
                      "reference": "{{item.answer}}", "operation": "eq"})
    assert g('{"answer": "19", "why": "12 + 7"}', item)[0] == 1.0
    assert g('{"answer": 19}', item)[0] == 1.0  # numbers print as in item fields
    assert g('{"answer": "20"}', item)[0] == 0.0
    # not JSON, JSON without the field, JSON that is not an object or array: an empty answer, not an error
    for sample in ("19", '{"total": "19"}', '"19"', '{"answer": ', "[1, 2]"):
        assert g(sample, item)[0] == 0.0, sample
    nested = build_grader({"type": "string_check", "name": "s", "input": "{{sample.output_json.steps.1.value}} "
                                                                       "{{ sample.output_json.unit }}",
                           "reference": "19 {{item.unit}}", "operation": "eq"})
    assert nested('{"steps": [{"value": 12}, {"value": 19}], "unit": "km"}', item)[0] == 1.0
    whole = build_grader({"type": "string_check", "name": "s", "input": "{{sample.output_json}}",
                          "reference": '{"a": [1, 2]}', "operation": "eq"})
    assert whole('{"a":[1,2]}', {})[0] == 1.0  # re-written as JSON
    assert g.item_fields == {"answer"}


@pytest.mark.parametrize("template,needle", [
    ("{{sample.text}}", "unknown template variable {{sample.text}}"),
    ("{{sample.output_json.a b}}", "unknown template variable"),
    ("{{sample.output_text.x}}", "unknown template variable"),
    ("{{item}}", "unknown template variable {{item}}"),
    ("{{item.a b}}", "unknown template variable"),
    ("{{item.answer", "unbalanced"),
    (42, "must be a string template"),
])
def test_bad_templates_name_the_field(template, needle):
    with pytest.raises(ValueError) as err:
        check("eq", template)
    assert "grader.reference" in str(err.value) and needle in str(err.value)


def test_missing_item_field_names_it_at_scoring_time():
    g = check("eq", "{{item.meta.answer}}")
    with pytest.raises(ValueError, match=r"no field item\.meta\.answer .*grader\.reference"):
        g("x", {"meta": {"other": 1}})


def _lcs_dp(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def test_fuzzy_match_equals_dynamic_programming_reference():
    rng = random.Random()
    for _ in range(200):
        a = "".join(rng.choice("abcde ") for _ in range(rng.randint(0, 80)))
        b = "".join(rng.choice("abcde ") for _ in range(rng.randint(0, 80)))
        want = 1.0 if not a and not b else 2 * _lcs_dp(a, b) / (len(a) + len(b))
        assert fuzzy_ratio(a, b) == pytest.approx(want), (a, b)


def test_text_similarity_grader():
    g = build_grader({"type": "text_similarity", "name": "sim", "input": S, "reference": "{{item.ref}}",
                      "evaluation_metric": "fuzzy_match", "pass_threshold": 0.8})
    assert g("hello world", {"ref": "hello world"}) == (1.0, {"sim": 1.0})
    score, _ = g("hello word", {"ref": "hello world"})
    assert score == pytest.approx(2 * 10 / 21) and g.passed(score)
    assert not g.passed(g("xyz", {"ref": "hello world"})[0])
    with pytest.raises(ValueError, match="evaluation_metric must be one of fuzzy_match, bleu, gleu, meteor, "
                                         "rouge_1, rouge_2, rouge_3, rouge_4, rouge_5, rouge_l; got 'rouge_6'"):
        build_grader({"type": "text_similarity", "input": S, "reference": "x", "evaluation_metric": "rouge_6"})
    with pytest.raises(ValueError, match="pass_threshold must be in"):
        build_grader({"type": "text_similarity", "input": S, "reference": "x", "evaluation_metric": "fuzzy_match",
                      "pass_threshold": 2})


LIBRARY_METRICS = [m for m in SIMILARITY_METRICS if m != "fuzzy_match"]
PAIRS = [  # (input, reference)
    ("The cat sat on the mat.", "A cat is sitting on the mat"),
    ("Paris is the capital of France.", "The capital of France is Paris."),
    ("running dogs jumped over fences", "the dog runs and jumps over the fence"),
    ("one two three four five six", "one two three four five six seven eight"),
    ("x", "x y"),
]


class _NoWordNet:
    @staticmethod
    def synsets(*args, **kwargs):
        return []


def library_similarity(metric: str, a: str, b: str) -> float:
    """nltk / rouge-score called directly on (input a, reference b), tokenized as the grader documents."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from nltk.translate.gleu_score import sentence_gleu
    from nltk.translate.meteor_score import meteor_score
    from rouge_score.rouge_scorer import RougeScorer

    if not a.strip() or not b.strip():
        return float(not a.strip() and not b.strip())
    if metric.startswith("rouge_"):
        kind = "rougeL" if metric == "rouge_l" else "rouge" + metric[-1]
        return RougeScorer([kind]).score(b, a)[kind].fmeasure
    hyp, ref = re.findall(r"\w+|[^\w\s]", a.lower()), re.findall(r"\w+|[^\w\s]", b.lower())
    if metric == "bleu":
        return sentence_bleu([ref], hyp, smoothing_function=SmoothingFunction().method1, auto_reweigh=True)
    if metric == "gleu":
        return sentence_gleu([ref], hyp)
    return meteor_score([ref], hyp, wordnet=_NoWordNet)


def similarity_grader(metric: str):
    return build_grader({"type": "text_similarity", "name": "sim", "input": S, "reference": "{{item.ref}}",
                         "evaluation_metric": metric})


@pytest.mark.parametrize("metric", LIBRARY_METRICS)
def test_text_similarity_metrics_equal_the_libraries(metric):
    g = similarity_grader(metric)
    for a, b in PAIRS:
        assert g(a, {"ref": b})[0] == pytest.approx(library_similarity(metric, a, b), abs=1e-12), (a, b)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    vocab = "the a cat dog runs ran mat on sat sits over , .".split()
    for _ in range(100):
        a = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 20)))
        b = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 20)))
        score = g(a, {"ref": b})[0]
        assert 0.0 <= score <= 1.0 and score == pytest.approx(library_similarity(metric, a, b), abs=1e-12), \
            f"seed {seed}: {a!r} vs {b!r}"


@pytest.mark.parametrize("metric", LIBRARY_METRICS)
def test_text_similarity_metrics_edge_cases(metric):
    g = similarity_grader(metric)
    text = "the quick brown fox jumps over the lazy dog"
    # METEOR's fragmentation penalty keeps one chunk of n matched words at 1 - 0.5 / n**3
    assert g(text.upper(), {"ref": text})[0] == pytest.approx(1 - 0.5 / 9**3 if metric == "meteor" else 1.0)
    assert g("alpha beta gamma delta epsilon", {"ref": text})[0] == 0.0
    assert g("", {"ref": ""})[0] == 1.0 and g("  ", {"ref": "\n"})[0] == 1.0
    assert g("", {"ref": text})[0] == 0.0 and g(text, {"ref": " "})[0] == 0.0


def test_meteor_matches_stems_without_wordnet():
    g = similarity_grader("meteor")
    assert g("dogs running", {"ref": "dog runs"})[0] > 0.4  # Porter stems: dog, run
    assert g("automobile", {"ref": "car"})[0] == 0.0  # WordNet synonyms, not used


def test_rouge_scorer_is_built_once_per_grader(monkeypatch):
    from rouge_score import rouge_scorer

    samples = ("a b c", "b c d", "c d e")
    want = [library_similarity("rouge_l", a, "a b c d") for a in samples]
    built = []

    class Counting(rouge_scorer.RougeScorer):
        def __init__(self, *args, **kwargs):
            built.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(rouge_scorer, "RougeScorer", Counting)
    g = similarity_grader("rouge_l")
    assert built == []  # built on the first score, not when a config is validated
    assert [g(a, {"ref": "a b c d"})[0] for a in samples] == pytest.approx(want)
    assert built == [(["rougeL"],)]


def test_cosine_is_refused_with_the_metrics_available():
    with pytest.raises(ValueError) as err:
        build_grader({"type": "multi", "graders": {"sim": {"type": "text_similarity", "input": S, "reference": "x",
                                                           "evaluation_metric": "cosine"}}, "calculate_output": "sim"})
    message = str(err.value)
    assert message.startswith("grader.graders.sim.evaluation_metric 'cosine' is not available")
    assert "embedding model" in message and message.endswith(", ".join(SIMILARITY_METRICS))


@pytest.mark.parametrize("text,want", [
    ("reasoning <answer> 12 </answer> then <answer>13</answer>", "13"),
    ("step\n#### 1,234\n", "1,234"),
    ("so \\boxed{\\frac{3}{4}} done", "\\frac{3}{4}"),
    ("we get 3 apples and 17 pears", "17"),
    ("no numbers here", None),
])
def test_math_extraction(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize("sample,reference,want", [
    ("<answer>1,000</answer>", "1000", 1.0),
    ("<answer>1000.0</answer>", "1000", 1.0),
    ("<answer>0.75</answer>", "3/4", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("<answer>$42.</answer>", "42", 1.0),
    ("<answer>x = -7</answer>", "-7", 1.0),
    ("<answer>41</answer>", "42", 0.0),
    ("the answer is 42", "Natalia sold 48/2 = 24 clips.\n#### 42", 1.0),  # GSM8K-style reference
    ("<answer>x + 1</answer>", "x+1", 1.0),  # non-numeric: normalised text
    ("<answer>x + 2</answer>", "x+1", 0.0),
    ("", "5", 0.0),
])
def test_math_answer_grader(sample, reference, want):
    g = build_grader({"type": "math_answer", "name": "answer", "reference": "{{item.answer}}"})
    assert g(sample, {"answer": reference}) == (want, {"answer": want})


def test_math_answer_tag_mode_ignores_untagged_numbers():
    g = build_grader({"type": "math_answer", "reference": "{{item.answer}}", "extract": "answer_tag"})
    assert g("it is 5", {"answer": "5"})[0] == 0.0 and g("<answer>5</answer>", {"answer": "5"})[0] == 1.0


def test_format_grader():
    tags = r"<think>.+</think>\s*<answer>.+</answer>"
    full = build_grader({"type": "format", "name": "fmt", "pattern": tags, "weight": 0.5})
    assert full("<think>a\nb</think>\n<answer>1</answer>", {}) == (0.5, {"fmt": 0.5})  # DOTALL
    assert full("<think>a</think><answer>1</answer> trailing", {})[0] == 0.0  # fullmatch by default
    search = build_grader({"type": "format", "pattern": r"<answer>\d+</answer>", "match": "search"})
    assert search("x <answer>3</answer> y", {})[0] == 1.0 and search("<answer>z</answer>", {})[0] == 0.0
    with pytest.raises(ValueError, match="grader.pattern is not a valid regular expression"):
        build_grader({"type": "format", "pattern": "(unclosed"})


MULTI = {
    "type": "multi", "name": "reward",
    "graders": {
        "format": {"type": "format", "pattern": r"<answer>.+?</answer>", "match": "search"},
        "answer": {"type": "math_answer", "reference": "{{item.answer}}", "extract": "answer_tag"},
    },
    "calculate_output": "0.2 * format + 2 * answer",
}


def test_multi_combines_named_parts():
    g = build_grader(MULTI)
    assert g("<answer>7</answer>", {"answer": "7"}) == (pytest.approx(2.2), {"format": 1.0, "answer": 1.0})
    assert g("<answer>8</answer>", {"answer": "7"}) == (pytest.approx(0.2), {"format": 1.0, "answer": 0.0})
    assert g("7", {"answer": "7"}) == (0.0, {"format": 0.0, "answer": 0.0})
    assert g.item_fields == {"answer"}


@pytest.mark.parametrize("expr,value", [
    ("min(format, answer) + max(0.5, answer)", 0.5),
    ("-(format - 3) / 2", 1.0),
    ("format / answer", 0.0),  # x / 0 is 0
    ("(format + answer) * 2 - +1", 1.0),
])
def test_multi_expression_arithmetic(expr, value):
    g = build_grader({**MULTI, "calculate_output": expr})
    assert g("<answer>8</answer>", {"answer": "7"})[0] == pytest.approx(value)  # format 1, answer 0


@pytest.mark.parametrize("expr,needle", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("format.__class__", "Attribute is not allowed"),
    ("format ** 2", "BinOp is not allowed"),
    ("format if answer else 1", "IfExp is not allowed"),
    ("format > 1", "Compare is not allowed"),
    ("(lambda: 1)()", "Call is not allowed"),
    ("'a' + format", "constant 'a' is not a number"),
    ("True + format", "constant True is not a number"),
    ("format + bogus", "unknown name 'bogus'; the graders are answer, format"),
    ("max(*[format])", "not allowed"),
    ("max(format, key=answer)", "Call is not allowed"),
    ("format +", "not a valid expression"),
    ("(" * 200 + "format" + ")" * 200, ""),  # deep but legal nesting parses fine
])
def test_multi_expression_is_safe(expr, needle):
    cfg = {**MULTI, "calculate_output": expr}
    if not needle:
        assert build_grader(cfg)("<answer>1</answer>", {"answer": "1"})[0] == 1.0
        return
    with pytest.raises(ValueError) as err:
        build_grader(cfg)
    assert "grader.calculate_output" in str(err.value) and needle in str(err.value)


def test_nested_multi_reports_nested_parts():
    g = build_grader({"type": "multi", "graders": {"inner": MULTI, "fmt": MULTI["graders"]["format"]},
                      "calculate_output": "inner + fmt"})
    score, parts = g("<answer>7</answer>", {"answer": "7"})
    assert score == pytest.approx(3.2)
    assert parts == {"inner": pytest.approx(2.2), "inner.format": 1.0, "inner.answer": 1.0, "fmt": 1.0}


@pytest.mark.parametrize("cfg,needle", [
    ({"type": "score_model"}, "grader.model is required"),
    ({"type": "embedding_model"}, "grader.type must be one of"),
    ("string_check", "grader must be an object"),
    ({"type": "string_check", "input": S, "reference": "x"}, "grader.operation is required"),
    ({"type": "string_check", "input": S, "reference": "x", "operation": "regex"}, "grader.operation must be one of eq, ne, like, ilike"),
    ({"type": "format", "pattern": "x", "colour": 1}, "grader.colour is not a field of a format grader"),
    ({"type": "format", "pattern": "x", "weight": "1"}, "grader.weight must be a number"),
    ({"type": "multi", "graders": {}, "calculate_output": "1"}, "grader.graders must be an object"),
    ({"type": "multi", "graders": {"a-b": {"type": "format", "pattern": "x"}}, "calculate_output": "1"}, "must be an identifier"),
    ({"type": "multi", "graders": {"a": {"type": "format"}}, "calculate_output": "a"}, "grader.graders.a.pattern is required"),
    ({"type": "reasoning_gym", "task": "no_such_task"}, "grader.task: unknown reasoning-gym task 'no_such_task'"),
])
def test_build_grader_errors_name_the_field(cfg, needle):
    with pytest.raises(ValueError) as err:
        build_grader(cfg)
    assert needle in str(err.value)


def test_reasoning_gym_grader_uses_the_task_scorer():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("products", size=5, seed=int(random.random() * 1e6), min_digits=1, max_digits=2)
    g = build_grader({"type": "reasoning_gym", "name": "task"})
    for entry in ds:
        item = dict(entry, task="products")
        assert g(f"work.\n<answer>{entry['answer']}</answer>", item) == (1.0, {"task": 1.0})
        assert g(f"{entry['answer']}", item)[0] == 0.0  # no tags: no answer
        wrong = str(int(entry["answer"]) + 1)
        assert g(f"<answer>{wrong}</answer>", item)[0] == ds.score_answer(wrong, entry)
        no_task = {k: v for k, v in item.items() if k != "task"}  # falls back to metadata.source_dataset
        assert g(f"<answer>{entry['answer']}</answer>", no_task)[0] == 1.0
    explicit = build_grader({"type": "reasoning_gym", "task": "products"})
    assert explicit("<answer>6</answer>", {"answer": "6"})[0] == 1.0
    with pytest.raises(ValueError, match="names no task"):
        g("<answer>6</answer>", {"answer": "6"})
    with pytest.raises(ValueError, match="no \"answer\" field"):
        g("<answer>6</answer>", {"task": "products"})


def test_rewards_and_upload_validation_do_not_import_torch():
    code = ("import sys, engine.rewards, engine.data.jsonl, engine.data; "
            "engine.rewards.build_grader({'type': 'string_check', 'input': 'a', 'reference': 'b', 'operation': 'eq'}); "
            "engine.rewards.build_grader({'type': 'text_similarity', 'input': 'a', 'reference': 'b', "
            "'evaluation_metric': 'rouge_l'}); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert not {'nltk', 'rouge_score'} & set(sys.modules), 'similarity libraries imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
