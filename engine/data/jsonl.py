"""Upload checks for JSONL training files, with line numbers. Pure Python (the service uses it).

One JSON object per line: ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}, ...]}``
(the last message from the user), plus any fields the grader reads (``{{item.answer}}``).
Blank lines are skipped; a UTF-8 byte-order mark at the start is ignored.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

ROLES = ("system", "developer", "user", "assistant")
MAX_LINE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_FIELD_NAMES = 256  # distinct top-level fields counted per file; past it, none are kept


def validate_jsonl(data: bytes, *, max_errors: int = 20, max_line_bytes: int = MAX_LINE_BYTES,
                   max_depth: int = MAX_DEPTH) -> tuple[int, list[str]]:
    """Return (number of valid rows, up to ``max_errors`` messages like "line 3: ...")."""
    rows, errors = parse_jsonl(data, max_errors=max_errors, max_line_bytes=max_line_bytes, max_depth=max_depth)
    return len(rows), errors


def parse_jsonl(data: bytes, *, max_errors: int = 20, max_line_bytes: int = MAX_LINE_BYTES,
                max_depth: int = MAX_DEPTH) -> tuple[list[dict[str, Any]], list[str]]:
    """Return (valid rows, errors). Every line is checked; only the first ``max_errors`` errors are kept."""
    numbered, errors = parse_jsonl_lines(data, max_errors=max_errors, max_line_bytes=max_line_bytes,
                                         max_depth=max_depth)
    return [row for _, row in numbered], errors


def parse_jsonl_lines(data: bytes, *, max_errors: int = 20, max_line_bytes: int = MAX_LINE_BYTES,
                      max_depth: int = MAX_DEPTH) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """Like ``parse_jsonl``, with each valid row's 1-based line number."""
    rows: list[tuple[int, dict[str, Any]]] = []
    errors: list[str] = []
    extra = 0
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        problem, row = _check_line(raw, max_line_bytes, max_depth)
        if problem is None and row is not None:
            rows.append((number, row))
        elif problem is not None:
            if len(errors) < max_errors:
                errors.append(f"line {number}: {problem}")
            else:
                extra += 1
    if extra:
        errors.append(f"... and {extra} more invalid lines")
    if not rows and not errors:
        errors.append("the file is empty: upload one JSON object per line, e.g. {\"prompt\": \"...\", \"answer\": \"...\"}")
    return rows, errors


def field_counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int] | None:
    """How many rows have each top-level field (what ``{{item.<field>}}`` reads), or None for rows
    of more than MAX_FIELD_NAMES distinct fields (free-form keys: nothing to check them by)."""
    counts: dict[str, int] = {}
    for row in rows:
        for name in row:
            counts[name] = counts.get(name, 0) + 1
        if len(counts) > MAX_FIELD_NAMES:
            return None
    return counts


def missing_item_fields(needed: Iterable[str], counts: Mapping[str, int], rows: int, where: str,
                        first_line: Mapping[str, int] | None = None) -> str | None:
    """Why ``rows`` rows with these field counts cannot serve a grader that reads the item fields
    ``needed`` (it would fail at its first such row, mid-training), or None when every row has them.
    ``first_line`` names, per field, the first line without it."""
    short = sorted(name for name in needed if counts.get(name, 0) < rows)
    if not short:
        return None
    first_line = first_line or {}
    lacking = ", ".join(f"item.{name} is in {counts.get(name, 0)} of {rows} rows"
                        + (f" (the first without it: line {first_line[name]})" if name in first_line else "")
                        for name in short)
    names = sorted(counts)
    have = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    return (f"{where}: the grader reads fields every row must have: {lacking}; the rows' fields are {have}. "
            f"Add {', '.join(repr(n) for n in short)} to every row, or change what the grader reads")


def _check_line(raw: bytes, max_line_bytes: int, max_depth: int) -> tuple[str | None, dict | None]:
    if len(raw) > max_line_bytes:
        return f"longer than {max_line_bytes} bytes; shorten the row", None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not valid UTF-8 (byte {exc.start}); save the file as UTF-8", None
    if not text.strip():
        return None, None
    try:
        row = json.loads(text)
    except RecursionError:
        return f"nesting deeper than {max_depth} levels", None
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at column {exc.colno})", None
    if not isinstance(row, dict):
        return f"expected a JSON object, got {_kind(row)}", None
    if json_depth(row) > max_depth:
        return f"nesting deeper than {max_depth} levels", None
    return row_problem(row), row


def row_problem(row: dict[str, Any]) -> str | None:
    """Why a row cannot serve as a prompt, or None."""
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if not has_prompt and not has_messages:
        return "missing 'prompt' or 'messages'"
    if has_prompt and has_messages:
        return "give either 'prompt' or 'messages', not both"
    if has_prompt:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            return "'prompt' must be a non-empty string"
        return None
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {\"role\", \"content\"} objects"
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return f"messages[{i}] must be an object with \"role\" and \"content\""
        if msg.get("role") not in ROLES:
            return f"messages[{i}].role must be one of {', '.join(ROLES)}; got {msg.get('role')!r}"
        if message_text(msg.get("content")) is None:
            return f"messages[{i}].content must be a string (or a list of {{\"type\": \"text\", \"text\"}} parts)"
    if messages[-1]["role"] != "user":
        return "the last message must have role \"user\" (the model writes the reply)"
    return None


def message_text(content: Any) -> str | None:
    """A message's text: a string, or OpenAI text parts joined; None when it has another shape."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value, without recursion."""
    depth, frontier = 0, [value]
    while frontier:
        depth += 1
        frontier = [c for v in frontier if isinstance(v, (dict, list))
                    for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
    return depth


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
