"""Time and peak GPU memory of one full RL step per model size and base format, under a cap.

One step = rollout of P prompts x G samples (engine.rollout.cuda_graph, sub-batches of
``--rollout-batch``), reward, group advantages, learner log-probs with gradients (gradient
checkpointing, head in row chunks) in micro-batches, DAPO loss (engine.rl.loss), backward
into the LoRA, optimizer step (engine.optim: 8-bit AdamW when bitsandbytes works). Random
weights in Qwen2.5 shapes (engine.model.shapes); the reward is synthetic (share of even token
ids), which costs what a cheap grader costs and gives the groups reward variance. The process
is capped with torch.cuda.set_per_process_memory_fraction (default 80 GiB: an H100 80GB).

    python3 benchmarks/rl_step.py --sizes 7b,32b --methods nvfp4,bf16 --gen 1024 --json out.json
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from engine import memory_plan
from engine.lora import adapter_params, apply_lora, held_pieces
from engine.model.shapes import NumberTokenizer, build_random_model, shape_config
from engine.optim import build_optimizer, uses_eight_bit
from engine.quant.nf4 import bitsandbytes_missing
from engine.rl.advantages import group_advantages
from engine.rl.loss import loss_denominator, policy_loss
from engine.rollout import SamplingParams
from engine.rollout.cuda_graph import GraphRollout
from engine.spec import LoraSpec, OptimSpec, RLSpec, RolloutSpec, TrainSpec
from engine.train_batch import build_batch


def one_step(size: str, method: str, args) -> dict:
    row: dict = {"size": size, "method": method, "prompts": args.prompts, "samples": args.samples,
                 "prompt": args.prompt, "gen": args.gen, "rank": args.rank}
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    over = {"num_layers": args.layers} if args.layers else {}
    model = build_random_model(shape_config(size, **over), quantization=method, device="cuda")
    apply_lora(model, LoraSpec(r=args.rank), seed=0)
    model.gradient_checkpointing = True
    torch.cuda.synchronize()
    row["build_s"] = time.perf_counter() - t
    row["model_gb"] = torch.cuda.memory_allocated() / 2**30
    n = args.prompts * args.samples
    rb = min(args.rollout_batch, n)
    eng = GraphRollout(model, max_batch=rb, max_len=-(-(args.prompt + args.gen) // 256) * 256)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (args.prompt,), generator=g).tolist()
               for _ in range(args.prompts)]
    prompts = [p for p in prompts for _ in range(args.samples)]  # prompt-major groups
    params = SamplingParams(max_new_tokens=args.gen, temperature=1.0, eos_token_ids=[-1])
    tok = NumberTokenizer()
    eng.generate(tok, prompts[:rb], SamplingParams(max_new_tokens=2, eos_token_ids=[-1]))  # warm-up
    eng.capture(rb, args.prompt, args.prompt + args.gen)
    opt = build_optimizer(adapter_params(model), OptimSpec(), "cuda")
    row["optimizer"] = "adamw8bit" if uses_eight_bit(OptimSpec(), "cuda") else "adamw"
    spec = RLSpec(mask_truncated=False)  # every row runs to the length limit here
    torch.cuda.synchronize()

    # the plan a job with these settings gets (engine.memory_plan), beside what the step measures
    job = TrainSpec(quantization=method, lora=LoraSpec(r=args.rank), prompts_per_step=args.prompts,
                    micro_batch_size=args.micro_batch,
                    rollout=RolloutSpec(num_generations=args.samples, max_new_tokens=args.gen, max_batch=rb))
    inputs = memory_plan.PlanInputs(longest_prompt=args.prompt, rollout_rows=n,
                                    eight_bit=row["optimizer"] == "adamw8bit")
    planned = memory_plan.plan(model.config, job, inputs, base=int(row["model_gb"] * 2**30), head_chunk=args.chunk)
    row.update(plan_gb=planned.peak / 2**30, plan=planned.as_dict())
    setup_peak = torch.cuda.max_memory_allocated()  # building and quantizing the model, capturing graphs
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    comps = eng.generate(tok, prompts, params, generator=torch.Generator("cuda").manual_seed(1), max_batch=rb)
    t1 = time.perf_counter()
    rewards = torch.tensor([sum(1 for x in c.token_ids if x % 2 == 0) / max(1, c.num_tokens) for c in comps])
    adv, _ = group_advantages(rewards, args.samples, std_normalize=True, eps=spec.adv_eps)
    batch = build_batch(comps, adv, pad_id=0, device="cuda")
    denom = loss_denominator(batch.loss_mask, spec, truncated=batch.truncated)
    model.train()
    with held_pieces(model):  # as engine.train_loop: the adapter changes only at the optimizer step
        for mb in batch.split(args.micro_batch):
            logp, _ = model.token_logprobs(mb.input_ids, mb.attention_mask, from_position=mb.first_col,
                                           chunk_size=args.chunk)
            loss, _ = policy_loss(logp, logp.detach(), mb.advantages, mb.loss_mask, spec,
                                  sampler_logp=mb.sampler_logp, truncated=mb.truncated, denominator=denom)
            loss.backward()
    torch.nn.utils.clip_grad_norm_(adapter_params(model), 0.2)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    step_peak = torch.cuda.max_memory_allocated()
    row.update(rollout_s=t1 - t0, train_s=t2 - t1, step_s=t2 - t0, peak_gb=max(setup_peak, step_peak) / 2**30,
               step_peak_gb=step_peak / 2**30, step_reserved_gb=torch.cuda.max_memory_reserved() / 2**30,
               tokens=sum(c.num_tokens for c in comps), rollout_tok_s=sum(c.num_tokens for c in comps) / (t1 - t0))
    del eng, model, opt, batch
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7b,32b")
    ap.add_argument("--methods", default="nvfp4,bf16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rollout-batch", type=int, default=32,
                    help="sequences decoded together (the memory and time this trades: benchmarks/RESULTS.md, "
                         "One RL step under an 80 GB cap)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--cap-gb", type=float, default=80.0)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 2**30 / total))
    start = time.perf_counter()
    rows, skipped = [], []
    for size in args.sizes.split(","):
        for method in args.methods.split(","):
            if args.deadline and time.perf_counter() - start > args.deadline:
                skipped.append(f"{size} {method}: out of time")
                continue
            missing = bitsandbytes_missing("cuda") if method == "nf4" else None
            if missing:  # the torch fallback is no QLoRA baseline
                skipped.append(f"{size} nf4: {missing}")
                print("skipped", skipped[-1], flush=True)
                continue
            try:
                row = one_step(size, method, args)
            except torch.cuda.OutOfMemoryError as exc:
                row = {"size": size, "method": method, "oom": str(exc)[:400],
                       "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"cap_gb": args.cap_gb, "args": vars(args), "rows": rows, "skipped": skipped}, f, indent=1)
    print(f"\nsize method   step s  rollout s  train s  peak GiB (cap {args.cap_gb:.0f})  step: peak  reserved  planned")
    for r in rows:
        if "oom" in r:
            print(f"{r['size']:>4} {r['method']:>6}  out of memory at {r['peak_gb']:.1f} GiB")
        else:
            print(f"{r['size']:>4} {r['method']:>6} {r['step_s']:>8.1f} {r['rollout_s']:>10.1f} {r['train_s']:>8.1f} "
                  f"{r['peak_gb']:>9.1f} {r['step_peak_gb']:>17.1f} {r['step_reserved_gb']:>9.1f} {r['plan_gb']:>8.1f}")
    for s in skipped:
        print("skipped:", s)


if __name__ == "__main__":
    main()
