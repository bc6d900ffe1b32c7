"""Model graders against a real judge: vLLM's OpenAI-compatible server (the CPU build in
.venv-vllm) serving SmolLM2-135M-Instruct. The score_model and label_model requests (messages,
JSON-schema ``response_format``, sampling parameters) are accepted as sent, the server's
structured output holds to the schema, and the graders read back what it answered."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests._vllm_env import needs_vllm, run_in_vllm_env

pytestmark = pytest.mark.timeout(900)
PROMPT = [{"role": "system", "content": "You are a strict grader. Compare the answer with the reference."},
          {"role": "user", "content": "Question: {{item.question}}\nReference answer: {{item.answer}}\n"
                                      "Student answer: {{sample.output_text}}"}]
ITEMS = [{"question": "What is 12 + 7?", "answer": "19"}, {"question": "What is the capital of France?",
                                                            "answer": "Paris"}]
SAMPLES = ["19", "The capital of France is Paris."]


def test_in_vllm_env() -> None:
    run_in_vllm_env(__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory):
    from engine.model.load import resolve_model_dir

    port, log = _free_port(), tmp_path_factory.mktemp("vllm-judge") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(resolve_model_dir("smollm2-135m-instruct")), "--served-model-name", "judge", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", "4", "--dtype", "bfloat16",
           "--enforce-eager"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm's server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm's server did not come up in 600 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield f"{url}/v1", log
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@needs_vllm
def test_score_and_label_model_graders_against_vllm_serve(vllm_server, monkeypatch) -> None:
    from engine.rewards import build_grader

    url, log = vllm_server
    monkeypatch.setenv("QERL_GRADER_BASE_URL", url)
    monkeypatch.delenv("QERL_GRADER_API_KEY", raising=False)
    monkeypatch.setenv("QERL_GRADER_CONCURRENCY", "1")  # in order, so the replies line up with the samples
    score = build_grader({"type": "score_model", "name": "judge", "model": "judge", "input": PROMPT, "range": [0, 10],
                          "sampling_params": {"temperature": 0.0, "seed": 0, "max_completions_tokens": 24}})
    label = build_grader({"type": "label_model", "name": "verdict", "model": "judge", "input": PROMPT,
                          "labels": ["correct", "incorrect"], "passing_labels": ["correct"],
                          "sampling_params": {"temperature": 0.0, "max_completions_tokens": 24}})
    for grader, key, check in ((score, "result", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
                               (label, "label", lambda v: v in ("correct", "incorrect"))):
        seen: list[dict] = []
        ask = grader.judge.ask
        grader.judge.ask = lambda body: seen.append(ask(body)) or seen[-1]  # the server's replies, in order
        got = grader.batch(SAMPLES, ITEMS)
        # the server answered JSON that holds to the schema, and that is what the grader read
        values = [json.loads(m["content"])[key] for m in seen]
        assert len(values) == len(SAMPLES) and all(check(v) for v in values), (values, log.read_text()[-2000:])
        if grader is score:
            assert [s for s, _ in got] == [min(10.0, max(0.0, float(v))) for v in values]
        else:
            assert [s for s, _ in got] == [1.0 if v == "correct" else 0.0 for v in values]
        assert all(parts == {grader.name: s} for s, parts in got)
