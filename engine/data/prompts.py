"""Chat prompts: a format instruction, an optional one-shot worked example, the question.

Small instruct models rarely use <answer> tags from an instruction alone; one prior
user/assistant turn that shows a short worked step and then the tagged answer makes the
format (and so the reward) reachable for SmolLM2-135M. The worked step is the task's own
expression when the entry has one ("6 * 7 = 42."), else a short generic line.
"""
from __future__ import annotations

from typing import Any, Iterable

from engine.data.jsonl import message_text

SYSTEM_PROMPT = "Solve the problem. Think briefly, then write only the final answer inside <answer> and </answer> tags."
GENERIC_SHOT = {"question": "What is 7 * 8?", "answer": "56", "metadata": {"expression": "7 * 8"}}

Message = dict[str, str]


def worked_answer(entry: dict[str, Any]) -> str:
    """The assistant turn of a one-shot example: a short worked step, then the tagged answer."""
    answer = str(entry["answer"])
    expression = (entry.get("metadata") or {}).get("expression")
    step = f"{expression} = {answer}." if isinstance(expression, str) and expression else "Let me work it out briefly."
    return f"{step}\n<answer>{answer}</answer>"


def build_messages(question: str, *, system_prompt: str | None, shot: dict[str, Any] | None) -> list[Message]:
    """[system] + [shot user, shot assistant] + [user question]; ``system_prompt`` "" drops the system turn."""
    system = SYSTEM_PROMPT if system_prompt is None else system_prompt
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    if shot is not None:
        messages += [{"role": "user", "content": str(shot["question"])},
                     {"role": "assistant", "content": worked_answer(shot)}]
    messages.append({"role": "user", "content": question})
    return messages


def row_messages(row: dict[str, Any], *, system_prompt: str | None, one_shot: bool) -> list[Message]:
    """Messages for a JSONL row. A ``prompt`` row gets the format instruction (and the generic
    one-shot turn); a ``messages`` row is the user's own conversation and is kept, except that
    an explicit ``system_prompt`` is prepended when it has no system turn."""
    if "prompt" in row:
        return build_messages(row["prompt"], system_prompt=system_prompt, shot=GENERIC_SHOT if one_shot else None)
    messages = [{"role": "system" if m["role"] == "developer" else m["role"], "content": message_text(m["content"])}
                for m in row["messages"]]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def prompt_key(row: dict[str, Any]) -> str:
    """What makes two JSONL rows the same question: their final user turn (the eval split holds
    out distinct questions, so that none of them is also trained on)."""
    return row["prompt"] if "prompt" in row else message_text(row["messages"][-1]["content"])


def count_prompts(rows: Iterable[dict[str, Any]]) -> int:
    """How many distinct questions the rows hold (``prompt_key``)."""
    return len({prompt_key(r) for r in rows})


def training_framing(spec: Any, train: list[Any]) -> list[Message]:
    """The turns training put before a plain question (a built-in task's question, a JSONL row's
    ``prompt``): the format instruction and the worked example, as the adapter learned to answer
    after them. Recorded in the adapter's manifest (``prompt_framing``) so that ``qerl generate``
    asks a plain prompt the way training did. Rows of ``messages`` got nothing of the kind but an
    explicit ``data.system_prompt``, so a file of only such rows gives at most that."""
    if spec.dataset is not None and train:
        return [dict(m) for m in train[0].messages[:-1]]
    if any("prompt" in ex.item for ex in train):
        return build_messages("", system_prompt=spec.system_prompt, shot=GENERIC_SHOT if spec.one_shot else None)[:-1]
    return [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
