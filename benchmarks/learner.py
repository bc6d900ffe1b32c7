"""The learner's half of an RL step, per base format side by side: time, tokens/s and peak GPU
memory of one micro-batch's log-probs with gradients (gradient checkpointing, head in row
chunks), policy loss and backward into the LoRA, as benchmarks/rl_step.py runs it; with
``--profile``, where the GPU time of one micro-batch goes (kernels grouped by name).

Random weights in Qwen2.5 shapes (``--layers`` cuts the depth for a quick run, the head and
embeddings stay; ``--shape`` overrides other fields), random token ids. ``--ragged``: the rows'
completions end at different lengths (right padding, as engine.train_batch lays them out)
instead of all at the limit. ``--lora-branch off`` times the LoRA branch written in fp32. The
adapter's weight pieces are held over the timed micro-batches, as a step holds them over its own
(engine.lora.held_pieces).

    python3 benchmarks/learner.py --sizes 7b --methods nvfp4,bf16 --layers 8 --profile
"""
from __future__ import annotations

import argparse
import ast
import gc
import json
import time
from collections import defaultdict

import torch

from engine.lora import adapter_params, apply_lora, held_pieces
from engine.model.shapes import build_random_model, shape_config
from engine.quant.nf4 import bitsandbytes_missing
from engine.rl.loss import loss_denominator, policy_loss
from engine.spec import LoraSpec, RLSpec


def _batch(cfg, rows: int, prompt: int, gen: int, ragged: bool, device: str):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(0)
    t = prompt + gen
    ids = torch.randint(1, cfg.vocab_size, (rows, t), generator=g)
    mask = torch.ones(rows, t, dtype=torch.long)
    lens = [t] * rows
    if ragged:  # completions of 1/4 .. 4/4 of the limit
        lens = [prompt + gen * (1 + i % 4) // 4 for i in range(rows)]
        for i, n in enumerate(lens):
            mask[i, n:] = 0
            ids[i, n:] = 0
    loss_mask = torch.zeros(rows, t - 1)
    for i, n in enumerate(lens):
        loss_mask[i, prompt - 1:n - 1] = 1.0
    adv = torch.randn(rows, generator=g)
    return ids.to(device), mask.to(device), loss_mask.to(device), adv.to(device)


def _micro_batch(model, ids, mask, loss_mask, adv, prompt: int, chunk: int) -> None:  # noqa: ANN001
    """rl_step.py's learner pass for one micro-batch: log-probs, the DAPO loss, backward."""
    spec = RLSpec(mask_truncated=False)
    logp, _ = model.token_logprobs(ids, mask, from_position=prompt - 1, chunk_size=chunk)
    loss, _ = policy_loss(logp, logp.detach(), adv, loss_mask, spec, denominator=loss_denominator(loss_mask, spec))
    loss.backward()


def _profile(fn, top: int) -> dict:
    """GPU time of fn() by kernel name (the longest ``top``) and in all."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            by[e.name][1] += 1
    total = sum(v[0] for v in by.values())
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gpu_ms": total / 1e3,
            "kernels": [{"name": k[:120], "ms": v[0] / 1e3, "calls": v[1], "share": v[0] / total} for k, v in rows]}


def one(size: str, method: str, args) -> dict:  # noqa: ANN001
    row: dict = {"size": size, "method": method, "lora_branch": args.lora_branch, "branch_add": args.branch_add,
                 "layers": args.layers, "rows": args.micro_batch, "tokens": args.micro_batch * (args.prompt + args.gen),
                 "ragged": args.ragged}
    over = {k: ast.literal_eval(v) for k, v in (x.split("=") for x in args.shape.split(",") if x)}
    if args.layers:
        over["num_layers"] = args.layers
    cfg = shape_config(size, **over)
    model = build_random_model(cfg, quantization=method, device=args.device)
    apply_lora(model, LoraSpec(r=args.rank), seed=0)
    for p in adapter_params(model):  # B = 0 would leave half the LoRA gradients zero
        if p.shape[1] == args.rank:
            torch.nn.init.normal_(p, std=1e-3)
    model.gradient_checkpointing = True
    model.train()
    ids, mask, loss_mask, adv = _batch(cfg, args.micro_batch, args.prompt, args.gen, args.ragged, args.device)
    step = lambda: _micro_batch(model, ids, mask, loss_mask, adv, args.prompt, args.chunk)  # noqa: E731
    cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with held_pieces(model):  # as a step holds them over its micro-batches (engine.train_loop)
        step()  # warm-up: kernels built, workspaces made (and the LoRA weights' pieces)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        times.sort()
        row["ms"] = times[len(times) // 2] * 1e3
        row["tok_s"] = row["tokens"] / times[len(times) // 2]
        row["peak_extra_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
        if args.profile and cuda:
            row["profile"] = _profile(step, args.top)
    for p in adapter_params(model):
        p.grad = None
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7b")
    ap.add_argument("--methods", default="nvfp4,bf16")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ragged", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a functional dry run (with --shape overrides)")
    ap.add_argument("--shape", default="", help="shape overrides, e.g. hidden_size=256,intermediate_size=512")
    ap.add_argument("--lora-branch", default="auto", choices=("auto", "on", "off"),
                    help="engine.lora.SPLIT_BRANCH: the LoRA branch as bf16-piece GEMMs (auto: on CUDA) or in fp32")
    ap.add_argument("--branch-add", default="addmm", choices=("addmm", "add"),
                    help="engine.lora.BRANCH_ADD: how the piece GEMMs' delta joins the base output")
    args = ap.parse_args()
    import engine.lora

    engine.lora.SPLIT_BRANCH = args.lora_branch
    engine.lora.BRANCH_ADD = args.branch_add
    rows = []
    for size in args.sizes.split(","):
        for method in args.methods.split(","):
            missing = bitsandbytes_missing("cuda") if method == "nf4" else None
            if missing:  # the torch fallback is no QLoRA baseline
                print(f"skipped {size} nf4: {missing}", flush=True)
                continue
            row = one(size, method, args)
            rows.append(row)
            brief = {k: v for k, v in row.items() if k != "profile"}
            print(json.dumps(brief), flush=True)
            if "profile" in row:
                p = row["profile"]
                print(f"  GPU time of one micro-batch: {p['gpu_ms']:.1f} ms")
                for k in p["kernels"]:
                    print(f"  {k['ms']:9.2f} ms {100 * k['share']:5.1f}% {k['calls']:6d}x  {k['name']}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"\nsize method  layers  ms/micro-batch  tokens/s  peak extra GiB")
    for r in rows:
        print(f"{r['size']:>4} {r['method']:>6} {r['layers'] or 'all':>7} {r['ms']:>15.1f} {r['tok_s']:>9.0f} "
              f"{r['peak_extra_gb']:>15.2f}")
    by = {(r["size"], r["method"]): r for r in rows}
    for size in args.sizes.split(","):
        if (size, "nvfp4") in by and (size, "bf16") in by:
            ratio = by[size, "nvfp4"]["tok_s"] / by[size, "bf16"]["tok_s"]
            print(f"{size}: nvfp4 / bf16 learner tokens/s {ratio:.2f}x")


if __name__ == "__main__":
    main()
