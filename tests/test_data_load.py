"""Upload validation with line numbers, prompt building, reasoning-gym tasks and the eval split."""
from __future__ import annotations

import json
import random

import pytest

from engine.data import Example, load_examples, split_eval
from engine.data.builtin import check_dataset
from engine.data.demo import DEMO_SPEC
from engine.data.jsonl import MAX_FIELD_NAMES, field_counts, missing_item_fields, validate_jsonl
from engine.data.prompts import SYSTEM_PROMPT, count_prompts, training_framing
from engine.rewards import build_grader
from engine.spec import DataSpec, TrainSpec
from engine.types import TrainError

PRODUCTS = {"source": "reasoning_gym", "task": "products", "size": 60,
            "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}


def _jsonl(*rows) -> bytes:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode() + b"\n"


def test_valid_file_counts_rows():
    data = _jsonl({"prompt": "2+2?", "answer": "4"}, "",
                  {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]})
    assert validate_jsonl(data) == (2, [])
    assert validate_jsonl(b"\xef\xbb\xbf" + data) == (2, [])  # a byte-order mark is fine


@pytest.mark.parametrize("line,needle", [
    (b"\xff\xfe{}", "not valid UTF-8"),
    (b'{"prompt": "x",}', "invalid JSON"),
    (b"[1, 2]", "expected a JSON object, got an array"),
    (b'"text"', "expected a JSON object, got a string"),
    (b'{"answer": "4"}', "missing 'prompt' or 'messages'"),
    (b'{"prompt": "", "answer": "4"}', "'prompt' must be a non-empty string"),
    (b'{"prompt": "a", "messages": []}', "either 'prompt' or 'messages'"),
    (b'{"messages": "hi"}', "'messages' must be a non-empty list"),
    (b'{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role must be one of"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content must be a string"),
    (b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
     'the last message must have role "user"'),
    (b'{"prompt": "x", "a": ' + b"[" * 40 + b"]" * 40 + b"}", "nesting deeper than 32"),
    (b'{"prompt": "x", "a": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nesting deeper than"),
])
def test_each_problem_is_reported_with_its_line_number(line, needle):
    data = _jsonl({"prompt": "ok"}, {"prompt": "ok too"}) + line + b"\n" + _jsonl({"prompt": "fine"})
    rows, errors = validate_jsonl(data)
    assert rows == 3
    assert len(errors) == 1 and errors[0].startswith("line 3: ") and needle in errors[0], errors


def test_long_lines_empty_files_and_error_cap():
    rows, errors = validate_jsonl(_jsonl({"prompt": "x" * 300}, {"prompt": "y"}), max_line_bytes=100)
    assert rows == 1 and errors == ["line 1: longer than 100 bytes; shorten the row"]
    assert validate_jsonl(b"")[1][0].startswith("the file is empty")
    assert validate_jsonl(b"\n  \n")[1][0].startswith("the file is empty")
    rows, errors = validate_jsonl(b"nope\n" * 30, max_errors=5)
    assert rows == 0 and len(errors) == 6 and errors[4].startswith("line 5: ") and errors[5] == "... and 25 more invalid lines"


def test_field_counts_and_what_a_grader_misses():
    """Top-level fields counted over random rows against a direct count; a grader's item fields
    missing from some rows are named with their counts, the first line without them and the fields
    the rows have; rows of free-form keys are not counted."""
    rng = random.Random()
    names = ["prompt", "answer", "answr", "level", "meta"]
    rows = [{n: i for n in names if rng.random() < 0.6} for i in range(rng.randint(5, 40))]
    counts = field_counts(rows)
    assert counts == {n: sum(n in r for r in rows) for n in names if any(n in r for r in rows)}
    assert field_counts([{f"k{i}": 1} for i in range(MAX_FIELD_NAMES + 1)]) is None
    assert field_counts([{f"k{i}": 1} for i in range(MAX_FIELD_NAMES)]) is not None

    counts = {"prompt": 5, "answr": 2, "answer": 3, "level": 5}
    assert missing_item_fields({"answer", "level"} - {"answer"}, counts, 5, "f") is None
    assert missing_item_fields(set(), counts, 5, "f") is None
    text = missing_item_fields({"level", "answer", "why"}, counts, 5, "training_file f", {"answer": 2})
    assert text == ("training_file f: the grader reads fields every row must have: item.answer is in 3 of 5 rows "
                    "(the first without it: line 2), item.why is in 0 of 5 rows; the rows' fields are answer, "
                    "answr, level, prompt. Add 'answer', 'why' to every row, or change what the grader reads")
    many = {f"f{i:02d}": 1 for i in range(25)}
    assert "f19, ... (25 in all). Add 'x'" in missing_item_fields({"x"}, many, 1, "w")


def test_prompt_rows_get_format_instruction_and_one_shot(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]
    rows.append({"messages": [{"role": "developer", "content": "Be terse."},
                              {"role": "user", "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}]}],
                 "answer": "Paris"})
    path.write_bytes(_jsonl(*rows))
    train, evals = load_examples(DataSpec(train_file=str(path), eval_size=2), seed=3)
    assert len(train) == 9 and len(evals) == 2
    by_answer = {ex.item["answer"]: ex for ex in train + evals}
    plain = by_answer["4"]
    assert plain.messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert [m["role"] for m in plain.messages] == ["system", "user", "assistant", "user"]
    assert "<answer>" in plain.messages[2]["content"] and plain.messages[-1]["content"] == "What is 2 + 2?"
    assert plain.item == rows[2]  # the grader sees the whole row
    assert plain.line == 3 and by_answer["Paris"].line == 11  # for "training line 3: ..." messages
    chat = by_answer["Paris"]  # the user's own conversation is kept (developer -> system)
    assert chat.messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Capital of France?"}]
    bare, _ = load_examples(DataSpec(train_file=str(path), eval_size=0, system_prompt="", one_shot=False), seed=3)
    assert all(len(ex.messages) == 1 for ex in bare if "prompt" in ex.item)


def test_the_framing_recorded_for_generate_is_what_training_put_before_a_plain_question(tmp_path):
    """training_framing (the adapter manifest's prompt_framing, which `qerl generate` puts before
    a plain prompt) is the turns each trained prompt row or built-in question came after."""
    for spec in (DataSpec(dataset=PRODUCTS, eval_size=4), DataSpec(dataset=PRODUCTS, eval_size=4, one_shot=False),
                 DataSpec(dataset=PRODUCTS, eval_size=4, system_prompt="Answer in <answer> tags.")):
        train, evals = load_examples(spec, seed=5)
        framing = training_framing(spec, train)
        assert all(ex.messages[:-1] == framing for ex in train + evals)
        assert len(framing) == (3 if spec.one_shot else 1) and framing[0]["role"] == "system"
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(_jsonl({"messages": [{"role": "user", "content": "Hi?"}], "answer": "hi"},
                            {"prompt": "What is 3 + 3?", "answer": "6"}, {"prompt": "What is 4 + 4?", "answer": "8"}))
    spec = DataSpec(train_file=str(rows), eval_size=0)
    train, _ = load_examples(spec, seed=0)
    framing = training_framing(spec, train)
    assert [ex.messages[:-1] for ex in train if "prompt" in ex.item] == [framing, framing]
    chats = tmp_path / "chats.jsonl"  # only conversations of the user's own: nothing was put before them
    chats.write_bytes(_jsonl(*({"messages": [{"role": "user", "content": f"{i}?"}], "answer": str(i)} for i in range(3))))
    for system, want in ((None, []), ("Be terse.", [{"role": "system", "content": "Be terse."}])):
        spec = DataSpec(train_file=str(chats), eval_size=0, system_prompt=system)
        train, _ = load_examples(spec, seed=0)
        assert training_framing(spec, train) == want == train[0].messages[:-1]


def test_bad_files_raise_train_errors_with_line_numbers(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(_jsonl({"prompt": "a"}, {"answer": 1}))
    with pytest.raises(TrainError, match=r"data.train_file: line 2: missing 'prompt' or 'messages'") as err:
        load_examples(DataSpec(train_file=str(path), eval_size=0), seed=0)
    assert err.value.code == "invalid_dataset"
    with pytest.raises(TrainError, match="cannot read"):
        load_examples(DataSpec(train_file=str(tmp_path / "missing.jsonl")), seed=0)


def test_validation_file_is_the_eval_set(tmp_path):
    (tmp_path / "t.jsonl").write_bytes(_jsonl(*[{"prompt": f"t{i}"} for i in range(5)]))
    (tmp_path / "v.jsonl").write_bytes(_jsonl(*[{"prompt": f"v{i}"} for i in range(8)]))
    spec = DataSpec(train_file=str(tmp_path / "t.jsonl"), validation_file=str(tmp_path / "v.jsonl"), eval_size=3)
    train, evals = load_examples(spec, seed=1)
    assert sorted(ex.item["prompt"] for ex in train) == [f"t{i}" for i in range(5)]
    assert len(evals) == 3 and all(ex.item["prompt"].startswith("v") for ex in evals)


def test_reasoning_gym_is_deterministic_and_eval_is_disjoint():
    seed = random.randrange(10**6)
    spec = DataSpec(dataset=dict(PRODUCTS), eval_size=10)
    train, evals = load_examples(spec, seed)
    again, evals_again = load_examples(spec, seed)
    assert [ex.messages for ex in train] == [ex.messages for ex in again]
    assert [ex.item for ex in evals] == [ex.item for ex in evals_again]
    other, _ = load_examples(spec, seed + 1)
    assert [ex.item["question"] for ex in other] != [ex.item["question"] for ex in train]
    questions = {ex.item["question"] for ex in train}
    assert len(evals) == 10 and not questions & {ex.item["question"] for ex in evals}
    assert len({ex.item["question"] for ex in evals}) == 10
    assert len(train) + 10 <= 60
    ex = train[0]
    assert ex.item["task"] == "products" and {"question", "answer", "metadata"} <= set(ex.item)
    assert ex.line is None
    # one-shot: a worked step then the tagged answer, from a question outside the data
    shot_user, shot_reply = ex.messages[1]["content"], ex.messages[2]["content"]
    assert shot_user not in questions and " = " in shot_reply and shot_reply.endswith("</answer>")
    grader = build_grader({"type": "reasoning_gym"})
    assert grader(ex.messages[2]["content"], {"answer": shot_reply.split("<answer>")[1][:-9], "task": "products"})[0] == 1.0


def test_fixed_dataset_seed_keeps_the_items_and_job_seed_moves_the_split():
    spec = DataSpec(dataset={**PRODUCTS, "seed": 5}, eval_size=4)
    (a, a_eval), (b, b_eval) = load_examples(spec, 0), load_examples(spec, 1)
    questions = lambda exs: {ex.item["question"] for ex in exs}  # noqa: E731
    assert questions(a) | questions(a_eval) == questions(b) | questions(b_eval)
    assert questions(a_eval) != questions(b_eval)


@pytest.mark.parametrize("dataset,needle", [
    ({"source": "reasoning_gym", "task": "no_such_task"}, "not a reasoning-gym task"),
    ({"source": "reasoning_gym", "task": "products", "config": {"bogus": 1}}, "data.dataset.config is not valid"),
    ({"source": "reasoning_gym", "task": "products", "config": {"min_digits": 3, "max_digits": 1}}, "data.dataset.config is not valid"),
    ({"source": "reasoning_gym", "task": "products", "config": {"size": 3}}, "set data.dataset.size instead"),
    ({"source": "reasoning_gym", "task": "products", "colour": 3}, "data.dataset.colour is not a field"),
    ({"source": "reasoning_gym", "task": "products", "config": [3]}, "data.dataset.config must be an object"),
])
def test_bad_builtin_datasets_are_train_errors(dataset, needle):
    with pytest.raises(TrainError, match=needle):
        load_examples(DataSpec(dataset=dataset, eval_size=1), seed=0)
    with pytest.raises(TrainError, match=needle):  # what the API checks when the job is created
        check_dataset(dataset)


def test_a_dataset_package_that_cannot_be_imported_is_a_train_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    for call in (lambda: load_examples(DataSpec(dataset=PRODUCTS, eval_size=1), seed=0),
                 lambda: check_dataset(PRODUCTS)):
        with pytest.raises(TrainError, match="reasoning_gym cannot be imported here") as err:
            call()
        assert err.value.code == "dataset_unavailable" and "training_file" in str(err.value)


def test_check_dataset_passes_what_loads():
    check_dataset(PRODUCTS)
    check_dataset({"source": "reasoning_gym", "task": "products", "config": {"min_digits": 2, "max_digits": 3}})


def test_eval_size_that_leaves_no_training_data():
    examples = [Example([{"role": "user", "content": q}], {}) for q in ("a", "b", "a")]
    with pytest.raises(TrainError, match="data.eval_size=2 holds out all 2 distinct prompts"):
        split_eval(examples, 2, seed=0)
    train, evals = split_eval(examples, 1, seed=0)
    assert len(evals) == 1 and all(t.messages != evals[0].messages for t in train)


def test_count_prompts_counts_what_the_split_holds_out(tmp_path):
    """An upload's count of distinct prompts is the number of questions the eval split can hold out,
    whatever the system prompt or one-shot turn the job adds: holding out that many is refused, one
    fewer leaves one question to train on."""
    rows = [{"prompt": f"P{i % 5}", "answer": "x"} for i in range(12)]
    rows += [{"messages": [{"role": "system", "content": f"s{i}"}, {"role": "user", "content": f"M{i % 3}"}]}
             for i in range(9)]
    rows += [{"messages": [{"role": "user", "content": [{"type": "text", "text": "M"}, {"type": "text", "text": "1"}]}]},
             {"messages": [{"role": "user", "content": "P1"}]}]  # the same question as M1 and as P1
    random.Random(0).shuffle(rows)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert count_prompts(rows) == 8
    for spec in (DataSpec(train_file=str(tmp_path / "t.jsonl"), eval_size=7),
                 DataSpec(train_file=str(tmp_path / "t.jsonl"), eval_size=7, one_shot=False, system_prompt="S")):
        train, evals = load_examples(spec, seed=1)
        assert len(evals) == 7 and len({ex.messages[-1]["content"] for ex in train}) == 1
    with pytest.raises(TrainError, match="holds out all 8 distinct prompts"):
        load_examples(DataSpec(train_file=str(tmp_path / "t.jsonl"), eval_size=8), seed=1)


def test_demo_spec_is_a_valid_job_with_both_splits():
    spec = TrainSpec.from_dict(DEMO_SPEC)
    grader = build_grader(spec.grader)
    train, evals = load_examples(spec.data, spec.seed)
    assert len(evals) == 20 and len(train) >= 200
    assert not {e.item["question"] for e in train} & {e.item["question"] for e in evals}
    item = train[0].item
    assert grader(f"{item['metadata']['expression']} = {item['answer']}.\n<answer>{item['answer']}</answer>", item) == (
        pytest.approx(1.2), {"format": 1.0, "answer": 1.0})
