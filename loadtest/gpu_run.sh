#!/usr/bin/env bash
# Load test on a GPU machine without network, in one command (about 5 minutes): a qwen3-0.6b server with dummy
# weights and no tokenizer (prompts are token ids), then closed-loop Locust runs at 1, 16, 64 and 256 users,
# then report.py. Leaves table.md (also printed last), latency.png, report.json and every CSV and log in $OUT.
#
#   bash loadtest/gpu_run.sh --download-wheels   # here, with network: fills .whl/ for Python 3.12 x86_64
#   bash loadtest/gpu_run.sh                     # there, with .whl/ and .bench_models/qwen3-0.6b.json carried
#
# Wheels carried (what the GPU image lacks; it has torch, numpy, httpx, msgpack, jinja2, pytest): fastapi,
# uvicorn, httptools (else uvicorn parses HTTP in pure Python), pyzmq, pydantic, starlette, openai for the server;
# locust (gevent, geventhttpclient, flask, requests, configargparse, psutil, ...) and matplotlib (pillow, fonttools,
# kiwisolver, contourpy, ...) for the load test.
# Settings: RUN_TIME (per load level, default 45s), USERS ("1 16 64 256"), PROMPT_TOKENS (512),
# OUTPUT_TOKENS (128), SLO (ttft:1s,tpot:50ms), CONFIG (.bench_models/qwen3-0.6b.json), SERVER_ARGS (extra flags).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--download-wheels" ]; then
  mkdir -p .whl
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl fastapi uvicorn httptools pyzmq pydantic starlette "openai<3" locust matplotlib
  # the GPU image's own copies stay
  rm -f .whl/numpy-* .whl/pytest-* .whl/iniconfig-* .whl/pluggy-* .whl/pygments-* .whl/jinja2-* .whl/markupsafe-* \
        .whl/typing_extensions-* .whl/packaging-* .whl/tqdm-* .whl/anyio-* .whl/h11-* .whl/httpx-* .whl/httpcore-* \
        .whl/msgpack-*
  du -sh .whl
  exit 0
fi

export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
  export PYTHONPATH="$HOME/site:$PWD"
fi
out=${OUT:-/tmp/minisgl-loadtest}; mkdir -p "$out"
run_time=${RUN_TIME:-45s}; users=${USERS:-1 16 64 256}
prompt_tokens=${PROMPT_TOKENS:-512}; output_tokens=${OUTPUT_TOKENS:-128}; slo=${SLO:-ttft:1s,tpot:50ms}
port=1919; host=http://127.0.0.1:$port

model=$(mktemp -d)/qwen3-0.6b && mkdir -p "$model" && cp "${CONFIG:-.bench_models/qwen3-0.6b.json}" "$model/config.json"
{ echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"; nvidia-smi --query-gpu=name --format=csv,noheader
  echo "workload: $prompt_tokens random token ids in, $output_tokens tokens out (ignore_eos), $run_time per level"
} | tee "$out/setup.txt"

# shellcheck disable=SC2086
python3 -m minisgl --model "$model" --served-model-name qwen3-0.6b --dummy-weight --skip-tokenizer-init \
  --port $port ${SERVER_ARGS:-} > "$out/server.log" 2>&1 &
server=$!
for _ in $(seq 1 600); do
  curl -sf "$host/health" > /dev/null && break
  kill -0 $server 2> /dev/null || { echo "server exited:"; tail -30 "$out/server.log"; exit 1; }
  sleep 0.5
done
curl -sf "$host/health" > /dev/null || { echo "server not healthy after 300 s:"; tail -30 "$out/server.log"; exit 1; }
# one request first, so that the 1-user level does not pay for warm-up
curl -s "$host/v1/completions" -H 'Content-Type: application/json' -d "{\"model\": \"qwen3-0.6b\",
  \"prompt\": [$(seq -s, 1 $prompt_tokens)], \"max_tokens\": 16, \"ignore_eos\": true}" > "$out/warmup.json"

prefixes=()
for u in $users; do
  processes=()
  [ "$u" -ge 64 ] && processes=(--processes 4)  # a busy client core would inflate ITL: spread the users
  echo "== $u users"
  python3 -m locust -f loadtest/locustfile.py --host "$host" --headless --only-summary -u "$u" -r "$u" \
    -t "$run_time" "${processes[@]}" --csv "$out/u$u" --token-ids --vocab-size 10000 \
    --prompt-tokens "$prompt_tokens" --output-tokens "$output_tokens" --ignore-eos > "$out/u$u.log" 2>&1
  echo "locust exit code: $?"; grep -E "^(POST|TTFT|ITL|TPOT) " "$out/u$u.log" | head -4
  prefixes+=("$out/u$u")
done

kill -TERM $server; wait $server; echo "server exit code: $?" >> "$out/server.log"
python3 loadtest/report.py "${prefixes[@]}" --slo "$slo" --out "$out" > "$out/table.md"
echo "== report ($(head -1 "$out/setup.txt"))"; cat "$out/table.md"
