#!/usr/bin/env bash
# One GPU session in one go: GPU tests, a streamed completion from a server on the GPU, then the
# offline benchmarks given as arguments, and a short table last. Full logs go to $OUT.
#
#   bash benchmarks/gpu_check.sh [MODEL:WORKLOAD[:FLAGS]] ...
#   e.g. qwen3-0.6b:w2  qwen3-8b:w1  qwen3-30b-a3b:w2:--tp=2  qwen3-0.6b:w2:--no-overlap,--cuda-graph-max-bs=0
#   WORKLOAD "structured" runs benchmarks/structured.py (W1 with and without a JSON schema) instead.
#
# STACKS_AFTER=S dumps every process's Python stacks after S seconds (hangs).
# BENCH_TIMEOUT=S bounds each benchmark (default 420 s).
# READY_MODEL=NAME also starts a server on .bench_models/NAME.json (dummy weights) and logs its time to ready.
# TESTS=subset (default: the fast-path subset, under 4 minutes on one H200) | all | none.
# Carry .bench_models (model config.json files, dummy weights) for benchmarks and .whl (prepare-wheels.sh, plus xgrammar,
# apache-tvm-ffi and jsonschema for structured outputs, and httptools: without it uvicorn parses HTTP with the
# pure-Python h11, as a user's `pip install` never would; the server's "ready in" log line names both) for the
# server packages; TP=2 runs need two GPUs.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
  export PYTHONPATH="$HOME/site:$PWD"
fi
out=${OUT:-/tmp/minisgl-gpu}; mkdir -p "$out"
# STACKS_AFTER=S: every Python process started from here (TP followers included) prints all its threads'
# stacks to stderr once it has run S seconds: where a hang (e.g. a CUDA-graph capture under TP) waits.
if [ -n "${STACKS_AFTER:-}" ]; then
  mkdir -p /tmp/stacks && printf 'import faulthandler\nfaulthandler.dump_traceback_later(%s)\n' "$STACKS_AFTER" \
    > /tmp/stacks/sitecustomize.py && export PYTHONPATH="/tmp/stacks:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
gpus=$(nvidia-smi -L | wc -l)

subset="tests/gpu tests/kernels tests/engine/test_overlap.py tests/engine/test_engine_vs_hf.py
        tests/engine/test_sampling_e2e.py tests/engine/test_scheduler.py tests/engine/test_structured.py
        tests/engine/test_prompt_logprobs.py tests/engine/test_sampler.py tests/engine/test_prefix_cache.py
        tests/engine/test_fp8_kv.py tests/engine/test_mask_staging.py tests/engine/test_mixed_schedule.py
        tests/engine/test_fp8_weights.py tests/engine/test_step_trace.py"
case ${TESTS:-subset} in
  subset) tests=$(for f in $subset; do [ -e "$f" ] && echo "$f"; done) ;;
  all) tests=tests ;;
  *) tests= ;;
esac
if [ -n "$tests" ]; then
  skip_tp=(); [ "$gpus" -lt 2 ] && skip_tp=(-k "not tensor_parallel and not tp2")
  start=$SECONDS
  MINISGL_TEST_DEVICE=cuda timeout 540 python3 -m pytest -q -p no:cacheprovider "${skip_tp[@]}" $tests \
    > "$out/tests.log" 2>&1
  echo "tests: $(tail -1 "$out/tests.log") [$((SECONDS - start)) s]" | tee "$out/tests.txt"
fi

if python3 -c "import fastapi, uvicorn, zmq" 2>/dev/null; then
  python3 -m minisgl.tools.tiny_model /tmp/tiny-qwen3 --arch qwen3 > /dev/null
  python3 -m minisgl --model /tmp/tiny-qwen3 --device cuda --port 1919 > "$out/server.log" 2>&1 &
  for _ in $(seq 1 300); do curl -sf localhost:1919/health > /dev/null && break; sleep 0.2; done
  curl -sN localhost:1919/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "/tmp/tiny-qwen3",
    "messages": [{"role": "user", "content": "Hello from the GPU"}], "max_tokens": 8, "stream": true,
    "stream_options": {"include_usage": true}}' > "$out/stream.txt"
  kill -TERM %1; wait %1; echo "server exit code: $?" >> "$out/server.log"
fi

# READY_MODEL=qwen3-8b: time to ready of a server with that config's dummy weights (the Kubernetes figure)
if [ -n "${READY_MODEL:-}" ]; then
  dir=$(mktemp -d) && cp ".bench_models/$READY_MODEL.json" "$dir/config.json"
  python3 -m minisgl --model "$dir" --dummy-weight --skip-tokenizer-init --port 1920 > "$out/ready.log" 2>&1 &
  for _ in $(seq 1 600); do curl -sf localhost:1920/health > /dev/null && break; sleep 0.2; done
  kill -TERM %1; wait %1
  grep -a "engine built\|warm-up\|ready in" "$out/ready.log" | sed "s/^/$READY_MODEL: /" > "$out/ready.txt"
fi

for spec in "$@"; do
  IFS=: read -r model workload flags <<< "$spec"
  if [ "$workload" = structured ]; then
    timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/structured.py --config ".bench_models/$model.json" >> "$out/bench.log" 2>&1
  else
    timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/offline.py --config ".bench_models/$model.json" --workload "$workload" \
      ${flags//,/ } >> "$out/bench.log" 2>&1
  fi
  tail -1 "$out/bench.log" | grep '^{' >> "$out/bench.jsonl" || echo "{\"model\": \"$model\", \"workload\": \
\"$workload\", \"flags\": \"$flags\", \"error\": \"see bench.log\"}" >> "$out/bench.jsonl"
done

echo "== summary"
cat "$out/gpu.txt" "$out/tests.txt" "$out/ready.txt" 2>/dev/null
grep -a "engine built\|warm-up\|ready in\|exit code" "$out/server.log" 2>/dev/null | cut -c1-200
tail -c 300 "$out/stream.txt" 2>/dev/null; echo
python3 benchmarks/summary.py "$out/bench.jsonl" 2>/dev/null
