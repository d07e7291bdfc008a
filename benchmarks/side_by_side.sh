#!/usr/bin/env bash
# Online serving side by side on the GPU machine: benchmarks/online.py against each SPEC in turn (same client,
# levels and rounds), one server at a time. One JSON line per level goes to $OUT/online.jsonl, the tables to
# $OUT/tables.md, the servers' logs (of this machine's runs so far) to $OUT/logs.tar.gz.
#
#   bash benchmarks/side_by_side.sh ENGINE:MODEL[:SERVER_FLAGS] ...      (MODEL: a .bench_models/*.json name)
#   e.g. minisgl:qwen3-0.6b  minisgl:qwen3-0.6b:--disable-piecewise-cuda-graph  vllm:qwen3-0.6b
#
# SERVER_FLAGS: commas for spaces (--max-num-batched-tokens,4096). vLLM 0.26.0 runs from $VLLM_SITE (default
# $HOME/peer/site: its wheel and its server's packages, installed with `pip install --target`), minisgl with its
# server packages in $HOME/site (the .whl folder, as benchmarks/gpu_check.sh installs it). LEVELS and ROUNDS
# are online.py's --levels and --rounds (default 1,16,64,256 and 2), REPEATS its --repeats (runs of each level on one
# server, each with prompts of its own, and a row of their medians; default 1); SPEC_TIMEOUT bounds each spec (300 s).
# Last, benchmarks/ab_table.py's table of all the servers so far in $OUT: for an A/B, list the specs alternated
# (A B A B) and read it server by server.
# vllm:MODEL of an FP8 MoE config serves vLLM's dummy routers, which send most tokens to a few experts (see
# benchmarks/vllm_offline.py, which spreads them offline): its figures are not a trained model's.
# TRACE=1 adds, for each minisgl spec, the TTFT stage table of benchmarks/ttft_trace.py and the long inter-token
# gaps' table of benchmarks/itl_trace.py (the server's trace and the client's timestamps, kept in the logs).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp/side-by-side}; logs=/tmp/side-by-side-logs; mkdir -p "$out" "$logs"  # logs of every run so far
for spec in "$@"; do
  IFS=: read -r engine model flags <<< "$spec"
  if [ "$engine" = vllm ]; then
    env=(PYTHONPATH="${VLLM_SITE:-$HOME/peer/site}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0)
  else
    env=(PYTHONPATH="$HOME/site:$PWD")
  fi
  tag=$(printf '%s' "$engine-$model$flags" | tr -c 'A-Za-z0-9.-' _)
  trace=()
  if [ -n "${TRACE:-}" ] && [ "$engine" = minisgl ]; then
    rm -f "$logs/$tag".trace.jsonl* "$logs/$tag.requests.jsonl"  # rids and step numbers restart with each server
    env+=(MINISGL_STEP_TRACE="$logs/$tag.trace.jsonl"); trace=(--requests-out "$logs/$tag.requests.jsonl")
  fi
  start=$SECONDS
  env "${env[@]}" timeout "${SPEC_TIMEOUT:-300}" python3 benchmarks/online.py --serve "$engine" \
    --config ".bench_models/$model.json" --levels "${LEVELS:-1,16,64,256}" --rounds "${ROUNDS:-2}" --repeats "${REPEATS:-1}" \
    --server-args="${flags//,/ }" --log "$logs/$tag.server.log" --json "$out/online.jsonl" "${trace[@]}" \
    > "$logs/$tag.txt" 2>&1
  code=$?
  stack=$(grep -ao '(HTTP by [^)]*)' "$logs/$tag.server.log" | tail -1)  # minisgl's parser and loop (see api.py)
  { echo; echo "$spec (exit $code, $((SECONDS - start)) s): $(grep -a '^ready in' "$logs/$tag.txt") $stack"
    grep -a '^|\|requests failed' "$logs/$tag.txt"
    if [ ${#trace[@]} -gt 0 ]; then
      python3 benchmarks/ttft_trace.py "$logs/$tag.requests.jsonl" "$logs/$tag.trace.jsonl"
      python3 benchmarks/itl_trace.py "$logs/$tag.requests.jsonl" "$logs/$tag.trace.jsonl"
    fi
  } 2>&1 | tee -a "$out/tables.md"
done
[ -f "$out/online.jsonl" ] && python3 benchmarks/ab_table.py "$out/online.jsonl" | tee -a "$out/tables.md"  # the A/B
tar -czf "$out/logs.tar.gz" -C "$logs" .
