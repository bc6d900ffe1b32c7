"""A judge for the model-grader tests: an OpenAI-compatible ``/v1/chat/completions`` HTTP server
on a free local port that grades by a rule the tests can check.

The graders under test render their ``input`` templates into messages; the tests' templates put
``reference: <answer>`` and ``sample: <completion>`` on lines of the last message, and the judge
answers as a model told to grade would: ``{"result": 10 | 5 | 0}`` (the sample equals, contains or
lacks the reference) for a ``score`` schema, ``{"label": "correct" | "incorrect"}`` for a
``label`` schema. ``behaviour`` makes it fail in the ways a real endpoint does."""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KEY = "sk-judge-test"


@dataclass
class Judge:
    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    behaviour: str = "grade"  # grade | prose | refuse | garbage | down | not_found
    fail_first: int = 0  # answer 503 to this many requests first
    down_after: int | None = None  # answer 503 to every request after this many
    delay_s: float = 0.0
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def verdict(self, body: dict[str, Any]) -> tuple[str, float, str]:
        text = body["messages"][-1]["content"]
        ref = re.search(r"^reference: (.*)$", text, re.M).group(1).strip()
        sample = re.search(r"^sample: (.*)$", text, re.M).group(1).strip()
        if sample == ref:
            return "correct", 10.0, "exact"
        return ("correct", 5.0, "contains") if ref and ref in sample else ("incorrect", 0.0, "lacks")


def _handler(judge: Judge) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode() if not isinstance(payload, bytes) else payload
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with judge.lock:
                judge.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                n = len(judge.requests)
                judge.in_flight += 1
                judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
            try:
                time.sleep(judge.delay_s)
                self._answer(body, n)
            finally:
                with judge.lock:
                    judge.in_flight -= 1

        def _answer(self, body: dict[str, Any], n: int) -> None:
            if self.path != "/v1/chat/completions" or judge.behaviour == "not_found":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                return self._send(401, {"error": {"message": "bad key"}})
            if n <= judge.fail_first or judge.behaviour == "down" or (judge.down_after is not None
                                                                      and n > judge.down_after):
                return self._send(503, {"error": {"message": "overloaded"}})
            message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
            label, score, why = judge.verdict(body)
            schema = body.get("response_format", {}).get("json_schema", {}).get("name")
            if judge.behaviour == "refuse":
                message["refusal"] = "I can't grade this."
            elif judge.behaviour == "garbage":
                message["content"] = "Hard to say."
            elif judge.behaviour == "prose":
                message["content"] = (f"The sample {why} the reference, so it is {label}. Out of 10: {score:g}"
                                      if schema == "score" else f"My verdict: {label}.")
            else:
                message["content"] = json.dumps({"result": score} if schema == "score" else {"label": label})
            prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])  # words stand for tokens
            self._send(200, {"id": f"chatcmpl-{n}", "object": "chat.completion", "model": body["model"],
                             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                                       "total_tokens": prompt_tokens + 5}})

    return Handler


def start_judge() -> tuple[Judge, ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), None)  # type: ignore[arg-type]
    judge = Judge(url=f"http://127.0.0.1:{server.server_address[1]}/v1")
    server.RequestHandlerClass = _handler(judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return judge, server
