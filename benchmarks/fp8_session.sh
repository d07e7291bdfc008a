#!/usr/bin/env bash
# FP8 weights in one GPU call: the FP8 kernels' GPU tests (programmatic dependent launch first: without it
# working under CUDA graphs everything after runs with MINISGL_PDL=0), the decode-step micro-benchmark
# (benchmarks/fp8.py --chain; RUNS="1 8 16" adds the per-projection table at those rows), then the offline
# workloads FP8 against bf16, each only while BUDGET seconds last. SWEEP=1 also retunes the tables first
# (benchmarks/fp8.py --sweep --write rewrites gemv.FP8_CONFIGS and fp8.FP8_GEMM_CONFIGS, copied to $OUT to be
# committed; minutes).
#
#   BUDGET=400 bash benchmarks/fp8_session.sh
#   TESTS=0 CHAIN=0 SPECS="qwen3-8b:w1:70" BUDGET=120 bash benchmarks/fp8_session.sh   # only these offline runs
#
# Carry .bench_models (the real configs) and .whl (the server packages, see gpu_check.sh).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
  export PYTHONPATH="$HOME/site:$PWD"
fi
out=${OUT:-/tmp/minisgl-fp8}; mkdir -p "$out"
budget=${BUDGET:-400}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
export MINISGL_TEST_DEVICE=cuda

if [ "${TESTS:-1}" = 1 ]; then
  timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_kernels_full_size.py \
    -k programmatic > "$out/tests.log" 2>&1 || export MINISGL_PDL=0
  echo "PDL chain test: $(tail -1 "$out/tests.log") -> MINISGL_PDL=${MINISGL_PDL:-1} [$SECONDS s]" | tee "$out/tests.txt"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -k "not programmatic" tests/gpu/test_fp8_kernels_full_size.py \
    tests/gpu/test_piecewise_graph.py::test_fp8_weights_in_bf16_pick_the_eager_forwards_tokens \
    tests/kernels/test_gemv.py::test_row_parallel_layer_with_silu_mul_equals_the_activation_then_the_layer \
    tests/gpu/test_gemv_engine.py >> "$out/tests.log" 2>&1
  echo "tests: $(tail -1 "$out/tests.log") [$SECONDS s]" | tee -a "$out/tests.txt"
fi

if [ "${SWEEP:-0}" = 1 ]; then
  (cd benchmarks && timeout 270 python3 fp8.py --sweep --write --rows 1) > "$out/sweep.log" 2>&1
  echo "sweep: exit $? [$SECONDS s]" | tee -a "$out/tests.txt"
  cp minisgl/kernels/gemv.py minisgl/kernels/fp8.py "$out/"
fi
if [ "${CHAIN:-1}" = 1 ]; then
  (cd benchmarks && timeout 70 python3 fp8.py --chain) > "$out/fp8.log" 2>&1
  echo "decode chain: exit $? [$SECONDS s]" | tee -a "$out/tests.txt"
fi
if [ -n "${RUNS:-}" ]; then
  (cd benchmarks && timeout 100 python3 fp8.py --rows $RUNS) >> "$out/fp8.log" 2>&1
  echo "per projection: exit $? [$SECONDS s]" | tee -a "$out/tests.txt"
fi

# model:workloads:need (workloads comma-separated, run on one engine), most needed first; each runs only if its
# estimated time still fits the budget
for spec in ${SPECS:-qwen3-8b-fp8:w2,w1:80 qwen3-8b:w2:45 qwen3-30b-a3b-fp8:w2,w1:100}; do
  IFS=: read -r model workloads need <<< "$spec"
  left=$((budget - SECONDS))
  if [ "$left" -lt "$need" ]; then echo "skipped $model $workloads: ${left}s left" | tee -a "$out/tests.txt"; continue; fi
  timeout "$left" python3 benchmarks/offline.py --config ".bench_models/$model.json" --workload ${workloads//,/ } \
    >> "$out/bench.log" 2>&1 || echo "$model $workloads: exit $? (see bench.log)" | tee -a "$out/tests.txt"
  echo "$model $workloads done [$SECONDS s]"
done
grep '^{' "$out/bench.log" > "$out/bench.jsonl"

echo "== summary"
cat "$out/gpu.txt" "$out/tests.txt"
grep -E "^\||FAILED|Error" "$out/fp8.log" 2>/dev/null | head -60
cat "$out/bench.jsonl" 2>/dev/null
