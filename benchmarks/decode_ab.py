"""Decode-step A/B: the graph engine's ms per step under variants of its launch knobs, alternated
on one model in one process, so that the drift between machine starts (a few percent on the GPU
machine) does not enter the comparison.

A variant is a name and module or class attributes set to Python literals for its runs (and put
back after them), or environment variables (``env.NAME=text``: the kernels' launch switches, read
at every launch); the first variant is the reference:

    python3 benchmarks/decode_ab.py --size 7b --method nvfp4 --batches 1,8 --rounds 3 \\
        --variant base: \\
        --variant qkv2:engine.rollout.cuda_graph.QKV_EPILOGUE_ROWS=2 \\
        --variant norm:engine.rollout.cuda_graph.FUSED_NORM_ROWS=16,engine.rollout.cuda_graph.FUSED_NORM_MIN_HIDDEN=0 \\
        --variant cluster:env.QERL_SHRINK_CLUSTER=1

Each run is benchmarks/rollout.py's (``run_config``) under the variant: the engine built, warmed
up (graphs captured outside the timing) and timed over a rollout of ``--gen`` tokens after
``--prompt`` random prompt tokens per row (LoRA r = ``--rank``, random weights in the named
shape). Printed per batch: each variant's median ms per step over ``--rounds`` runs, and its
difference from the first in ms per step and us per layer. ``--device cpu`` with ``--shape`` overrides is a functional dry run.

``--kernels name=path`` (repeatable; these variants come first) runs with the NVFP4 kernels built
from another source of engine/kernels/nvfp4_gemm.cu (its headers copied beside it), so that two
versions of the kernels compare in one process:

    mkdir -p /tmp/prev && git show HEAD~1:engine/kernels/nvfp4_gemm.cu > /tmp/prev/nvfp4_gemm.cu && \\
        cp engine/kernels/*.cuh /tmp/prev/
    python3 benchmarks/decode_ab.py --size 7b --batches 1,8 --kernels prev=/tmp/prev/nvfp4_gemm.cu --variant new:
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from benchmarks.rollout import run_config, set_lora
from engine.kernels import _build
from engine.model.shapes import build_random_model, shape_config


def _resolve(path: str) -> tuple[Any, str]:
    """(object, attribute name) of a dotted ``module[.Class].attr`` path."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:-1]:
            obj = getattr(obj, name)
        if not hasattr(obj, parts[-1]):
            raise ValueError(f"{path}: {'.'.join(parts[:-1])} has no attribute {parts[-1]!r}")
        return obj, parts[-1]
    raise ValueError(f"{path}: no importable module in it (write module.attr or module.Class.attr)")


def parse_variant(text: str) -> tuple[str, list[tuple[Any, str, Any]]]:
    """``name:path=value,path=value`` -> (name, [(object, attribute, value)]); values are Python
    literals (which may hold commas: ``m.RULE={'o': (1, 1)},m.OTHER=2``); ``env.NAME=text`` gives
    (os.environ, NAME, text)."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"variant {text!r}: give it a name (name:module.attr=value,...)")
    sets = []
    for item in filter(None, (x.strip() for x in re.split(r",(?=\s*[A-Za-z_][\w.]*\s*=)", rest))):
        path, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"variant {name}: {item!r} is not path=value")
        if path.strip().startswith("env."):
            sets.append((os.environ, path.strip()[4:], value.strip()))
            continue
        try:
            literal = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {name}: {value!r} is not a Python literal") from None
        obj, attr = _resolve(path.strip())
        sets.append((obj, attr, literal))
    return name, sets


@contextmanager
def applied(sets: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """The variant's attributes and environment variables set for the block, put back after it."""
    saved = [(obj, attr, obj.get(attr) if obj is os.environ else getattr(obj, attr)) for obj, attr, _ in sets]
    try:
        for obj, attr, value in sets:
            _set(obj, attr, value)
        yield
    finally:
        for obj, attr, value in reversed(saved):
            _set(obj, attr, value)


def _set(obj: Any, attr: str, value: Any) -> None:
    if obj is not os.environ:
        setattr(obj, attr, value)
    elif value is None:  # an environment variable that was not set before
        os.environ.pop(attr, None)
    else:
        os.environ[attr] = value


def kernels_variant(text: str) -> tuple[str, list[tuple[Any, str, Any]]]:
    """``name=path`` -> a variant whose NVFP4 kernel library is built from the source at path."""
    name, eq, path = text.partition("=")
    if not (name and eq and path):
        raise ValueError(f"--kernels {text!r}: write name=path/to/nvfp4_gemm.cu")
    lib = _build.library_from(Path(path), f"qerl_nvfp4_{name}", f"NVFP4 kernels from {path}", "nothing")
    if lib is None:
        raise ValueError(f"--kernels {text!r}: the source did not build (see the warning above)")
    return name, [(_build, "library", lambda: lib)]


def run(args: argparse.Namespace) -> list[dict]:
    variants = ([kernels_variant(k) for k in args.kernels] + [parse_variant(v) for v in args.variant]
                or [("base", [])])
    overrides = {k: ast.literal_eval(v) for k, v in (x.split("=") for x in args.shape.split(",") if x)}
    cfg = shape_config(args.size, **overrides)
    model = build_random_model(cfg, quantization=args.method, device=args.device)
    if args.rank:
        set_lora(model, args.rank)
    bench = argparse.Namespace(prompt=args.prompt, gen=args.gen, repeats=1, device=args.device, bandwidth=False,
                               profile=False)

    def step_ms(b: int) -> float:
        return run_config(model, args.method, args.size, args.rank, b, bench, lambda row: None)["ms_per_step"]

    rows = []
    for b in [int(x) for x in args.batches.split(",") if x]:
        times: dict[str, list[float]] = {name: [] for name, _ in variants}
        for _ in range(args.rounds):
            for name, sets in variants:
                with applied(sets):
                    times[name].append(step_ms(b))
        ref = statistics.median(times[variants[0][0]])
        for name, _ in variants:
            ms = statistics.median(times[name])
            row = {"size": args.size, "method": args.method, "batch": b, "variant": name, "ms_per_step": ms,
                   "delta_ms": ms - ref, "delta_us_per_layer": 1e3 * (ms - ref) / cfg.num_layers,
                   "runs": times[name]}
            rows.append(row)
            print(f"{args.size} {args.method} B={b:<3d} {name:<12s} {ms:8.3f} ms/step  {ms - ref:+7.3f} ms  "
                  f"{row['delta_us_per_layer']:+6.1f} us/layer   runs {[round(t, 3) for t in times[name]]}",
                  flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="7b")
    ap.add_argument("--method", default="nvfp4", help="nvfp4 | bf16 | nf4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (0: no adapter)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--variant", action="append", default=[], help="name:module.attr=value,... (repeat)")
    ap.add_argument("--kernels", action="append", default=[],
                    help="name=path: a variant with the NVFP4 kernels built from this nvfp4_gemm.cu (repeat)")
    ap.add_argument("--shape", default="", help="shape overrides, e.g. num_layers=2,hidden_size=256")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "seconds": time.perf_counter() - t0}, f, indent=1)


if __name__ == "__main__":
    main()
