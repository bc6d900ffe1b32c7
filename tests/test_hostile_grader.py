"""The ``python`` grader runs user code only in a sandboxed child process; each limit is proven
by code that tries to break it: a CPU spin, a memory bomb, a sleep past the wall time, a
connection to a port listening on 127.0.0.1, writes outside the working directory, a fork, and
output floods. Each runs twice where the host allows namespaces: with every layer, and with
the kernel layers alone (the in-process audit hook off), so neither layer hides the other."""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from engine.rewards import build_grader
from engine.rewards.python_grader import GraderError, Limits, PythonGrader, _jail_works, hidden_dirs, sandbox_mode

FAST = dict(cpu_s=1.0, wall_s=2.0, startup_s=3.0, memory_mb=512)
MODES = {
    "all-layers": Limits(**FAST),
    "kernel-only": Limits(**FAST, audit_hook=False),
    "hook-only": Limits(**FAST, namespaces=False),
}


@pytest.fixture(params=list(MODES))
def limits(request: pytest.FixtureRequest) -> Limits:
    lim = MODES[request.param]
    if not lim.audit_hook and not _jail_works():
        pytest.skip("this host does not allow namespaces (unshare -m -n as root); the audit hook is the barrier")
    return lim


def grader(source: str, limits: Limits) -> PythonGrader:
    return PythonGrader({"type": "python", "name": "py", "source": source}, "grader", limits)


def test_a_normal_grader_works_and_batches(limits: Limits) -> None:
    g = grader("import json, math, re\n"
               "def grade(sample, item):\n"
               "    print('debug output goes to stderr, not into the results')\n"
               "    got = re.findall(r'-?\\d+', sample['output_text'])\n"
               "    return 1.0 if got and got[-1] == str(item['answer']) else 0.0\n", limits)
    texts = [f"the answer is {i}" for i in range(50)]
    items = [{"answer": 7}] * 50
    start = time.monotonic()
    scores = g.batch(texts, items)
    took = time.monotonic() - start
    assert [s for s, _ in scores] == [1.0 if i == 7 else 0.0 for i in range(50)]
    assert scores[7][1] == {"py": 1.0}
    assert took < 30, f"50 samples in one process should not take {took:.1f} s"
    assert g("7", {"answer": 7}) == (1.0, {"py": 1.0})  # the per-sample call of the Grader interface
    scratch = grader("def grade(sample, item):\n"
                     "    with open('scratch.txt', 'w') as f:\n        f.write(sample['output_text'])\n"
                     "    return float(len(open('scratch.txt').read()))\n", limits)
    assert scratch("abcd", {})[0] == 4.0  # the working directory is writable
    js = grader("def grade(sample, item):\n    return float(sample['output_json']['x'])\n", limits)
    assert js('{"x": 0.25}', {})[0] == 0.25


def test_cpu_spin_is_killed(limits: Limits) -> None:
    from dataclasses import replace

    roomy = replace(limits, wall_s=30.0)  # a generous wall time, so the CPU limit is what stops it
    g = grader("def grade(sample, item):\n    while True:\n        pass\n", roomy)
    start = time.monotonic()
    with pytest.raises(GraderError, match="CPU time limit") as info:
        g("x", {})
    assert time.monotonic() - start < roomy.startup_s + roomy.wall_s
    assert info.value.code == "grader_error" and "sample 0" in str(info.value)


def test_a_failing_python_grader_fails_the_job_with_grader_error_not_as_a_dataset_error(limits: Limits) -> None:
    from types import SimpleNamespace

    from engine.evaluate import grade
    from engine.types import TrainError

    g = grader("def grade(sample, item):\n    raise RuntimeError('boom')\n", limits)
    with pytest.raises(TrainError) as info:
        grade(g, [SimpleNamespace(text="x")], [{}])
    assert info.value.code == "grader_error" and "boom" in str(info.value)
    text = grader("def grade(sample, item):\n    return float(item['answer'] == sample['output_text'])\n", limits)
    assert grade(text, [SimpleNamespace(text="4")], [{"answer": "4"}])[0] == [1.0]

    from engine.rewards import build_grader

    overflow = build_grader({"type": "multi", "name": "huge", "calculate_output": "1e308 * a + 1e308 * a",
                             "graders": {"a": {"type": "string_check", "name": "a", "operation": "eq",
                                               "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}}})
    assert grade(overflow, [SimpleNamespace(text="5")], [{"answer": "4"}])[0] == [0.0]
    with pytest.raises(TrainError) as info:  # inf would make every advantage, then the adapter, NaN
        grade(overflow, [SimpleNamespace(text="4")], [{"answer": "4"}])
    assert info.value.code == "grader_error" and "'huge' returned inf" in str(info.value)


# grade() bodies, the item fields a row must have for them (read on every call), and a row that
# lacks a field the body reads only on some paths (it must grade, not raise)
ITEM_READS = [
    ("return float(sample['output_text'] == item['answer'])", {"answer"}, None),
    ("'doc'\n    a = item['a'].strip() + str(item['meta']['x'])\n    if 'b' in item:\n"
     "        return float(item['b'])\n    return float(len(a) + item['c'])", {"a", "meta"},
     {"a": "s", "meta": {"x": 1}, "c": 1}),
    ("x = item.get('a') or item['b']\n    y = item['c'] if x else 0\n    z = [item['e'] for _ in ()]\n"
     "    item['f'] = 1\n    return float(item['g'] + item['f'])", {"g"}, {"a": 1, "c": 1, "g": 2}),
    ("item['answer'] = item.get('answer', '')\n    return float(item['answer'] == sample['output_text'])",
     set(), {}),
    ("x = item['q']\n    item.update(answer='1')\n    return float(item['answer'] == x)", {"q"}, {"q": "1"}),
    ("item = {'answer': '', **item}\n    return float(item['answer'] == '')", set(), {}),
    ("try:\n        return float(item['answer'])\n    except KeyError:\n        return 0.0", set(), {}),
    ("def inner():\n        return item['k']\n    return 0.0 if sample else float(inner())", set(), {}),
    ("import re\n    from math import isfinite\n    return float(bool(re.match(item['a'], 'x')))", {"a"}, None),
    ("from json import loads as item\n    return float(item['a'])", set(), None),
]


@pytest.mark.parametrize("body,reads,partial", ITEM_READS)
def test_the_item_fields_a_python_grader_reads_on_every_call(body: str, reads: set, partial) -> None:
    """A python grader's item_fields are the fields its code reads on every call: a row without any
    one of them raises KeyError in the sandbox (so refusing such a row ahead refuses only jobs that
    would fail), and a row with them but without a field read only on some paths grades."""
    g = grader(f"def grade(sample, item):\n    {body}\n", MODES["hook-only"])
    assert g.item_fields == reads
    full = {"answer": "4", "a": "s", "meta": {"x": 1}, "b": 1, "c": 1, "e": 1, "g": 2, "q": "1", "k": 1}
    for name in reads:
        with pytest.raises(GraderError, match="KeyError"):
            g("4", {k: v for k, v in full.items() if k != name})
    if partial is not None:
        assert isinstance(g("4", partial)[0], float)


def test_memory_bomb_fails(limits: Limits) -> None:
    from dataclasses import replace

    limits = replace(limits, wall_s=30.0)  # filling 1 GB on a busy machine is slow; memory must stop it first
    g = grader("def grade(sample, item):\n    blocks = []\n    while True:\n"
               "        blocks.append(bytearray(64 << 20))\n", limits)
    with pytest.raises(GraderError, match="MemoryError"):
        g("x", {})
    big = grader("def grade(sample, item):\n    return float(len(bytearray(4 << 30)))\n", limits)
    with pytest.raises(GraderError, match="MemoryError"):
        big("x", {})


def test_sleep_beyond_wall_time_is_killed(limits: Limits) -> None:
    g = grader("import time\ndef grade(sample, item):\n    time.sleep(60)\n    return 1.0\n", limits)
    start = time.monotonic()
    with pytest.raises(GraderError, match="wall-time limit"):
        g("x", {})
    assert time.monotonic() - start < limits.startup_s + limits.wall_s + 3


def test_network_is_blocked(limits: Limits) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    g = grader("import socket\n"
               "def grade(sample, item):\n"
               "    try:\n"
               f"        socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
               "    except OSError as exc:\n"
               "        print('refused:', exc)\n"
               "        return 0.0\n"
               "    return 1.0\n", limits)
    try:
        assert g("x", {})[0] == 0.0
    finally:
        stop.set()
        thread.join(2)
        server.close()
    assert accepted == []


def test_file_writes_outside_the_working_directory_are_refused(limits: Limits, tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    tries = [f"open({str(target)!r}, 'w').write('x')", "open('/tmp/qerl-grader-escape', 'w').write('x')",
             f"import os; os.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
             "import os; os.symlink('/etc/passwd', 'link'); open('link', 'a').write('x')",
             f"import shutil; shutil.copy('/etc/hostname', {str(target)!r})"]
    for code in tries:
        g = grader("def grade(sample, item):\n"
                   "    try:\n"
                   f"        {code}\n"
                   "    except OSError as exc:\n"
                   "        return 0.0\n"
                   "    return 1.0\n", limits)
        assert g("x", {})[0] == 0.0, code
    assert not target.exists() and not Path("/tmp/qerl-grader-escape").exists()


def test_no_new_processes_and_bounded_output(limits: Limits) -> None:
    fork = grader("import os, subprocess\n"
                  "def grade(sample, item):\n"
                  "    try:\n        subprocess.run(['true'])\n        return 1.0\n"
                  "    except (OSError, PermissionError):\n        return 0.0\n", limits)
    if limits.audit_hook or os.geteuid() != 0:
        assert fork("x", {})[0] == 0.0
    # (kernel-only as root: Linux exempts root from RLIMIT_NPROC; the pid namespace still ends every
    # process it started when the grader's process ends, which the wall-time test above bounds.)
    flood = grader("import sys\ndef grade(sample, item):\n"
                   "    while True:\n        sys.stderr.write('x' * 65536)\n", limits)
    with pytest.raises(GraderError, match="File too large|larger than 16 MB"):  # RLIMIT_FSIZE: EFBIG
        flood("x", {})


def test_user_errors_fail_clearly() -> None:
    lim = Limits(**FAST)
    with pytest.raises(GraderError, match=r"sample 1: ZeroDivisionError"):
        grader("def grade(sample, item):\n    return 1 / item['d']\n", lim).batch(["a", "b"], [{"d": 1}, {"d": 0}])
    with pytest.raises(GraderError, match="finite number"):
        grader("def grade(sample, item):\n    return float('nan')\n", lim)("x", {})
    with pytest.raises(GraderError, match="finite number"):
        grader("def grade(sample, item):\n    return 'high'\n", lim)("x", {})
    with pytest.raises(GraderError, match="failed to load: ModuleNotFoundError"):
        grader("import no_such_module_qerl\ndef grade(sample, item):\n    return 1.0\n", lim)("x", {})


@pytest.mark.parametrize("source,fragment", [
    ("", "must be Python code"), ("def grade(sample):\n    return 1.0\n", "grade(sample, item)"),
    ("def grade(sample, item) return 1\n", "does not parse"), ("x = 1\n", "grade(sample, item)"),
    ("(" * 100_000, "does not parse"), ("#" * (300 * 1024) + "\ndef grade(s, i): return 1\n", "larger than 256 KB"),
])
def test_bad_source_is_refused_at_build_time_without_running_it(source: str, fragment: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        build_grader({"type": "python", "source": source})
    marker = tmp_path / "ran"
    # building (what the API does on submit) parses but never executes: the marker is not written
    build_grader({"type": "python", "source": f"open({str(marker)!r}, 'w')\ndef grade(s, i):\n    return 1.0\n"})
    assert not marker.exists()


def test_the_service_data_directories_are_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if sandbox_mode() != "namespaces":
        pytest.skip("needs namespaces to hide directories")
    secret_dir = tmp_path / "artifacts"
    (secret_dir / "files").mkdir(parents=True)
    (secret_dir / "files" / "other-project.jsonl").write_text('{"prompt": "secret"}\n')
    monkeypatch.setenv("ARTIFACT_DIR", str(secret_dir))
    assert str(secret_dir.resolve()) in hidden_dirs()
    g = grader("import os\ndef grade(sample, item):\n"
               f"    try:\n        return float(len(os.listdir({str(secret_dir)!r})))\n"
               "    except OSError:\n        return -1.0\n", Limits(**FAST))
    assert g("x", {})[0] in (0.0, -1.0)  # empty or unreadable, never the project's file
    pids = grader("import os\ndef grade(sample, item):\n"
                  "    return float(len([p for p in os.listdir('/proc') if p.isdigit()]))\n", Limits(**FAST))
    assert pids("x", {})[0] <= 4  # its own pid namespace: sh/python only, not the worker's environment
