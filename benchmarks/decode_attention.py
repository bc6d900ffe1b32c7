"""Decode attention per call: SDPA (cuDNN / flash, additive mask built once per step) against
engine.rollout.attention's kernel, side by side in one run, on Qwen2.5 head groupings.

Each method runs as a CUDA graph of 28 calls over 28 different layer caches (as in a decode step,
so the caches are not all in L2), 20 timed replays after 3 warm-ups; median time per call.

    python3 benchmarks/decode_attention.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from engine.rollout.attention import KernelAttention, SdpaAttention, _library, splits_for

SHAPES = {"7b": (4, 7, 128), "14b/32b": (8, 5, 128), "72b": (8, 8, 128)}  # kv heads, n_rep, head dim
LAYERS = 28


def time_graph(fn, reps: int = 20) -> float:
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    times = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) * 1e3 / LAYERS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--lengths", default="512,1280,2048")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    kernel = KernelAttention(_library())
    sdpa = SdpaAttention()
    rows = []
    print(f"{'shape':>8} {'B':>3} {'s':>5} {'splits':>6} {'sdpa us':>8} {'kernel us':>9} {'ratio':>6}")
    for name, (kvh, n_rep, d) in SHAPES.items():
        for b in map(int, args.batches.split(",")):
            for s in map(int, args.lengths.split(",")):
                kc = [torch.randn(b, kvh, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
                vc = [torch.randn_like(k) for k in kc]
                q = torch.randn(b, kvh * n_rep, d, device="cuda", dtype=torch.bfloat16)
                valid = torch.ones(b, s, dtype=torch.bool, device="cuda")
                valid[:, :17] = False  # some left padding

                def run(att):
                    att.begin_step(valid, b, n_rep, s, torch.bfloat16)
                    for i in range(LAYERS):
                        att(q, kc[i], vc[i], valid, s)

                t_sdpa, t_kernel = time_graph(lambda: run(sdpa)), time_graph(lambda: run(kernel))
                splits = splits_for(b, kvh, s)[0]
                row = {"shape": name, "batch": b, "s": s, "splits": splits, "sdpa_us": t_sdpa, "kernel_us": t_kernel,
                       "ratio": t_sdpa / t_kernel}
                rows.append(row)
                print(f"{name:>8} {b:>3} {s:>5} {splits:>6} {t_sdpa:8.1f} {t_kernel:9.1f} {t_sdpa / t_kernel:5.2f}x",
                      flush=True)
                del kc, vc
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
