"""NVFP4 weight-only GEMM vs torch bf16 matmul, same GPU, same run.

Per layer shape (Qwen2.5 7B/14B/32B, and 72B with ``--models``: fused qkv, o, fused gate_up, down)
and activation rows M: time of ``x @ W.t()`` in bf16, time of ``engine.kernels.nvfp4_matmul``, their
ratio, the TB/s our kernel reaches on the 0.5625 bytes/weight stream, and the ratio as a share of
the 16/4.5 = 3.56x byte ceiling. Each timing is a CUDA graph of calls that rotate through >300 MB
of weight copies (so L2 holds none of them), replayed many times, median of the replays per call.

    python benchmarks/gemm_nvfp4.py                  # the table
    python benchmarks/gemm_nvfp4.py --sweep          # small-kernel configurations and crossovers
    python benchmarks/gemm_nvfp4.py --sweep-wg       # wgmma-kernel configurations and crossovers
    python benchmarks/gemm_nvfp4.py --sweep-slices --ms 1,8   # small kernel: warps per tile x splits

``--kernels name=path`` (repeatable; the table only) also times our calls with the kernels built
from another nvfp4_gemm.cu (its headers beside it; benchmarks/decode_ab.py's --kernels), in the same
loop, so that two versions compare per call in one process. The weights are this version's
layout: for a version with another bit layout the timing holds, the values do not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_ab import applied, kernels_variant, parse_variant  # noqa: E402
from engine.kernels import nvfp4_gemm as gemm  # noqa: E402

SHAPES = {
    "7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "14b": {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)},
    "32b": {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (55296, 5120), "down": (5120, 27648)},
    "72b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (59136, 8192), "down": (8192, 29568)},
}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
ROTATE_BYTES = 300e6
CEILING = 16 / 4.5


def parse_layers(text: str) -> list[tuple[str, str, int, int]]:
    """``model:layer,...`` (SHAPES' names, or model:NxK) -> [(model, layer, N, K)]."""
    out = []
    for item in text.split(","):
        model, layer = item.split(":")
        n, k = SHAPES[model][layer] if model in SHAPES and layer in SHAPES[model] else map(int, layer.split("x"))
        out.append((model, layer, n, k))
    return out


def time_calls(calls, reps: int = 15) -> float:
    """Median microseconds per call of a CUDA graph that runs every call once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for fn in calls:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def copies(nbytes: float) -> int:
    return max(2, int(-(-ROTATE_BYTES // nbytes)))


def random_prepared(n: int, k: int) -> gemm.PreparedNVFP4:
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    scale = torch.exp2(torch.empty(n, k // 16, device="cuda").uniform_(-4, 4)).to(torch.float8_e4m3fn)
    return gemm.prepare_tensors(packed, scale, torch.tensor([300.0], device="cuda"))


def clone(p: gemm.PreparedNVFP4) -> gemm.PreparedNVFP4:
    return gemm.PreparedNVFP4(p.wq.clone(), p.alpha.clone(), p.counters.clone(), p.n, p.k, p.alpha_value)


class Layer:
    """bf16 and NVFP4 copies of one shape, enough of each to rotate through ROTATE_BYTES."""

    def __init__(self, n: int, k: int):
        self.n, self.k = n, k
        self.bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies(2 * n * k))]
        base = random_prepared(n, k)
        self.fp4 = [base] + [clone(base) for _ in range(copies(0.5625 * n * k) - 1)]

    def time_bf16(self, x: torch.Tensor) -> float:
        return time_calls([lambda w=w: torch.matmul(x, w.t()) for w in self.bf16])

    def time_ours(self, x: torch.Tensor) -> float:
        return time_calls([lambda p=p: gemm.nvfp4_matmul(x, p) for p in self.fp4])

    def time_small(self, x: torch.Tensor, tnw: int | None, splits: int | None, prefetch: int | None = None,
                   wpt: int | None = None, serial: bool = False) -> float:
        m = x.shape[0]
        outs = torch.empty(m, self.n, dtype=torch.bfloat16, device="cuda")
        cfg = gemm.small_config(m, self.fp4[0], x.device, tnw, splits, wpt)
        ws = gemm._workspace(gemm.small_workspace(m, self.fp4[0], cfg.splits), x, None)  # one for all calls
        calls = [lambda p=p: gemm.gemm_small_into(x, p, outs, tnw=tnw, splits=splits, prefetch=prefetch, wpt=wpt,
                                                  workspace=ws) for p in self.fp4]
        if serial:
            # as in the decode step: each call's input is written by a kernel that waits for the
            # previous call to finish, so no call's tail overlaps the next call's start
            x0 = x.clone()
            calls = [f for c in calls for f in (c, lambda: x.copy_(x0))]
            return time_calls(calls) * 2 - time_calls([lambda: x.copy_(x0)] * len(self.fp4))
        return time_calls(calls)

    def time_wg(self, x: torch.Tensor, bn: int | None = None, wg: int | None = None, blocks: int | None = None,
                prefetch: int | None = None) -> float:
        m = x.shape[0]
        outs = torch.empty(m, self.n, dtype=torch.bfloat16, device="cuda")
        cfg = gemm.wg_config(m, self.fp4[0], x.device, bn, wg, blocks)
        ws = gemm._workspace(gemm.wg_workspace(m, cfg, self.fp4[0].kg), x, None)  # one for every call of the graph
        return time_calls([lambda p=p: gemm.gemm_wg_into(x, p, outs, bn=bn, wg=wg, blocks=blocks, workspace=ws,
                                                         prefetch=prefetch) for p in self.fp4])

    def time_large(self, x: torch.Tensor) -> float:
        return time_calls([lambda p=p: gemm._scaled_mm(x, gemm._weights(p, x).t(), p.alpha_value)
                           for p in self.fp4])

    def time_dequant(self) -> float:
        w = torch.empty(self.n, self.k, dtype=torch.bfloat16, device="cuda")
        return time_calls([lambda p=p: gemm.dequant_into(p, w) for p in self.fp4])


def path(m: int, layer: Layer) -> str:
    route = gemm.kernel_path(m, layer.n, layer.k)
    if route == "cublas":
        return "dequant+cuBLAS"
    if route == "wg":
        cfg = gemm.wg_config(m, layer.fp4[0], torch.device("cuda"))
        return f"wgmma n{cfg.bn} g{cfg.wg} b{cfg.blocks}/{cfg.columns}"
    cfg = gemm.small_config(m, layer.fp4[0], torch.device("cuda"))
    return f"fused mt{cfg.mt} w{cfg.tnw} s{cfg.splits}" + (f" p{cfg.wpt}" if cfg.wpt > 1 else "")


def shapes(models):
    """(model, layer, n, k) without repeats (14B and 32B share qkv and o)."""
    seen = set()
    for model in models:
        for name, (n, k) in SHAPES[model].items():
            if (n, k) not in seen:
                seen.add((n, k))
                yield model, name, n, k


def table(models, ms, out_json, kernels: list | None = None):
    """The per-call table; ``kernels``: (name, attribute sets) of other kernel builds
    (decode_ab.kernels_variant), each timed in the same loop as ours."""
    rows = []
    for model, name, n, k in shapes(models):
        layer = Layer(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tb, tq = layer.time_bf16(x), layer.time_ours(x)
            others = {}
            for kname, sets in kernels or []:
                with applied(sets):
                    others[kname] = layer.time_ours(x)
            ratio = tb / tq
            rows.append(dict(model=model, layer=name, n=n, k=k, m=m, bf16_us=tb, ours_us=tq, ratio=ratio,
                             tbps=0.5625 * n * k / tq / 1e6, ceiling_pct=100 * ratio / CEILING, path=path(m, layer),
                             kernels_us=others))
            r = rows[-1]
            print(f"{model:>4} {name:>7} {n:>6}x{k:<6} M={m:<5} bf16 {tb:9.1f} us  ours {tq:9.1f} us  "
                  f"x{ratio:5.2f}  {r['tbps']:5.2f} TB/s  {r['ceiling_pct']:5.1f}%  {r['path']}"
                  + "".join(f"  | {kn} {t:7.1f} us x{tb / t:5.2f}" for kn, t in others.items()), flush=True)
        del layer
        torch.cuda.empty_cache()
    if out_json:
        Path(out_json).write_text(json.dumps(rows, indent=1))
    return rows


def sweep(models, ms, out_json):
    """Per shape and M: the automatic fused configuration with L2 prefetch 0/2/4 groups, its
    neighbours (weight tiles per warp, K splits), and the dequantize + cuBLAS path."""
    rows = []
    for model, name, n, k in shapes(models):
        layer = Layer(n, k)
        p = layer.fp4[0]
        print(f"{model} {name} {n}x{k}: dequant pass {layer.time_dequant():.1f} us", flush=True)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tb, tl = layer.time_bf16(x), layer.time_large(x)
            _, tnw0, s0, _, _ = gemm.small_config(m, p, x.device)
            pf = {f: layer.time_small(x, tnw0, s0, f) for f in (0, 2, 4)}
            res = {}
            for tnw in {1, 2, tnw0}:
                if (gemm._m_tiles(m), tnw) not in gemm._VARIANTS:
                    continue
                auto = gemm.small_config(m, p, x.device, tnw)[2]
                for splits in {max(1, auto // 2), auto, 2 * auto}:
                    eff = gemm.small_config(m, p, x.device, tnw, splits)[2]
                    if (tnw, eff) not in res:
                        res[(tnw, eff)] = layer.time_small(x, tnw, eff)
            best = min(res.items(), key=lambda kv: kv[1])
            print(f"  M={m:<4} bf16 {tb:7.1f} cuBLAS-path {tl:7.1f} x{tb / tl:4.2f} | auto w{tnw0} s{s0} pf0 {pf[0]:6.1f} "
                  f"pf2 {pf[2]:6.1f} pf4 {pf[4]:6.1f} (x{tb / min(pf.values()):4.2f}) | best w{best[0][0]} s{best[0][1]} "
                  f"{best[1]:6.1f} | fused={gemm.use_fused(m, n, k)}", flush=True)
            rows.append(dict(model=model, layer=name, n=n, k=k, m=m, bf16_us=tb, large_us=tl, auto=[tnw0, s0],
                             prefetch={str(f): v for f, v in pf.items()},
                             fused={f"w{a}s{b}": v for (a, b), v in res.items()}))
        del layer
        torch.cuda.empty_cache()
    if out_json:
        Path(out_json).write_text(json.dumps(rows, indent=1))


def sweep_wg(models, ms, out_json):
    """Per shape and M: bf16, dequantize + cuBLAS, the small kernel (automatic shape, M <= 128), and
    the wgmma kernel with 1 or 2 warpgroups per block or warp-specialized (g3; g4 with columns of 256
    weight rows), whole columns (one
    block each) or columns shared by stream K over 0.5, 1, 1.5 and 2 waves of resident blocks."""
    rows = []
    dev = torch.device("cuda")
    for model, name, n, k in shapes(models):
        layer = Layer(n, k)
        p = layer.fp4[0]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tb, tl = layer.time_bf16(x), layer.time_large(x)
            ts = layer.time_small(x, *gemm.small_config(m, p, x.device)[1:3]) if m <= gemm.SMALL_M_MAX else float("nan")
            bn0 = gemm.wg_config(m, p, dev).bn
            res = {}
            # the automatic block size, half of it (twice the row tiles, whole columns), and the
            # smallest single row tile
            single = [b for b in gemm.WG_BN if b >= m][:1]
            for bn in dict.fromkeys([bn0] + [b for b in (bn0 // 2,) if b in gemm.WG_BN] + single):
                for wg in (1, 2, 3, 4):
                    if (bn, wg) not in gemm._WG_VARIANTS:
                        continue
                    cols = gemm.wg_config(m, p, dev, bn, wg).columns
                    wave = gemm._wg_occupancy(bn, wg) * gemm.sm_count(dev)
                    tries = {cols} if -(-m // bn) > 1 else {cols} | {max(1, round(f * wave)) for f in (0.5, 1, 1.5, 2)}
                    for blocks in sorted(tries):
                        eff = gemm.wg_config(m, p, dev, bn, wg, blocks).blocks
                        if (bn, wg, eff) not in res:
                            res[(bn, wg, eff)] = layer.time_wg(x, bn, wg, eff)
            best = min(res.items(), key=lambda kv: kv[1])
            auto_cfg = gemm.wg_config(m, p, dev)
            t_auto = res.get((auto_cfg.bn, auto_cfg.wg, auto_cfg.blocks), float("nan"))
            cells = " ".join(f"n{c}g{a}b{b}:{v:.1f}" for (c, a, b), v in sorted(res.items()))
            print(f"{model:>4} {name:>7} M={m:<4} bf16 {tb:7.1f} cuBLAS-path {tl:7.1f} small {ts:7.1f} | wg "
                  f"auto n{auto_cfg.bn}g{auto_cfg.wg}b{auto_cfg.blocks}/{auto_cfg.columns} {t_auto:6.1f} "
                  f"x{tb / t_auto:4.2f} best n{best[0][0]}g{best[0][1]}b{best[0][2]} {best[1]:6.1f} "
                  f"x{tb / best[1]:4.2f} (small x{tb / ts:4.2f}, cuBLAS x{tb / tl:4.2f}) | {cells}", flush=True)
            rows.append(dict(model=model, layer=name, n=n, k=k, m=m, bf16_us=tb, large_us=tl, small_us=ts,
                             wg_auto=[auto_cfg.bn, auto_cfg.wg, auto_cfg.blocks, t_auto],
                             wg={f"n{c}g{a}b{b}": v for (c, a, b), v in res.items()}))
        del layer
        torch.cuda.empty_cache()
    if out_json:
        Path(out_json).write_text(json.dumps(rows, indent=1))


def sweep_slices(models, ms, out_json, serial: bool = False):
    """Per shape and M (small kernel only): the automatic configuration, then every count of warps
    per weight tile (1, 2, 4, 8) and weight tiles per warp (1, 2) with K splits giving about a half,
    one, 1.5 and two waves of resident blocks (4 per SM). ``serial``: each call waits for a small
    kernel that waits for the call before (the decode step's order), copy time taken off."""
    rows = []
    dev = torch.device("cuda")
    wave = gemm._RESIDENT * torch.cuda.get_device_properties(0).multi_processor_count
    for model, name, n, k in shapes(models):
        layer = Layer(n, k)
        p = layer.fp4[0]
        for m in ms:
            if m > gemm.SMALL_PATH_MAX:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tb = layer.time_bf16(x)
            auto = gemm.small_config(m, p, dev)
            t_auto = layer.time_small(x, None, None, serial=serial)
            res = {}
            for wpt in (1, 2, 4, 8):
                for tnw in (1, 2):
                    if wpt > 1 and gemm._m_tiles(m) > 2 or (gemm._m_tiles(m), tnw) not in gemm._VARIANTS:
                        continue
                    blocks_x = gemm.small_column_blocks(p, tnw, wpt)
                    for waves in (0.5, 1, 1.5, 2):
                        want = max(1, min(p.kg // wpt, round(waves * wave / blocks_x)))
                        cfg = gemm.small_config(m, p, dev, tnw, want, wpt)
                        key = (cfg.wpt, cfg.tnw, cfg.splits)
                        if key not in res:
                            res[key] = layer.time_small(x, tnw, cfg.splits, wpt=wpt, serial=serial)
            best = min(res.items(), key=lambda kv: kv[1])
            cells = " ".join(f"p{a}w{b}s{c}:{v:.1f}" for (a, b, c), v in sorted(res.items()))
            print(f"{model:>4} {name:>7} M={m:<3} bf16 {tb:6.1f} auto p{auto.wpt}w{auto.tnw}s{auto.splits} {t_auto:6.1f} "
                  f"best p{best[0][0]}w{best[0][1]}s{best[0][2]} {best[1]:6.1f} (x{tb / t_auto:4.2f} -> x{tb / best[1]:4.2f}) "
                  f"| {cells}", flush=True)
            rows.append(dict(model=model, layer=name, n=n, k=k, m=m, bf16_us=tb, auto=list(auto), auto_us=t_auto,
                             configs={f"p{a}w{b}s{c}": v for (a, b, c), v in res.items()}))
        del layer
        torch.cuda.empty_cache()
    if out_json:
        Path(out_json).write_text(json.dumps(rows, indent=1))
    return rows


def profile(spec: str) -> None:
    """A few plain launches of one configuration (n,k,m[,tnw,splits]) for a profiler to catch."""
    n, k, m, *cfg = (int(v) for v in spec.split(","))
    p = random_prepared(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    tnw, splits = (cfg + [None, None])[:2]
    print("config", gemm.small_config(m, p, x.device, tnw, splits))
    for _ in range(3):
        gemm.gemm_small_into(x, p, out, tnw=tnw, splits=splits)
    w = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    gemm.dequant_into(p, w)
    torch.cuda.synchronize()


def summary(rows):
    print("\nsummary: ratio bf16/ours (>1 = faster), rows = layer, columns = M")
    ms = sorted({r["m"] for r in rows})
    print(f"{'layer':>16} " + " ".join(f"{m:>6}" for m in ms))
    keys = dict.fromkeys((r["model"], r["layer"]) for r in rows)
    for model, name in keys:
        by_m = {r["m"]: r["ratio"] for r in rows if r["model"] == model and r["layer"] == name}
        print(f"{model + ' ' + name:>16} " + " ".join(f"{by_m.get(m, float('nan')):6.2f}" for m in ms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b,14b,32b")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-wg", action="store_true")
    ap.add_argument("--sweep-slices", action="store_true")
    ap.add_argument("--serial", action="store_true", help="--sweep-slices: each call after a dependent copy")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="n,k,m[,tnw,splits]: launch one configuration a few times")
    ap.add_argument("--kernels", action="append", default=[],
                    help="name=path: the table also times the NVFP4 kernels built from this nvfp4_gemm.cu (repeat)")
    ap.add_argument("--variant", action="append", default=[],
                    help="name:module.attr=value,...: the table also times ours with these attributes set (repeat)")
    args = ap.parse_args()
    kernels = [kernels_variant(k) for k in args.kernels]  # built (or refused) before any timing
    kernels += [parse_variant(v) for v in args.variant]
    models = args.models.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  SMs "
          f"{torch.cuda.get_device_properties(0).multi_processor_count}  L2 prefetch {gemm.PREFETCH_GROUPS} groups from M={gemm._PREFETCH_MIN_M}", flush=True)
    if args.profile:
        profile(args.profile)
    elif args.sweep:
        sweep(models, ms, args.json)
    elif args.sweep_wg:
        sweep_wg(models, ms, args.json)
    elif args.sweep_slices:
        sweep_slices(models, ms, args.json, args.serial)
    else:
        summary(table(models, ms, args.json, kernels))


if __name__ == "__main__":
    main()
