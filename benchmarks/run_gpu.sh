#!/usr/bin/env bash
# The GPU session behind the GPU section of benchmarks/RESULTS.md: correctness first, then the measurements in
# priority order, each stage only while the session's time budget (BUDGET seconds) lasts.
# Usage (repository root, on the GPU machine): OUT=dir BUDGET=480 bash benchmarks/run_gpu.sh
set -u
OUT=${OUT:-out}; BUDGET=${BUDGET:-480}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 QERL_CACHE_DIR=${QERL_CACHE_DIR:-$PWD/.gpucache}
left() { echo $((BUDGET - SECONDS)); }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/smi.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/smi.txt" 2>&1
timeout 120 python3 -m pytest tests/test_rollout_cuda_graph.py -k gpu -q -p no:cacheprovider --noconftest > "$OUT/test.log" 2>&1
tail -3 "$OUT/test.log"
timeout $(( $(left) - 20 )) python3 benchmarks/rollout.py --sizes 7b,32b --batches 1,8 --ranks 16 --extra-ranks 0 \
  --bandwidth --deadline $(( $(left) - 90 )) --json "$OUT/rollout_main.json" > "$OUT/rollout_main.log" 2>&1
if [ "$(left)" -gt 100 ]; then
  timeout $(( $(left) - 10 )) python3 benchmarks/rl_step.py --sizes 7b,32b --methods nvfp4,bf16 --gen 256 \
    --deadline $(( $(left) - 80 )) --json "$OUT/rl_step.json" > "$OUT/rl_step.log" 2>&1
fi
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 5 )) python3 benchmarks/rollout.py --sizes 14b --batches 1,8,32 --ranks 16 \
    --deadline $(( $(left) - 45 )) --json "$OUT/rollout_14b.json" > "$OUT/rollout_14b.log" 2>&1
fi
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 5 )) python3 benchmarks/rollout.py --sizes 7b,32b --batches 32,64 --ranks 16 \
    --deadline $(( $(left) - 45 )) --json "$OUT/rollout_big.json" > "$OUT/rollout_big.log" 2>&1
fi
echo "=== test"; tail -15 "$OUT/test.log"
for f in rl_step rollout_14b rollout_big rollout_main; do [ -f "$OUT/$f.log" ] && { echo "=== $f"; grep -v '^{' "$OUT/$f.log" | tail -40; }; done
echo "elapsed ${SECONDS}s"
