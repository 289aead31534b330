#!/usr/bin/env bash
# One device call: install, build, run the GPU tests and the first latency measurement.
# Usage on the H200 machine (repo root): bash scripts/gpu_check.sh   (logs go to $OUT, default ./out); BENCH_MODELS, BENCH_TOKENS, PYTEST_ARGS tune it
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-/tmp/mpk-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'; } 2>&1 | tee "$OUT/env.log"
status=0
timeout 420 python3 -m pytest tests/gpu tests/cuda -q -x --timeout 240 -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for model in ${BENCH_MODELS:-qwen3-0.6b llama-3.2-1b qwen3-8b}; do
  timeout ${BENCH_TIMEOUT:-240} python3 -m mpk bench --model "$model" --new-tokens ${BENCH_TOKENS:-200} 2>&1 | tee "$OUT/bench-$model.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
