#!/usr/bin/env bash
# The GPU measurements behind benchmarks/RESULTS.md, in priority order, each stage only while the time budget
# (BUDGET seconds) lasts. bitsandbytes must be importable for the QLoRA baseline and 8-bit AdamW.
# Usage (repository root, on the GPU machine): OUT=dir BUDGET=540 bash benchmarks/run_gpu.sh
set -u
OUT=${OUT:-out}; BUDGET=${BUDGET:-540}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QERL_CACHE_DIR=${QERL_CACHE_DIR:-$PWD/.gpucache}
left() { echo $((BUDGET - SECONDS)); }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/smi.txt" 2>&1
timeout 200 python3 -m pytest tests/test_gpu_path.py tests/test_rollout_cuda_graph.py tests/test_kernels_gpu.py -q \
  -p no:cacheprovider --noconftest > "$OUT/test.log" 2>&1
tail -3 "$OUT/test.log"
timeout 200 python3 benchmarks/gemm_nvfp4.py --json "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1
timeout $(( $(left) - 20 )) python3 benchmarks/rollout.py --sizes 7b,32b --methods nvfp4,bf16,nf4 --batches 1,8 \
  --ranks 16 --gen 256 --bandwidth --deadline $(( $(left) - 90 )) --json "$OUT/rollout.json" > "$OUT/rollout.log" 2>&1
if [ "$(left)" -gt 150 ]; then
  timeout $(( $(left) - 10 )) python3 benchmarks/rl_step.py --sizes 32b,72b --methods nvfp4 --gen 1024 \
    --deadline $(( $(left) - 140 )) --json "$OUT/rl_step.json" > "$OUT/rl_step.log" 2>&1
fi
if [ "$(left)" -gt 120 ]; then
  timeout $(( $(left) - 5 )) python3 benchmarks/rollout.py --sizes 7b --methods hf --batches 1,8 --ranks 0 --gen 256 \
    --json "$OUT/rollout_hf.json" > "$OUT/rollout_hf.log" 2>&1
fi
echo "=== test"; tail -5 "$OUT/test.log"
echo "=== gemm"; tail -12 "$OUT/gemm.log"
for f in rollout rl_step rollout_hf; do [ -f "$OUT/$f.log" ] && { echo "=== $f"; grep -v '^{' "$OUT/$f.log" | grep -v '^   ' | tail -30; }; done
echo "elapsed ${SECONDS}s"
