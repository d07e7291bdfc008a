#!/usr/bin/env bash
# FP8 weights in one GPU call: the FP8 kernels' GPU tests, the tuning sweep (benchmarks/fp8.py --sweep
# --write rewrites gemv.FP8_CONFIGS and fp8.FP8_GEMM_CONFIGS, copied to $OUT to be committed), then the
# offline workloads FP8 against bf16 with the tuned tables, each only while BUDGET seconds last.
#
#   BUDGET=400 bash benchmarks/fp8_session.sh
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

MINISGL_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_kernels_full_size.py \
  > "$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log") [$SECONDS s]" | tee "$out/tests.txt"

(cd benchmarks && timeout 270 python3 fp8.py --sweep --write) > "$out/fp8.log" 2>&1
echo "sweep and micro-benchmark: exit $? [$SECONDS s]" | tee -a "$out/tests.txt"
cp minisgl/kernels/gemv.py minisgl/kernels/fp8.py "$out/"

# model:workload:dtype, most needed first; each runs only if its estimated time still fits the budget
for spec in qwen3-8b-fp8:w2:70 qwen3-8b:w2:70 qwen3-8b-fp8:w1:70 qwen3-30b-a3b-fp8:w2:80 qwen3-8b:w1:70 \
            qwen3-30b-a3b-fp8:w1:90; do
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
sed -n '/step = 4 projections/,$p' "$out/fp8.log"
cat "$out/bench.jsonl"
