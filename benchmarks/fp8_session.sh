#!/usr/bin/env bash
# FP8 weights in one GPU call: the FP8 kernels' GPU tests (programmatic dependent launch first: without it
# working under CUDA graphs everything after runs with MINISGL_PDL=0), the decode micro-benchmarks
# (benchmarks/fp8.py --chain, then per projection at RUNS rows), then the offline workloads FP8 against bf16,
# each only while BUDGET seconds last. SWEEP=1 also retunes the tables first (benchmarks/fp8.py --sweep
# --write rewrites gemv.FP8_CONFIGS and fp8.FP8_GEMM_CONFIGS, copied to $OUT to be committed; minutes).
#
#   BUDGET=400 bash benchmarks/fp8_session.sh
#   SPECS="qwen3-8b-fp8:w1:70" BUDGET=120 bash benchmarks/fp8_session.sh   # other offline runs (model:workload:need)
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
  timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_kernels_full_size.py \
    -k programmatic > "$out/tests.log" 2>&1 || export MINISGL_PDL=0
  echo "PDL chain test: $(tail -1 "$out/tests.log") -> MINISGL_PDL=${MINISGL_PDL:-1} [$SECONDS s]" | tee "$out/tests.txt"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -k "not programmatic" tests/gpu/test_fp8_kernels_full_size.py \
    tests/gpu/test_gemv_engine.py tests/kernels/test_gemv.py tests/gpu/test_piecewise_graph.py \
    tests/engine/test_fp8_weights.py >> "$out/tests.log" 2>&1
  echo "tests: $(tail -1 "$out/tests.log") [$SECONDS s]" | tee -a "$out/tests.txt"
fi

if [ "${SWEEP:-0}" = 1 ]; then
  (cd benchmarks && timeout 270 python3 fp8.py --sweep --write --rows 1) > "$out/sweep.log" 2>&1
  echo "sweep: exit $? [$SECONDS s]" | tee -a "$out/tests.txt"
  cp minisgl/kernels/gemv.py minisgl/kernels/fp8.py "$out/"
fi
if [ -n "${RUNS:-1 8 16}" ]; then
  (cd benchmarks && timeout 100 python3 fp8.py --chain && timeout 100 python3 fp8.py --rows ${RUNS:-1 8 16}) \
    > "$out/fp8.log" 2>&1
  echo "micro-benchmarks: exit $? [$SECONDS s]" | tee -a "$out/tests.txt"
fi

# model:workload:need, most needed first; each runs only if its estimated time still fits the budget
for spec in ${SPECS:-qwen3-8b-fp8:w2:60 qwen3-8b:w2:60 qwen3-8b-fp8:w1:70 qwen3-30b-a3b-fp8:w2:70 \
            qwen3-30b-a3b-fp8:w1:80 qwen3-8b:w1:70}; do
  IFS=: read -r model workload need <<< "$spec"
  left=$((budget - SECONDS))
  if [ "$left" -lt "$need" ]; then echo "skipped $model $workload: ${left}s left" | tee -a "$out/tests.txt"; continue; fi
  timeout "$left" python3 benchmarks/offline.py --config ".bench_models/$model.json" --workload "$workload" \
    >> "$out/bench.log" 2>&1
  tail -1 "$out/bench.log" | grep '^{' >> "$out/bench.jsonl" || echo "{\"model\": \"$model\", \"workload\": \
\"$workload\", \"error\": \"see bench.log\"}" >> "$out/bench.jsonl"
  echo "$model $workload done [$SECONDS s]"
done

echo "== summary"
cat "$out/gpu.txt" "$out/tests.txt"
grep -E "^\||FAILED|Error" "$out/fp8.log" 2>/dev/null | head -60
cat "$out/bench.jsonl" 2>/dev/null
