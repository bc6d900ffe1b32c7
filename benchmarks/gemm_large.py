"""Our NVFP4 GEMM at large M: its paths side by side with torch bf16 matmul, per layer and row count.

    python3 benchmarks/gemm_large.py 7b:gate_up,14b:qkv,72b:59136x8192 512,768,1024,2048

Layers are model:layer of benchmarks/gemm_nvfp4.py's SHAPES or model:NxK; row counts M comma
separated. Per layer and M: bf16 matmul, dequantize + cuBLAS, the path the op takes
(``kernel_path``), and the warp-specialized wgmma kernel forced into row tiles of 256 and of 128
rows, every block a whole column ("ws n256", "ws n128") and, where there are several row tiles (and
the layer's split-K tickets suffice), one wave of blocks sharing them by stream K ("sk n256",
"sk n128"), each in us with its ratio to bf16 and its TFLOP/s; timed as benchmarks/gemm_nvfp4.py
times (a CUDA graph of calls over >300 MB of weight copies, median of the replays), the best of two
rounds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemm_nvfp4 import Layer, parse_layers  # noqa: E402
from engine.kernels import nvfp4_gemm as gemm  # noqa: E402

ROUNDS = 2


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    torch.backends.cuda.matmul.allow_tf32 = False
    ms = [int(v) for v in sys.argv[2].split(",")]
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  (us; x: bf16 / this; TF: TFLOP/s)")
    for model, layer, n, k in parse_layers(sys.argv[1]):
        weights = Layer(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            timers = {"bf16": lambda: weights.time_bf16(x), "dequant+cuBLAS": lambda: weights.time_large(x),
                      "op": lambda: weights.time_ours(x),
                      "ws n256": lambda: weights.time_wg(x, 256, 3), "ws n128": lambda: weights.time_wg(x, 128, 3)}
            wave, p = gemm.sm_count(x.device), weights.fp4[0]
            for bn in (256, 128):  # where the layer has a ticket for every row tile's column
                if m > bn and -(-m // bn) * gemm._wg_columns(p, 3) <= p.counters.numel():
                    timers[f"sk n{bn}"] = lambda bn=bn: weights.time_wg(x, bn, 3, wave)
            best = {name: min(fn() for _ in range(ROUNDS)) for name, fn in timers.items()}
            route = gemm.kernel_path(m, n, k)
            if route == "wg":
                cfg = gemm.wg_config(m, weights.fp4[0], x.device)
                route = f"wgmma n{cfg.bn} g{cfg.wg} b{cfg.blocks}/{cfg.columns}"
            flops = 2 * m * n * k
            print(f"{model} {layer:11s} M={m:<5d} " + " | ".join(
                f"{name} {t:8.1f} x{best['bf16'] / t:4.2f} {flops / t / 1e6:4.0f} TF" for name, t in best.items())
                + f" | op: {route}", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
