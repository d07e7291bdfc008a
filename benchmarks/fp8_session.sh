#!/usr/bin/env bash
# FP8 weights in one GPU call, each step only while BUDGET seconds last:
#  1. the programmatic-dependent-launch test (a decode chain replayed from a CUDA graph); if it fails, the
#     rest runs with MINISGL_PDL=0;
#  2. the offline workloads, SPECS: engine:model:workloads:need (workloads comma-separated, run on one engine;
#     need: the seconds it is expected to take, skipped when fewer are left). This script builds csrc's FP8
#     GEMVs first, so engine `minisgl` takes them where native.NATIVE_FP8_GEMV says; `minisgl-triton` never
#     (MINISGL_NATIVE_GEMV=0), `minisgl-native` for every shape they serve (=1: widen for 1-2 rows, mma for
#     3-8), `minisgl-native-widen` / `minisgl-native-mma` only that variant (MINISGL_NATIVE_GEMV=widen|mma).
#     Engine `vllm` runs
#     benchmarks/vllm_offline.py with vLLM 0.26.0 installed from the chunks that earlier calls carried
#     ($HOME/peer/chunks, see ../shared/bench/PEER.md) and PEER (the .peer/c6 folder: the wheel's checksum and
#     vLLM's dependencies), VLLM_USE_DEEP_GEMM=0 (its CUTLASS block-scaled FP8 GEMM: DeepGEMM's JIT warm-up
#     takes minutes);
#  3. the other FP8 GPU tests (kernels at full size with the FP8 experts, cuBLAS's block-scaled GEMM, FP8
#     piecewise graphs, the GEMV engine);
#  4. the decode-step micro-benchmark (benchmarks/fp8.py --chain); RUNS="1 8 16" adds the per-projection table;
#     CUBLAS=1 the prefill-sized Triton vs cuBLAS FP8 GEMMs (fp8.py --cublas --write: fp8_cublas.py, its table
#     rewritten, is copied to $OUT to be committed).
# SWEEP=1 retunes the tables before step 2 (benchmarks/fp8.py --sweep --write rewrites gemv.FP8_CONFIGS and
# fp8.FP8_GEMM_CONFIGS, copied to $OUT to be committed; minutes).
#
#   BUDGET=400 bash benchmarks/fp8_session.sh
#   PEER=../../.peer/c6 SPECS="minisgl:qwen3-8b-fp8:w2,w1:80 vllm:qwen3-8b-fp8:w1,w2:170" bash benchmarks/fp8_session.sh
#
# Carry .bench_models (the real configs) and .whl (the server packages, see gpu_check.sh).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/site" .whl/*.whl
  export PYTHONPATH="$HOME/site:$PWD"
fi
out=${OUT:-/tmp/minisgl-fp8}; mkdir -p "$out"
budget=${BUDGET:-400}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
export MINISGL_TEST_DEVICE=cuda
log() { echo "$* [$SECONDS s]" | tee -a "$out/steps.txt"; }
fits() { [ $((budget - SECONDS)) -ge "$1" ] || { log "skipped $2: $((budget - SECONDS)) s left"; false; }; }

timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_kernels_full_size.py -k programmatic \
  > "$out/tests.log" 2>&1 || export MINISGL_PDL=0
log "PDL chain test: $(tail -1 "$out/tests.log") -> MINISGL_PDL=${MINISGL_PDL:-1}"

if [ "${SWEEP:-0}" = 1 ]; then
  (cd benchmarks && timeout 270 python3 fp8.py --sweep --write --rows 1) > "$out/sweep.log" 2>&1
  log "sweep: exit $?"
  cp minisgl/kernels/gemv.py minisgl/kernels/fp8.py "$out/"
fi

log "csrc build: $(python3 -m minisgl.tools.build_csrc 2>&1 | tail -1)"
vllm_ready=0 PEER=${PEER:-.peer/c6}
for spec in ${SPECS:-minisgl:qwen3-8b-fp8:w2,w1:80 minisgl:qwen3-8b:w2:45 minisgl:qwen3-30b-a3b-fp8:w2,w1:100}; do
  IFS=: read -r engine model workloads need <<< "$spec"
  fits "$need" "$spec" || continue
  if [ "$engine" = vllm ]; then
    if [ "$vllm_ready" = 0 ]; then
      wheel=/tmp/$(cut -d' ' -f3 "$PEER/vllm.sha256")
      cat "$HOME"/peer/chunks/vllm.whl.part-0[0-4] > "$wheel" && (cd /tmp && sha256sum -c "$OLDPWD/$PEER/vllm.sha256") \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target "$HOME/peer/site" "$wheel" "$PEER"/*.whl \
        && vllm_ready=1
      log "vLLM install: $vllm_ready"
    fi
    env PYTHONPATH="$HOME/peer/site:$PWD/benchmarks" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
      VLLM_USE_DEEP_GEMM=0 timeout $((budget - SECONDS)) python3 benchmarks/vllm_offline.py \
      --config ".bench_models/$model.json" --workload "$workloads" >> "$out/vllm.log" 2>&1
  else  # engine minisgl[-triton|-native[-variant]]: which FP8 GEMVs serve decode (see above)
    native=()
    case "$engine" in
      minisgl-triton) native=(MINISGL_NATIVE_GEMV=0) ;;
      minisgl-native) native=(MINISGL_NATIVE_GEMV=1) ;;
      minisgl-native-*) native=(MINISGL_NATIVE_GEMV="${engine#minisgl-native-}") ;;
    esac
    env "${native[@]}" timeout $((budget - SECONDS)) python3 benchmarks/offline.py --config ".bench_models/$model.json" \
      --workload "$workloads" >> "$out/bench.log" 2>&1
  fi
  log "$spec: exit $?"
done
grep -h '^{' "$out/bench.log" "$out/vllm.log" > "$out/bench.jsonl" 2>/dev/null

if [ "${TESTS:-1}" = 1 ] && fits 100 "the other GPU tests"; then
  timeout $((budget - SECONDS)) python3 -m pytest -q -p no:cacheprovider -k "not programmatic" \
    tests/gpu/test_fp8_kernels_full_size.py tests/gpu/test_fp8_scaled_mm.py \
    tests/gpu/test_piecewise_graph.py::test_fp8_weights_in_bf16_pick_the_eager_forwards_tokens \
    tests/kernels/test_gemv.py::test_row_parallel_layer_with_silu_mul_equals_the_activation_then_the_layer \
    tests/gpu/test_gemv_engine.py >> "$out/tests.log" 2>&1
  log "tests: $(tail -1 "$out/tests.log")"
fi
if [ "${CHAIN:-1}" = 1 ] && fits 60 "the decode chain"; then
  (cd benchmarks && timeout $((budget - SECONDS)) python3 fp8.py --chain) > "$out/fp8.log" 2>&1
  log "decode chain: exit $?"
fi
if [ "${CUBLAS:-0}" = 1 ] && fits 90 "the cuBLAS FP8 GEMM table"; then
  (cd benchmarks && timeout $((budget - SECONDS)) python3 fp8.py --cublas --write) >> "$out/fp8.log" 2>&1
  log "cuBLAS FP8 GEMMs: exit $?"
  cp minisgl/kernels/fp8_cublas.py "$out/"
fi
if [ -n "${RUNS:-}" ] && fits 60 "the per-projection table"; then
  (cd benchmarks && timeout $((budget - SECONDS)) python3 fp8.py --rows $RUNS) >> "$out/fp8.log" 2>&1
  log "per projection: exit $?"
fi

echo "== summary"
cat "$out/gpu.txt" "$out/steps.txt"
grep -E "^\||FAILED|Error" "$out/fp8.log" 2>/dev/null | head -40
grep -iE "kernel|Fp8|cutlass|deep_?gemm" "$out/vllm.log" 2>/dev/null | grep -v Warning | head -8
cat "$out/bench.jsonl" 2>/dev/null
