#!/usr/bin/env bash
# The few-token MoE GEMVs (minisgl/kernels/moe_gemv.py) in one GPU call, each step only while BUDGET seconds last:
#  1. their GPU tests (qwen3-30b-a3b shapes, CUDA-graph replay, one compile for every T), the CPU kernel tests
#     compiled in bf16, and the split-K GEMV's (it shares last_to_arrive with them);
#  2. benchmarks/moe.py at qwen3-30b-a3b TP 1, FP8 with --small-sweep (fused vs few-token per T, the best tiles),
#     then bf16;
#  3. W2 of qwen3-30b-a3b FP8 (dummy weights) without and with the path: MINISGL_SMALL_MOE_MAX_TOKENS=0 and 4.
# A table last. Carry .bench_models (the real configs).
#
#   OUT=/tmp/moegemv BUDGET=540 bash benchmarks/moe_gemv_session.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MINISGL_TEST_DEVICE=cuda
out=${OUT:-/tmp/minisgl-moegemv}; mkdir -p "$out"
budget=${BUDGET:-540}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
log() { echo "$* [$SECONDS s]" | tee -a "$out/steps.txt"; }
fits() { [ $((budget - SECONDS)) -ge "$1" ] || { log "skipped $2: $((budget - SECONDS)) s left"; false; }; }

timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gemv_full_size.py tests/kernels/test_moe_gemv.py \
  tests/kernels/test_gemv.py > "$out/tests.log" 2>&1
log "tests: $(tail -1 "$out/tests.log")"

fits 150 "moe.py --fp8" && { (cd benchmarks && timeout 240 python3 moe.py --fp8 --inter 768 --small-sweep \
  --tokens 1 2 4 8 16) > "$out/moe_fp8.log" 2>&1; log "moe.py --fp8: exit $?"; }
fits 60 "moe.py bf16" && { (cd benchmarks && timeout 90 python3 moe.py --inter 768 --tokens 1 2 4 8) \
  > "$out/moe_bf16.log" 2>&1; log "moe.py bf16: exit $?"; }

config=.bench_models/qwen3-30b-a3b-fp8.json
for limit in 0 4; do
  [ -f "$config" ] || { log "no $config: W2 skipped"; break; }
  fits 90 "W2 small<=$limit" || continue
  MINISGL_SMALL_MOE_MAX_TOKENS=$limit timeout 240 python3 benchmarks/offline.py --config "$config" --workload w2 \
    > "$out/w2_$limit.log" 2>&1
  log "W2 MINISGL_SMALL_MOE_MAX_TOKENS=$limit: exit $?"
done

echo; echo "== $(cat "$out/gpu.txt")"
cat "$out/steps.txt"
for f in moe_fp8 moe_bf16; do
  [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "^ +[0-9]+ |small sweep|batch-1|check moe_gemv|Error" "$out/$f.log"; }
done
for limit in 0 4; do
  [ -f "$out/w2_$limit.log" ] && echo "-- W2 small<=$limit: $(grep '^{' "$out/w2_$limit.log" | tail -1)"
done
