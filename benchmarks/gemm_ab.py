"""Our NVFP4 GEMM built from several nvfp4_gemm.cu versions, per call, in interleaved rounds.

    python3 benchmarks/gemm_ab.py 7b:qkv,7b:gate_up,72b:10240x8192 17,32,64,128,256 \
        base=path/to/previous/nvfp4_gemm.cu [name=path ...]

Layers are model:layer of benchmarks/gemm_nvfp4.py's SHAPES or model:NxK; row counts M comma
separated; each name=path a version built from that source (its headers beside it,
benchmarks/decode_ab.py's --kernels). Per layer and M, this version ("new") and each other one are
timed as in benchmarks/gemm_nvfp4.py (a CUDA graph of calls over >300 MB of weight copies, median
of the replays) in three rounds, the order of the versions reversed every other round; the table
gives the median of the rounds (us), this version's time over each other's, and each version's
spread over the rounds.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_ab import applied, kernels_variant  # noqa: E402
from benchmarks.gemm_nvfp4 import Layer, parse_layers  # noqa: E402

ROUNDS = 3


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    variants = [("new", [])] + [kernels_variant(a) for a in sys.argv[3:]]
    ms = [int(v) for v in sys.argv[2].split(",")]
    print("layer M " + " ".join(f"{n:>8s}" for n, _ in variants)
          + f"   (us, median of {ROUNDS} interleaved rounds; new / each other)")
    for model, layer, n, k in parse_layers(sys.argv[1]):
        weights = Layer(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times: dict[str, list[float]] = {name: [] for name, _ in variants}
            for r in range(ROUNDS):
                for name, sets in (variants if r % 2 == 0 else variants[::-1]):
                    with applied(sets):
                        times[name].append(weights.time_ours(x))
            med = {name: statistics.median(v) for name, v in times.items()}
            print(f"{model} {layer:7s} M={m:<4d} " + " ".join(f"{med[name]:8.1f}" for name, _ in variants) + "  | "
                  + " ".join(f"{med['new'] / med[name]:5.3f}" for name, _ in variants[1:]) + "  spread "
                  + " ".join(f"{(max(v) - min(v)) / statistics.median(v) * 100:.0f}%" for v in times.values()),
                  flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
