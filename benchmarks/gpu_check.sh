#!/usr/bin/env bash
# One GPU session in one go: the test suite on CUDA (engine and server), a streamed completion from a
# server on the GPU, then the offline benchmarks given as MODEL:WORKLOAD arguments. Logs go to $OUT.
# Carry .bench_models (a copy of ../shared/models) for benchmarks and .whl (prepare-wheels.sh) for the
# server packages; TP=2 tests need two GPUs.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
  export PYTHONPATH="$HOME/site:$PWD"
fi
out=${OUT:-/tmp/minisgl-gpu}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
MINISGL_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/tests.log" | tail -5

python3 -m minisgl.tools.tiny_model /tmp/tiny-qwen3 --arch qwen3 > /dev/null
python3 -m minisgl --model /tmp/tiny-qwen3 --device cuda --port 1919 > "$out/server.log" 2>&1 &
for _ in $(seq 1 300); do curl -sf localhost:1919/health > /dev/null && break; sleep 0.2; done
curl -sN localhost:1919/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "/tmp/tiny-qwen3",
  "messages": [{"role": "user", "content": "Hello from the H200"}], "max_tokens": 8, "stream": true,
  "stream_options": {"include_usage": true}}' | tee "$out/stream.txt"
kill -TERM %1; wait %1; echo "server exit code: $?" | tee -a "$out/server.log"

for workload in "$@"; do
  model=${workload%%:*}; wl=${workload##*:}
  timeout 300 python3 benchmarks/offline.py --config ".bench_models/$model.json" --workload "$wl" 2>&1 \
    | tee -a "$out/bench.log" | grep '^{' >> "$out/bench.jsonl"
done
echo "== summary"; tail -1 "$out/tests.log"; grep -a "ready:\|exit code" "$out/server.log"
cat "$out/bench.jsonl" 2>/dev/null
