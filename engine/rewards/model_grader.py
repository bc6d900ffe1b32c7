"""OpenAI's model graders, ``score_model`` and ``label_model``, asked of a judge the server names.

The judge is any OpenAI-compatible chat-completions endpoint the operator sets with
``QERL_GRADER_BASE_URL`` (its ``/v1`` root: a local vLLM or llama.cpp server, or OpenAI's own) and
``QERL_GRADER_API_KEY``; a grader's ``model`` is the model name sent to it. The grader's ``input``
messages are templates (``{{sample.output_text}}``, ``{{item.<field>}}``) rendered per sample.
The reply is asked for as JSON by a schema (``response_format``), ``{"result": number}`` for a
score and ``{"label": one of labels}`` for a label; a judge that answers in prose is read for its
last number or its first label. score_model's reward is the number, clipped to ``range``;
label_model's is 1.0 for a label in ``passing_labels``, else 0.0.

Requests run ``QERL_GRADER_CONCURRENCY`` (8) at a time over a step's samples, each given
``QERL_GRADER_TIMEOUT_SECONDS`` (60) and retried on connection errors, 408, 429 and 5xx with
back-off (1, 2, 4 s). A judge that still fails raises ModelGraderError of kind "server": the
training loop then saves a checkpoint and stops (GraderUnavailable; the service pauses the job);
one that refuses or answers nothing readable fails the job ``grader_error`` with the reason.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from engine.rewards.base import Grader, check_fields, get_number, get_str, grader_name
from engine.rewards.multi import leaves
from engine.rewards.python_grader import GraderError
from engine.rewards.templates import Template

ROLES = ("system", "developer", "user", "assistant")
SAMPLING = ("temperature", "top_p", "seed", "max_completions_tokens", "reasoning_effort")
RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504)
BACKOFF_S = (1.0, 2.0, 4.0)
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class ModelGraderError(GraderError):
    """The judge failed (``kind``: server), refused (refusal) or gave nothing readable (parse)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Judge:
    """The operator's endpoint, from the environment; ValueError naming the setting when unset."""

    def __init__(self, path: str) -> None:
        base = os.environ.get("QERL_GRADER_BASE_URL", "").strip().rstrip("/")
        if not base:
            raise ValueError(f"{path}.type: model graders need a judge endpoint, and this server has none: its "
                             "operator sets QERL_GRADER_BASE_URL (an OpenAI-compatible /v1 URL, e.g. a vLLM server) "
                             "and QERL_GRADER_API_KEY for the API and the workers; or use a string_check, "
                             "text_similarity, math_answer or python grader")
        self.url = f"{base}/chat/completions"
        self.key = os.environ.get("QERL_GRADER_API_KEY", "")
        self.timeout_s = _setting("QERL_GRADER_TIMEOUT_SECONDS", 60.0, float, path)
        self.concurrency = int(_setting("QERL_GRADER_CONCURRENCY", 8, int, path))
        self._lock = threading.Lock()
        self._http: Any = None
        self.tokens = 0  # prompt + completion tokens the judge reported using (its replies' usage)

    def _client(self) -> Any:
        """One connection pool for the grader's life (httpx's client is safe across threads)."""
        import httpx

        with self._lock:
            if self._http is None:
                headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
                self._http = httpx.Client(headers=headers, timeout=self.timeout_s)
            return self._http

    def ask(self, body: dict[str, Any]) -> dict[str, Any]:
        """The judge's reply message, retried on transient failures."""
        import httpx

        for attempt in range(len(BACKOFF_S) + 1):
            try:
                resp = self._client().post(self.url, json=body)
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    message, used = _reply(resp)
                    with self._lock:
                        self.tokens += used
                    return message
                problem = f"HTTP {resp.status_code}: {resp.text[:300]}"
                if resp.status_code not in RETRY_STATUS:
                    break
            if attempt < len(BACKOFF_S):
                time.sleep(BACKOFF_S[attempt])
        raise ModelGraderError("server", f"the judge at {self.url} (model {body['model']!r}) failed: {problem}")


def judge_tokens(grader: Grader) -> int:
    """Tokens the judges of ``grader`` (a model grader, or those inside a multi grader) have used so far."""
    return sum(g.judge.tokens for g in leaves(grader) if isinstance(g, _ModelGrader))


def judge_models(grader: Grader) -> list[str]:
    """The judge models ``grader`` asks (a model grader's, or those inside a multi grader), once each."""
    return list(dict.fromkeys(g.model for g in leaves(grader) if isinstance(g, _ModelGrader)))


def _setting(name: str, default: float, kind: type, path: str) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        value = kind(raw) if raw else default
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{path}.type: the server's {name} must be a number above 0; got {raw!r} (its operator "
                         "sets it for the API and the workers)")
    return value


def _reply(resp: Any) -> tuple[dict[str, Any], int]:
    """The chat completion's message, and the prompt + completion tokens its usage reports."""
    try:
        body = resp.json()
        message = body["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ModelGraderError("server", f"the judge's answer is not a chat completion: {resp.text[:300]}") from None
    if not isinstance(message, dict):
        raise ModelGraderError("server", f"the judge's answer is not a chat completion: {resp.text[:300]}")
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    return message, sum(v for v in (usage.get("prompt_tokens"), usage.get("completion_tokens")) if isinstance(v, int))


class _ModelGrader(Grader):
    def __init__(self, cfg: dict, path: str, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> None:
        check_fields(cfg, path, required=("model", "input", *required), optional=("sampling_params", *optional))
        super().__init__(grader_name(cfg, path))
        self.model = get_str(cfg, "model", path)
        self.messages = _messages(cfg["input"], f"{path}.input")
        self.item_fields = set().union(*(t.item_fields for _, t in self.messages))
        self.sampling = _sampling(cfg.get("sampling_params", {}), f"{path}.sampling_params")

    def request(self, sample_text: str, item: Mapping[str, Any]) -> dict[str, Any]:
        messages = [{"role": role, "content": t.render(sample_text, item)} for role, t in self.messages]
        return {"model": self.model, "messages": messages, "response_format": self.response_format(),
                **self.sampling}

    def response_format(self) -> dict[str, Any]:
        raise NotImplementedError

    def read(self, message: dict[str, Any]) -> float:
        raise NotImplementedError

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        return self.batch([sample_text], [item])[0][0]

    def __call__(self, sample_text: str, item: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        return self.batch([sample_text], [item])[0]

    def batch(self, texts: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[tuple[float, dict[str, float]]]:
        bodies = [self.request(t, i) for t, i in zip(texts, items)]  # a missing item field raises before any call

        def one(body: dict[str, Any]) -> tuple[float, dict[str, float]]:
            message = self.judge.ask(body)
            if message.get("refusal"):
                raise ModelGraderError("refusal", f"the judge (model {self.model!r}) refused to grade: "
                                                  f"{str(message['refusal'])[:300]}")
            s = self.read(message)
            return s, {self.name: s}

        if len(bodies) <= 1:
            return [one(b) for b in bodies]
        with ThreadPoolExecutor(max_workers=min(self.judge.concurrency, len(bodies))) as pool:
            return list(pool.map(one, bodies))


class ScoreModel(_ModelGrader):
    """A number from the judge, clipped to ``range`` ([0, 1] unless given)."""

    type = "score_model"

    def __init__(self, cfg: dict, path: str) -> None:
        super().__init__(cfg, path, optional=("range", "pass_threshold"))
        bounds = cfg.get("range", [0, 1])
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in bounds) and bounds[0] < bounds[1]):
            raise ValueError(f"{path}.range must be [low, high] with low < high, e.g. [0, 1]; got {bounds!r}")
        self.low, self.high = float(bounds[0]), float(bounds[1])
        self.max_score = self.high  # full credit (accuracy)
        self.pass_threshold = get_number(cfg, "pass_threshold", path)
        self.judge = Judge(path)

    def response_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "score", "strict": True, "schema": {
            "type": "object", "properties": {"result": {"type": "number"}}, "required": ["result"],
            "additionalProperties": False}}}

    def read(self, message: dict[str, Any]) -> float:
        text = str(message.get("content") or "")
        value = _json_field(text, "result")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            numbers = _NUMBER.findall(text)
            if not numbers:
                raise ModelGraderError("parse", f"the judge's reply holds no score: {text[:300]!r}")
            value = float(numbers[-1])
        if value != value:
            raise ModelGraderError("parse", f"the judge's score is not a number: {text[:300]!r}")
        return min(self.high, max(self.low, float(value)))


class LabelModel(_ModelGrader):
    """1.0 when the judge's label is one of ``passing_labels``, else 0.0."""

    type = "label_model"

    def __init__(self, cfg: dict, path: str) -> None:
        super().__init__(cfg, path, required=("labels", "passing_labels"))
        self.labels = _labels(cfg["labels"], f"{path}.labels")
        self.passing = _labels(cfg["passing_labels"], f"{path}.passing_labels")
        unknown = [p for p in self.passing if p not in self.labels]
        if unknown:
            raise ValueError(f"{path}.passing_labels: {', '.join(map(repr, unknown))} not among labels "
                             f"{self.labels}; list only labels the judge may give")
        self.judge = Judge(path)

    def response_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "label", "strict": True, "schema": {
            "type": "object", "properties": {"label": {"type": "string", "enum": self.labels}},
            "required": ["label"], "additionalProperties": False}}}

    def read(self, message: dict[str, Any]) -> float:
        text = str(message.get("content") or "")
        label = _json_field(text, "label")
        if label not in self.labels:
            found = sorted((m.start(), lab) for lab in self.labels
                           for m in [re.search(rf"(?<!\w){re.escape(lab)}(?!\w)", text)] if m)
            if not found:
                raise ModelGraderError("parse", f"the judge's reply names none of the labels {self.labels}: "
                                                f"{text[:300]!r}")
            label = found[0][1]
        return 1.0 if label in self.passing else 0.0


def _json_field(text: str, key: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value.get(key) if isinstance(value, dict) else None


def _messages(value: Any, path: str) -> list[tuple[str, Template]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{path} must be a non-empty list of messages, e.g. [{{\"role\": \"user\", \"content\": "
                         "\"Grade {{sample.output_text}} against {{item.answer}}\"}]")
    out = []
    for k, msg in enumerate(value):
        where = f"{path}.{k}"
        if not isinstance(msg, dict) or set(msg) - {"role", "content", "type"}:
            raise ValueError(f"{where} must be an object with role and content (and optionally type: message)")
        role = get_str(msg, "role", where, choices=ROLES)
        if msg.get("type", "message") != "message":
            raise ValueError(f"{where}.type must be \"message\"; got {msg.get('type')!r}")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "text", "output_text") \
                        or not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content.{j} must be a text part, {{\"type\": \"input_text\", "
                                     "\"text\": \"...\"}; images and audio are not supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        out.append((role, Template(content, f"{where}.content")))
    return out


def _sampling(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{path} must be an object with any of {', '.join(SAMPLING)}")
    extra = set(value) - set(SAMPLING)
    if extra:
        raise ValueError(f"{path}.{sorted(extra)[0]} is not a sampling parameter; allowed: {', '.join(SAMPLING)}")
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if key in value:
            out[key] = get_number(value, key, path)
    for key in ("seed", "max_completions_tokens"):
        if key in value:
            v = value[key]
            if isinstance(v, bool) or not isinstance(v, int) or (key == "max_completions_tokens" and v < 1):
                raise ValueError(f"{path}.{key} must be an integer{' >= 1' if key != 'seed' else ''}; got {v!r}")
            out["max_tokens" if key == "max_completions_tokens" else key] = v
    if "reasoning_effort" in value:
        out["reasoning_effort"] = get_str(value, "reasoning_effort", path)
    return out


def _labels(value: Any, path: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value) \
            or len(set(value)) != len(value):
        raise ValueError(f"{path} must be a non-empty list of distinct strings, e.g. [\"correct\", \"incorrect\"]")
    return list(value)
