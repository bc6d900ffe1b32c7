"""Rollout tokens/s on one GPU: NVFP4 vs bf16 base vs QLoRA (NF4, bitsandbytes kernels), same
graph engine, random weights in Qwen2.5 shapes (engine.model.shapes), and Hugging Face
transformers' own ``generate`` (static cache) as an outside reference (method ``hf``, no LoRA).

For each size and method the model is built once on the GPU; then for each LoRA rank (0 = no
adapter) and batch, B random prompts of ``--prompt`` tokens generate ``--gen`` tokens each
(temperature 1, no eos, so every row runs to the end) through engine.rollout.cuda_graph, after
a warm-up that captures the graphs. Reported: total tokens/s (prefill included), decode
tokens/s, peak memory, and NVFP4's ratio over bf16 and over NF4. ``--bandwidth`` also measures the
device-to-device copy bandwidth and the batch-1 bytes read per decode token (weights as the
kernels read them, LoRA, lm_head, KV) to give the bandwidth limit.

    python3 benchmarks/rollout.py --sizes 7b,32b --methods nvfp4,bf16,nf4 --batches 1,8 --ranks 16 --gen 256 \
        --bandwidth --json out.json
    python3 benchmarks/rollout.py --sizes 7b --methods hf --batches 1,8 --ranks 0 --gen 256

``--profile`` prints, for batch 1 and 8, where a few replayed decode steps spend their time
(torch.profiler's kernel trace; each kernel's end minus the latest end before it, which with
programmatic dependent launch is its share of the step), grouped by kind (GEMM, LoRA, attention,
element-wise, sampling), per position in a layer and, for the kernels outside the layers, per
step; the wall time, GPU time, top kernels and top host ops of one eager prefill (and its wall
time replayed from a graph, where small enough); and, timed without the profiler (CUDA events),
the step's graph replayed back to back, the same with the sampler between replays, against the
rollout's own ms per step: what sampling, the graph boundary and the host's reads add to a step.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from engine.lora import LoRALinear, adapter_params, apply_lora
from engine.model.shapes import NumberTokenizer, build_random_model, shape_config
from engine.quant.nf4 import bitsandbytes_missing
from engine.rollout import SamplingParams, cuda_graph
from engine.rollout.cuda_graph import GraphRollout
from engine.spec import LoraSpec


def copy_bandwidth(gb: float = 4.0) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = int(gb * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n * 2 / sorted(times)[len(times) // 2]


def remove_lora(model) -> None:
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, m in list(parent.named_children()):
                if isinstance(m, LoRALinear):
                    setattr(parent, name, m.base)
    model.__dict__.pop("lora_spec", None)


def set_lora(model, r: int, seed: int = 0) -> None:
    remove_lora(model)
    if r > 0:
        apply_lora(model, LoraSpec(r=r), seed=seed)
        with torch.no_grad():
            g = torch.Generator(device=adapter_params(model)[0].device).manual_seed(seed)
            for p in adapter_params(model):
                if p.shape[1] == r:  # B is zero at init; a trained adapter is not
                    p.normal_(0, 1e-3, generator=g)


def bytes_per_token(eng: GraphRollout, b: int, s: int) -> dict[str, int]:
    """Bytes one decode step reads: base weights as stored for the GEMM, LoRA, lm_head, KV."""
    w = lora = 0
    for L in eng.layers:
        for g in (L.qkv, L.o, L.gu, L.down):
            if g.mode == "nvfp4":
                w += g.prepared.wq.numel() * 4
            elif g.mode == "dense":
                w += g.weight.numel() * g.weight.element_size()
            else:
                w += sum(p.numel() * p.element_size() for bb in g.bases for p in bb.buffers())
            if g.lora:
                lora += (g.a_cat.numel() + g.b_pack.numel()) * 4
    cfg = eng.cfg
    head = eng.model.lm_head.weight
    kv = b * cfg.num_layers * 2 * cfg.num_kv_heads * s * cfg.head_dim * 2
    return {"weights": w, "lora": lora, "lm_head": head.numel() * head.element_size(), "kv": kv}


def kernel_kind(name: str) -> str:
    """A CUDA kernel's role in a decode step, from its name."""
    n = name.lower()
    if "nvfp4" in n or "gemm_small" in n or "gemm_wg" in n or "dequant_kernel" in n:
        return "GEMM nvfp4"
    if "4bit" in n:
        return "GEMM nf4"
    if any(p in n for p in ("attention", "fmha", "flash")):
        return "attention"
    if any(p in n for p in ("gemm", "gemv", "xmma", "cutlass", "nvjet", "dot_kernel", "splitk")):
        bf16 = any(p in n for p in ("bf16", "bfloat16", "hmma", "_h16", "s16816", "_h_", "_tnt", "_tnn"))
        return "GEMM bf16" if bf16 else "GEMM fp32 (LoRA)"
    if any(p in n for p in ("softmax", "multinomial", "exponential", "sort", "argmax", "cumsum", "distribution")):
        return "sampling"
    if "qerl" in n:
        return "fused element-wise"
    return "other"


def _trace_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel of a profile, by start time (its chrome trace)."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    ks = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ks]


def critical_path(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """Each kernel's share of the stream's time: its end minus the latest end before it (0 when
    it ends inside an earlier one). With programmatic dependent launch a kernel starts while its
    predecessor drains, so its own duration also counts the wait; these shares add up to the span."""
    out, last = [], kernels[0][1] if kernels else 0.0
    for name, _, end in kernels:
        out.append((name, max(0.0, end - last)))
        last = max(last, end)
    return out


def profile_steps(eng: GraphRollout, tok, prompts, args, steps: int = 16) -> dict:
    """Where a replayed decode step's time goes: each kernel's share of the critical path
    (``critical_path``) over ``steps`` steps (a rollout of ``steps`` + 1 tokens minus the kernels of
    one of 1 token, the prefill), by kind, per position in a layer (from one attention kernel to
    the next, averaged over layers and steps), and for the kernels outside the layers per step."""
    from torch.profiler import ProfilerActivity, profile

    def shares(n: int) -> list[tuple[str, float]]:
        params = SamplingParams(max_new_tokens=n, temperature=1.0, eos_token_ids=[-1])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.generate(tok, prompts, params, generator=torch.Generator("cuda").manual_seed(9))
            torch.cuda.synchronize()
        return critical_path(_trace_kernels(prof))

    first, total = shares(1), shares(steps + 1)
    decode = total[len(first):]  # the prefill and first sample run the same kernels in both
    kinds: dict[str, float] = {}
    for name, us in decode:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us / 1e3 / steps
    by_kind = {k: v for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}  # ms per decode step
    print(f"profile B={len(prompts)} critical path, ms/decode step by kind:",
          {k: round(v, 3) for k, v in by_kind.items()}, f"sum {sum(by_kind.values()):.3f}", flush=True)
    anchors = [i for i, (name, _) in enumerate(decode) if kernel_kind(name) == "attention"]
    per: dict[tuple[int, str], list[float]] = {}
    for i, j in zip(anchors, anchors[1:]):
        if j - i <= 40:  # within a step (the last layer's tail and the sampling break the pattern)
            for pos in range(i, j):
                per.setdefault((pos - i, decode[pos][0]), []).append(decode[pos][1])
    layer = [{"pos": pos, "us": sum(v) / len(v), "count": len(v), "kernel": name[:90], "kind": kernel_kind(name)}
             for (pos, name), v in sorted(per.items()) if len(v) >= len(anchors) // 3]
    print(f"   per layer (us on the critical path, from the attention kernel): {sum(x['us'] for x in layer):.1f}",
          flush=True)
    for x in layer:
        print(f"   {x['pos']:3d} {x['us']:7.2f} us  {x['kind']:<18} {x['kernel']}", flush=True)
    layers = eng.cfg.num_layers
    calls: dict[str, list[float]] = {}
    for name, us in decode:
        calls.setdefault(name, []).append(us)
    # kernels that run fewer times a step than there are layers: the step's own (gathers, lm_head,
    # copies, sampling), with their calls a step and us a step on the critical path
    outside = [{"kernel": name[:90], "kind": kernel_kind(name), "calls": len(v) / steps, "us": sum(v) / steps}
               for name, v in calls.items() if len(v) < max(2, layers - 1) * steps]
    outside.sort(key=lambda x: -x["us"])
    print(f"   outside the layers (us a step on the critical path): {sum(x['us'] for x in outside):.1f}", flush=True)
    for x in outside:
        print(f"   {x['calls']:5.2f}/step {x['us']:8.2f} us  {x['kind']:<18} {x['kernel']}", flush=True)
    return {"ms_per_step_by_kind": by_kind, "layer": layer, "outside": outside}


def step_overhead(eng: GraphRollout, b: int, slot: int, replays: int = 128) -> dict:
    """ms a step of the step's graph (bucket b, write column ``slot`` onwards) replayed back to
    back, and the same with the sampler between replays (as a rollout runs it), timed by CUDA
    events (wall clock on CPU) without the profiler. Leaves garbage in the cache."""
    from engine.rollout.sampler import sample_next

    cuda = eng.device.type == "cuda"
    replays = max(1, min(replays, eng.max_len - slot - 1))
    gen = torch.Generator(eng.device).manual_seed(0)
    out = {}

    def rewind():  # every replay moves the write column and the positions on by one
        eng.slot.fill_(slot)
        eng.pos.fill_(slot)

    with torch.no_grad():
        eng.refresh()
        for mode in ("replay", "replay+sample"):
            rewind()
            eng._run_step(b, slot)  # captures the graph if it is new, outside the timing
            rewind()
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                e0.record()
            t0 = time.perf_counter()
            for _ in range(replays):
                if mode == "replay+sample":
                    sample_next(eng.logits[:b], temperature=1.0, top_p=1.0, top_k=0, generator=gen, tokens_into=eng.tok)
                eng._run_step(b, slot)  # the same graph: the attention length of the first column
            if cuda:
                e1.record()
                torch.cuda.synchronize()
                out[mode] = e0.elapsed_time(e1) / replays
            else:
                out[mode] = (time.perf_counter() - t0) * 1e3 / replays
    print(f"step overhead B={b}: graph replays {out['replay']:.4f} ms a step, with the sampler between them "
          f"{out['replay+sample']:.4f}", flush=True)
    return out


def profile_prefill(eng: GraphRollout, prompts) -> dict:
    """Wall time, GPU kernel time and the top kernels and host ops of one prefill (the
    left-padded prompts into the engine's cache, as a rollout runs it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from engine.rollout.batching import left_pad

    ids, mask = left_pad(prompts, 0)
    ids, mask = ids.cuda(), mask.cuda()

    def once():
        with torch.no_grad():
            eng.refresh()
            eng._prefill(ids, mask)

    once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    once()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        once()
        torch.cuda.synchronize()
    events = prof.key_averages()
    dev = lambda ev: getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)  # noqa: E731
    # kernels only: the host op that launched a kernel carries its time too, and would count it twice
    gpu = [ev for ev in events if ev.device_type == DeviceType.CUDA and dev(ev) > 0]
    gpu_ms = sum(dev(ev) for ev in gpu) / 1e3
    kernels = sorted(gpu, key=lambda ev: -dev(ev))[:12]
    host = sorted((ev for ev in events if ev.device_type == DeviceType.CPU), key=lambda ev: -ev.self_cpu_time_total)[:12]
    graph_ms = None
    if eng.use_graphs and ids.numel() <= cuda_graph.PREFILL_GRAPH_ROWS:  # the same prefill replayed from its graph
        with torch.no_grad():
            eng.refresh()
            eng._run_prefill(ids, mask, capture=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng._run_prefill(ids, mask)
            torch.cuda.synchronize()
        graph_ms = (time.perf_counter() - t0) * 1e3
    print(f"prefill B={len(prompts)} x {ids.shape[1]}: wall {wall * 1e3:.1f} ms, GPU kernels {gpu_ms:.1f} ms"
          + (f", as a graph replay {graph_ms:.1f} ms" if graph_ms is not None else ""), flush=True)
    for ev in kernels:
        print(f"   gpu {dev(ev) / 1e3:8.2f} ms {ev.count:6d}x  {ev.key[:100]}", flush=True)
    for ev in host:
        print(f"   cpu {ev.self_cpu_time_total / 1e3:8.2f} ms {ev.count:6d}x  {ev.key[:100]}", flush=True)
    return {"wall_ms": wall * 1e3, "gpu_ms": gpu_ms, "graph_ms": graph_ms,
            "kernels": [(ev.key[:100], dev(ev) / 1e3, ev.count) for ev in kernels],
            "host": [(ev.key[:100], ev.self_cpu_time_total / 1e3, ev.count) for ev in host]}


def run_hf(size: str, b: int, args, log) -> dict:
    """Hugging Face transformers' generate with a static cache (bf16, no LoRA), same prompts."""
    import transformers

    cfg = shape_config(size, **({"num_layers": args.layers} if args.layers else {}))
    hf_cfg = transformers.Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                                      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                      rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                                      max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(b)
    ids = torch.randint(1, cfg.vocab_size, (b, args.prompt), generator=g).cuda()
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, cache_implementation="static",
              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.gen, min_new_tokens=args.gen, **kw)  # warm-up (compiles)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.gen, min_new_tokens=args.gen, **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    tokens = (out.shape[1] - args.prompt) * b
    row = {"size": size, "method": "hf", "rank": 0, "batch": b, "prompt": args.prompt, "gen": args.gen,
           "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "decode_tok_s": 0.0, "ms_per_step": 0.0,
           "peak_gb": torch.cuda.max_memory_allocated() / 2**30, "transformers": transformers.__version__}
    del model
    log(row)
    return row


def run_config(model, method: str, size: str, r: int, b: int, args, log) -> dict:
    cuda = args.device == "cuda"
    g = torch.Generator().manual_seed(b)
    prompts = [torch.randint(1, model.config.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(b)]
    params = SamplingParams(max_new_tokens=args.gen, temperature=1.0, eos_token_ids=[-1])
    max_len = -(-(args.prompt + args.gen) // 256) * 256
    eng = GraphRollout(model, max_batch=b, max_len=max_len)
    tok = NumberTokenizer()
    warm = SamplingParams(max_new_tokens=min(args.gen, 4), temperature=1.0, eos_token_ids=[-1])
    eng.generate(tok, prompts, warm, generator=torch.Generator(args.device).manual_seed(0))
    eng.capture(b, args.prompt, args.prompt + args.gen, prompts=b)  # decode graphs; the prefill's where small
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    best = None
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        out = eng.generate(tok, prompts, params, generator=torch.Generator(args.device).manual_seed(rep))
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        st = eng.stats
        row = {"size": size, "method": method, "rank": r, "batch": b, "prompt": args.prompt, "gen": args.gen,
               "tokens": sum(c.num_tokens for c in out), "wall_s": wall, "prefill_s": st.prefill_s,
               "decode_s": st.decode_s, "steps": st.steps, "captured_in_run": st.graphs_captured,
               "ops": st.ops, "attention": st.attention, "graphs": st.graphs}
        row["tok_s"] = row["tokens"] / wall
        row["decode_tok_s"] = b * st.steps / st.decode_s if st.decode_s else 0.0
        row["ms_per_step"] = 1e3 * st.decode_s / max(1, st.steps)
        row.update(st.extra)
        if best is None or row["wall_s"] < best["wall_s"]:
            best = row
    best["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    # the graphs' pools (held since capture) are reserved, not allocated, between replays
    best["reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
    if args.bandwidth and b == 1:
        best["bytes"] = bytes_per_token(eng, b, max_len)
    if args.profile and b in (1, 8):
        if cuda:
            best["profile"] = profile_steps(eng, tok, prompts, args)
            best["profile_prefill"] = profile_prefill(eng, prompts)
        best["step_overhead"] = step_overhead(eng, b, args.prompt)
        print(f"   a rollout's step: {best['ms_per_step']:.4f} ms", flush=True)
    del eng
    log(best)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7b,32b")
    ap.add_argument("--methods", default="nvfp4,bf16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ranks", default="16")
    ap.add_argument("--extra-batches", default="", help="run after the main batches while time is left")
    ap.add_argument("--extra-ranks", default="", help="run (main batches) after the rest while time is left")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (quick runs)")
    ap.add_argument("--bandwidth", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="GPU time by kernel kind at batch 1 and 8, and what sampling adds to a step")
    ap.add_argument("--deadline", type=float, default=0, help="seconds; skip configs once past it")
    ap.add_argument("--json", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a functional dry run (no timings worth reading)")
    args = ap.parse_args()
    start = time.perf_counter()
    cuda = args.device == "cuda"
    results: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "args": vars(args),
                     "rows": [], "skipped": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    def log(row):
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()

    def late() -> bool:
        return bool(args.deadline) and time.perf_counter() - start > args.deadline

    if args.bandwidth and cuda:
        results["copy_bw"] = copy_bandwidth()
        print(f"copy bandwidth {results['copy_bw'] / 1e12:.2f} TB/s", flush=True)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    for size in args.sizes.split(","):
        for method in args.methods.split(","):
            if late():
                results["skipped"].append(f"{size} {method}: out of time")
                continue
            if method == "hf":
                for b in ints(args.batches):
                    if late():
                        results["skipped"].append(f"{size} hf b={b}: out of time")
                        continue
                    try:
                        run_hf(size, b, args, log)
                    except Exception as exc:  # an outside baseline: report and go on
                        results["skipped"].append(f"{size} hf b={b}: {type(exc).__name__}: {exc}"[:500])
                        print("FAILED", results["skipped"][-1], flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                continue
            missing = bitsandbytes_missing(args.device) if method == "nf4" and cuda else None
            if missing:  # the torch fallback is no QLoRA baseline: say so rather than time it
                results["skipped"].append(f"{size} nf4: {missing}")
                print("skipped", results["skipped"][-1], flush=True)
                continue
            t0 = time.perf_counter()
            over = {"num_layers": args.layers} if args.layers else {}
            model = build_random_model(shape_config(size, **over), quantization=method, device=args.device)
            mem = 0.0
            if cuda:
                torch.cuda.synchronize()
                mem = torch.cuda.memory_allocated() / 2**30
            print(f"built {size} {method} in {time.perf_counter() - t0:.1f}s, {mem:.1f} GiB", flush=True)
            plan = [(r, b) for r in ints(args.ranks) for b in ints(args.batches)]
            plan += [(r, b) for r in ints(args.ranks) for b in ints(args.extra_batches)]
            plan += [(r, b) for r in ints(args.extra_ranks) for b in ints(args.batches)]
            current = None
            for r, b in plan:
                if late():
                    results["skipped"].append(f"{size} {method} r={r} b={b}: out of time")
                    continue
                if r != current:
                    set_lora(model, r)
                    current = r
                try:
                    run_config(model, method, size, r, b, args, log)
                except torch.cuda.OutOfMemoryError as exc:
                    results["skipped"].append(f"{size} {method} r={r} b={b}: out of memory ({exc})"[:300])
                except Exception as exc:  # keep measuring the other configurations
                    results["skipped"].append(f"{size} {method} r={r} b={b}: {type(exc).__name__}: {exc}"[:500])
                    print("FAILED", results["skipped"][-1], flush=True)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    save()
    summarize(results)


def _ratio(rows: list[dict], x: dict, method: str, key: str) -> str:
    ref = [y for y in rows if y["method"] == method and all(y[k] == x[k] for k in ("size", "rank", "batch"))]
    return f"{x[key] / ref[0][key]:.2f}x" if ref and ref[0][key] else "-"


def summarize(results: dict) -> None:
    rows = results["rows"]
    print("\nsize method  r   B  tok/s(total)  tok/s(decode)  ms/step  peak GiB  nvfp4/bf16 total (decode)  nvfp4/nf4 total")
    for x in rows:
        ratios = ""
        if x["method"] == "nvfp4":
            ratios = (f"{_ratio(rows, x, 'bf16', 'tok_s')} ({_ratio(rows, x, 'bf16', 'decode_tok_s')})  "
                      f"{_ratio(rows, x, 'nf4', 'tok_s')}")
        print(f"{x['size']:>4} {x['method']:>6} {x['rank']:>2} {x['batch']:>3} {x['tok_s']:>12.1f} "
              f"{x['decode_tok_s']:>14.1f} {x['ms_per_step']:>8.2f} {x['peak_gb']:>9.1f}  {ratios}")
        if "bytes" in x and "copy_bw" in results:
            total = sum(x["bytes"].values())
            limit = results["copy_bw"] / total
            print(f"     bytes/token {total / 1e9:.2f} GB ({', '.join(f'{k} {v / 1e9:.2f}' for k, v in x['bytes'].items())})"
                  f" -> limit {limit:.0f} tok/s at {results['copy_bw'] / 1e12:.2f} TB/s; "
                  f"decode reaches {x['decode_tok_s'] / limit:.0%}")
    for s in results["skipped"]:
        print("skipped:", s)


if __name__ == "__main__":
    main()
