#!/usr/bin/env bash
# One GPU session in one go: the test suite on CUDA, then the offline benchmarks; logs to $OUT.
# Needs .bench_models (a copy of ../shared/models, carried along) and, for TP=2, two GPUs.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/minisgl-gpu}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
git log -1 --format='commit %H' 2>/dev/null | tee -a "$out/gpu.txt"
MINISGL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/tests.log" | tail -5
for workload in "$@"; do
  model=${workload%%:*}; wl=${workload##*:}
  timeout 300 python3 benchmarks/offline.py --config ".bench_models/$model.json" --workload "$wl" 2>&1 \
    | tee -a "$out/bench.log" | grep '^{' >> "$out/bench.jsonl"
done
echo "== summary"; tail -1 "$out/tests.log"; cat "$out/bench.jsonl" 2>/dev/null
