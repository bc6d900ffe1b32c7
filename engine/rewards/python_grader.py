"""OpenAI's ``python`` grader: ``{"type": "python", "source": "def grade(sample, item) -> float: ..."}``.

User code never runs in the calling process (the API only parses it). Each batch of samples runs in
one fresh ``python -I`` child, so one process start is paid per batch, not per sample. Layers, from
the kernel up (each one is tested in tests/test_hostile_grader.py):

- rlimits set before exec, soft = hard: CPU seconds (SIGXCPU), address space (MemoryError), file
  size (also caps what the child can print), open files, core dumps off, processes;
- where the host allows namespaces (root, or user namespaces): a private network namespace (no
  interface is up, so even 127.0.0.1 is unreachable), a private mount namespace in which every
  mount is read-only except a size-limited tmpfs that is the child's working directory, and all
  capabilities dropped (so the child cannot undo the rlimits or the mounts);
- inside the child, before the user's code: an audit hook that refuses sockets, new processes
  and threads, ctypes, writes outside the working directory and frame/gc introspection. It is the
  only network and file barrier where namespaces are unavailable; there it is a Python-level
  guard, not a kernel boundary (``sandbox_mode()`` says which one holds);
- the parent kills the whole process group at the wall-time limit.

A failure in the user's code, or a limit hit, fails the job with ``grader_error`` and the sample
index, rather than training on made-up rewards.
"""
from __future__ import annotations

import ast
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from engine.rewards.base import Grader, check_fields, get_str, grader_name
from engine.types import TrainError

MAX_SOURCE_BYTES = 256 * 1024  # OpenAI's limit for a python grader


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 2.0  # CPU seconds per sample; the process gets cpu_s * n + 1
    wall_s: float = 5.0  # wall seconds per sample, plus startup_s for the process
    startup_s: float = 5.0
    memory_mb: int = 1024  # address space of the child
    file_mb: int = 16  # largest file it may write (stdout and stderr included)
    tmp_mb: int = 64  # size of its working directory (namespaced mode)
    open_files: int = 64
    processes: int = 0  # RLIMIT_NPROC for new processes (the kernel exempts root: the hook and --pid cover it)
    batch: int = 256  # samples per process
    namespaces: bool = True  # use them when the host allows
    audit_hook: bool = True  # tests turn it off to prove the kernel layers alone


class GraderError(TrainError):
    """The user's grader failed or hit a limit (the job fails with code ``grader_error``);
    ``timed_out`` when the limit was its CPU or wall time."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__("grader_error", message)
        self.timed_out = timed_out


# Runs in the child. Reads {"source", "samples"} on stdin; writes one JSON line per sample to
# the original stdout (the user's prints go to stderr).
_CHILD = r'''
import json, os, sys
def _install(root, block_net):
    import posixpath
    realpath, sep, startswith = posixpath.realpath, "/", str.startswith
    root = realpath(root) + sep
    denied_imports = frozenset(("ctypes", "_ctypes", "cffi"))
    import _posixsubprocess, subprocess  # importable (libraries import it), but it cannot start anything
    def no_process(*args, **kwargs):
        raise PermissionError("starting processes is not allowed in a python grader")
    _posixsubprocess.fork_exec = no_process
    denied = ("os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
              "subprocess.Popen", "os.kill", "os.killpg", "_thread.start_new_thread", "gc.get_objects",
              "gc.get_referrers", "gc.get_referents", "ctypes.dlopen")
    path_events = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                   "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "os.replace")
    def inside(p):
        if isinstance(p, int):
            return True
        p = os.fsdecode(p)
        return startswith(realpath(p) + sep, root)
    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, 0))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC)
            if writing and not inside(path):
                raise PermissionError(f"a python grader may write only in its working directory, not {path!r}")
        elif event in path_events:
            for p in args[:2]:
                if isinstance(p, (str, bytes)) and not inside(p):
                    raise PermissionError(f"{event} outside the grader's working directory is not allowed")
        elif block_net and event.startswith("socket."):
            raise PermissionError("network access is not allowed in a python grader")
        elif event == "import" and args[0].split(".")[0] in denied_imports:
            raise ImportError(f"module {args[0]!r} is not available in a python grader")
        elif event.startswith(denied):
            raise PermissionError(f"{event} is not allowed in a python grader")
    sys.addaudithook(hook)
def _main():
    job = json.loads(sys.stdin.read())
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the user's prints go to stderr
    if job["hook"]:
        _install(os.getcwd(), True)
    scope = {"__name__": "grader"}
    try:
        exec(compile(job["source"], "<grader>", "exec"), scope)
        grade = scope["grade"]
    except BaseException as exc:
        out.write(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"[:500]}) + "\n")
        return
    for i, (sample, item) in enumerate(job["samples"]):
        try:
            line = {"i": i, "score": grade(sample, item)}
        except BaseException as exc:
            line = {"i": i, "error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(line, default=str) + "\n")
        out.flush()
_main()
'''

# Namespaced mode (run by ``unshare -m -n -p -f --mount-proc``): its own /proc (no other process
# to read), the service's data directories hidden under empty tmpfs, every mount read-only, a
# tmpfs as the working directory, then all capabilities dropped before Python starts.
_JAIL = r'''set -e
mount --make-rprivate /
printf '%s\n' "$QERL_GRADER_HIDE" | while IFS= read -r d; do
  if [ -n "$d" ] && [ -d "$d" ]; then mount -t tmpfs -o ro,size=4k,mode=0000 qerl-hidden "$d"; fi
done
mount -t tmpfs -o "size=$2m,mode=0700" qerl-grader "$1"
awk '{print $5}' /proc/self/mountinfo | while read -r m; do mount -o remount,bind,ro "$m" 2>/dev/null || true; done
mount -o remount,bind,rw "$1"
cd "$1"
shift 2
exec setpriv --bounding-set=-all --inh-caps=-all --no-new-privs "$@"
'''
_UNSHARE = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


def hidden_dirs() -> list[str]:
    """Directories a grader must not read: the service's artifacts, data, model cache and client
    config (other projects' files and the API keys live there), and the AWS credentials of an
    artifact bucket."""
    home = Path.home()
    dirs = [os.environ.get("ARTIFACT_DIR"), os.environ.get("QERL_ARTIFACT_DIR"), os.environ.get("QERL_DATA_DIR"),
            os.environ.get("QERL_CACHE_DIR"), str(home / ".qerl"), str(home / ".config" / "qerl"),
            str(home / ".cache" / "qerl"), str(home / ".aws")]
    return [str(Path(d).expanduser().resolve()) for d in dirs if d]


@lru_cache(maxsize=1)
def _jail_works() -> bool:
    """Whether this host lets us build the namespaced sandbox (checked once, by trying it)."""
    if not all(shutil.which(t) for t in ("unshare", "setpriv", "mount", "awk")):
        return False
    with tempfile.TemporaryDirectory(prefix="qerl-grader-probe-") as tmp:
        cmd = [*_UNSHARE, "sh", "-c", _JAIL, "jail", tmp, "8", sys.executable, "-I", "-c",
               "import os; open('ok', 'w').write('1')\ntry:\n open('/etc/qerl-grader-probe', 'w')\n"
               "except OSError: print('ro')"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=tmp)
        except (OSError, subprocess.SubprocessError):
            return False
        return proc.returncode == 0 and proc.stdout.strip() == "ro"


def sandbox_mode(limits: Limits = Limits()) -> str:
    """"namespaces" (kernel-enforced network and file barriers) or "audit-hook" (Python-level)."""
    return "namespaces" if limits.namespaces and _jail_works() else "audit-hook"


def _preexec(limits: Limits, n: int) -> Any:
    cpu = int(math.ceil(limits.cpu_s * n)) + 1
    mem, fsize = limits.memory_mb << 20, limits.file_mb << 20

    def apply() -> None:  # in the forked child, before exec: inherited by everything it runs
        for res, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                           (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CORE, 0),
                           (resource.RLIMIT_NPROC, limits.processes)):
            resource.setrlimit(res, (value, value))
        for sig in (signal.SIGXFSZ, signal.SIGXCPU, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)

    return apply


def run_batch(source: str, samples: Sequence[tuple[dict[str, Any], Mapping[str, Any]]], limits: Limits = Limits()
              ) -> list[dict[str, Any]]:
    """Run ``grade`` on each (sample, item) in one sandboxed child: [{"score"} | {"error"}] per sample.

    Raises GraderError when the process as a whole fails (limit hit, crash, bad source)."""
    n = max(1, len(samples))
    payload = json.dumps({"source": source, "samples": [[s, dict(i)] for s, i in samples],
                          "hook": limits.audit_hook})
    wall = limits.startup_s + limits.wall_s * n
    with tempfile.TemporaryDirectory(prefix="qerl-grader-") as tmp:
        work, logs = Path(tmp) / "work", Path(tmp)
        work.mkdir()
        python = [sys.executable, "-I", "-c", _CHILD]
        if sandbox_mode(limits) == "namespaces":
            cmd = [*_UNSHARE, "sh", "-c", _JAIL, "jail", str(work), str(limits.tmp_mb), *python]
        else:
            cmd = python
        with open(logs / "in.json", "w") as fh:
            fh.write(payload)
        with open(logs / "in.json", "rb") as stdin, open(logs / "out", "wb") as out, open(logs / "err", "wb") as err:
            env = {"LANG": "C.UTF-8", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                   "QERL_GRADER_HIDE": "\n".join(hidden_dirs())}
            proc = subprocess.Popen(cmd, stdin=stdin, stdout=out, stderr=err, cwd=work, env=env,
                                    preexec_fn=_preexec(limits, n), start_new_session=True, close_fds=True)
            rc, cpu_s, timed_out = _wait(proc, wall)
        lines = [json.loads(x) for x in (logs / "out").read_text(errors="replace").splitlines() if x.startswith("{")]
        big = max((logs / "out").stat().st_size, (logs / "err").stat().st_size) >= limits.file_mb << 20
        stderr = "\n".join(x for x in (logs / "err").read_bytes()[-600:].decode(errors="replace").splitlines()
                           if not x.startswith("unshare:")).strip()
        over_cpu = cpu_s >= limits.cpu_s * n + 0.5
    return _collect(lines, n, len(samples), rc, timed_out, over_cpu, big, wall, limits, stderr)


def _wait(proc: subprocess.Popen, wall: float) -> tuple[int, float, bool]:
    """(exit status, CPU seconds of the child and everything it reaped, timed out). The wrapper
    (unshare --fork) turns a signal death into status 1, so the CPU limit is read from rusage."""
    deadline, timed_out = time.monotonic() + wall, False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.01)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind in its process group
    except ProcessLookupError:
        pass
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    return rc, usage.ru_utime + usage.ru_stime, timed_out


def _collect(lines: list[dict[str, Any]], n: int, count: int, rc: int, timed_out: bool, over_cpu: bool, big: bool,
             wall: float, limits: Limits, stderr: str) -> list[dict[str, Any]]:
    for line in lines:
        if "fatal" in line:
            raise GraderError(f"python grader: the source failed to load: {line['fatal']}")
    results = [line for line in lines if isinstance(line.get("i"), int)][:count]
    if len(results) == count:
        return results
    if timed_out:
        why = f"exceeded the wall-time limit ({wall:g} s for {n} samples; {limits.wall_s:g} s each)"
    elif over_cpu or rc in (-signal.SIGXCPU,):
        why = f"exceeded the CPU time limit ({limits.cpu_s:g} s per sample)"
    elif big or rc == -signal.SIGXFSZ:
        why = f"wrote a file or output larger than {limits.file_mb} MB"
    else:
        why = f"exited with code {rc}"
    tail = f"; stderr: {stderr[-300:]}" if stderr else ""
    raise GraderError(f"python grader {why} while grading sample {len(results)}{tail}. Make grade() cheaper, or "
                      "bound its work on long samples.", timed_out=timed_out or over_cpu or rc == -signal.SIGXCPU)


def _check_source(source: Any, path: str) -> str:
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{path}.source must be Python code defining grade(sample, item) -> float")
    if len(source.encode()) > MAX_SOURCE_BYTES:
        raise ValueError(f"{path}.source is larger than {MAX_SOURCE_BYTES // 1024} KB; shorten it")
    try:  # parsed here, never executed here
        tree = ast.parse(source, "<grader>")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"{path}.source does not parse: {exc}") from None
    fns = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "grade"]
    if not fns or len(fns[0].args.args) + len(fns[0].args.posonlyargs) != 2:
        raise ValueError(f"{path}.source must define a top-level function grade(sample, item) -> float")
    return source


def item_reads(source: str) -> set[str]:
    """The top-level item fields ``grade`` reads as ``item["name"]`` on every call: in the simple
    statements (assignments, expressions, imports) its body starts with, up to the first one that
    branches, loops, returns, catches or names ``item`` anew, outside short-circuits, conditional expressions and nested functions.
    A row without one of them would raise KeyError at its first sample, so it is checked before a
    job runs; reads the code may skip (``item.get``, a read under an ``if``) are not counted."""
    tree = ast.parse(source, "<grader>")
    fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "grade")
    item = (fn.args.posonlyargs + fn.args.args)[1].arg
    found: set[str] = set()
    written: set[str] = set()  # item["k"] = ... before a read: not the row's own field

    def changes_item(stmt: ast.stmt) -> bool:
        """Binds the name anew, writes a key not known ahead, or calls a method that may add keys."""
        for n in ast.walk(stmt):
            if isinstance(n, ast.NamedExpr) or (isinstance(n, ast.Name) and n.id == item
                                                and isinstance(n.ctx, (ast.Store, ast.Del))):
                return True
            if (isinstance(n, ast.Subscript) and not isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name)
                    and n.value.id == item and not (isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str))):
                return True
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == item
                    and n.attr not in ("get", "keys", "values", "items")):
                return True
        return False

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.IfExp,
                             ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return  # may not run, or not with this item
        if isinstance(node, ast.BoolOp):
            return visit(node.values[0])  # the rest may be short-circuited
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
                and node.value.id == item and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str) and node.slice.value not in written):
            found.add(node.slice.value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in fn.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Pass)):
            if any((a.asname or a.name.split(".")[0]) == item for a in getattr(stmt, "names", [])):
                break  # binds the name anew
            continue
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)):
            break
        if changes_item(stmt):
            break
        visit(stmt)  # the value is read before the targets are written
        written.update(n.slice.value for n in ast.walk(stmt) if isinstance(n, ast.Subscript)
                       and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == item)
        if isinstance(stmt, ast.Return):
            break
    return found


def sample_of(text: str) -> dict[str, Any]:
    """OpenAI's ``sample`` argument: the output text, and its JSON when the text is JSON."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        parsed = None
    return {"output_text": text, "output_json": parsed if isinstance(parsed, (dict, list)) else None}


class PythonGrader(Grader):
    """Scores with the user's ``grade(sample, item)``; ``batch`` grades many samples per process."""

    type = "python"

    def __init__(self, cfg: dict, path: str, limits: Limits | None = None) -> None:
        check_fields(cfg, path, required=("source",), optional=("image_tag",))
        super().__init__(grader_name(cfg, path))
        self.source = _check_source(cfg["source"], path)
        self.item_fields = item_reads(self.source)
        if "image_tag" in cfg:
            get_str(cfg, "image_tag", path)  # accepted for compatibility; the host's Python runs it
        self.limits = limits or Limits()

    def batch(self, texts: Sequence[str], items: Sequence[Mapping[str, Any]]) -> list[tuple[float, dict[str, float]]]:
        out: list[tuple[float, dict[str, float]]] = []
        pairs = [(sample_of(t), i) for t, i in zip(texts, items)]
        for start in range(0, len(pairs), self.limits.batch):
            for k, r in enumerate(run_batch(self.source, pairs[start:start + self.limits.batch], self.limits)):
                out.append(self._score(r, start + k))
        return out

    def _score(self, result: dict[str, Any], index: int) -> tuple[float, dict[str, float]]:
        if "error" in result:
            raise GraderError(f"python grader raised on sample {index}: {result['error']}")
        score = result.get("score")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise GraderError(f"python grader returned {score!r} for sample {index}; grade() must return a finite "
                              "number")
        return float(score), {self.name: float(score)}

    def __call__(self, sample_text: str, item: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        return self.batch([sample_text], [item])[0]

    def score(self, sample_text: str, item: Mapping[str, Any]) -> float:
        return self(sample_text, item)[0]
