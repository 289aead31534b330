#!/usr/bin/env bash
# One device call per mode (each fits the 10-minute limit), logs under $OUT (default ./out).
#   bash scripts/gpu_check.sh correctness   GPU tests, mpk generate on CUDA, compute-sanitizer
#   bash scripts/gpu_check.sh perf          mpk bench (BATCHES, default 1) and mpk profile
#   bash scripts/gpu_check.sh tp            tensor parallelism (needs >= 2 GPUs: nvidia-h200-x2+)
# Tune with MODELS="qwen3-0.6b ..." BATCHES="1 8" TOKENS=200 PYTEST_ARGS=...
# The step limits of one mode add up to less than the device's 10-minute call limit (with the
# install); qwen3-8b / llama-3.1-8b benches (16 GB of random weights, a torch.compile baseline)
# want a call of their own: MODELS=qwen3-8b.
set -uo pipefail
mode=${1:-correctness}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-/tmp/mpk-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/env.log"
status=0
step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || { status=1; echo "FAILED: $name"; }
  grep -v -e Warning -e '^$' "$OUT/$name.log" | tail -${TAIL:-15}
}
case $mode in
  correctness)
    step gpu_tests 330 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/gpu tests/cuda \
      tests/profile ${PYTEST_ARGS:-}
    step generate 90 python3 -m mpk generate --model qwen3-0.6b --backend cuda --json \
      --max-new-tokens 32
    before=$status
    step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
      python3 -m mpk generate --model tiny-qwen3 --backend cuda --max-new-tokens 4 --json
    # Some hosts' sandboxes refuse the sanitizer outright: that is "not run", not a failure.
    if grep -q "Device not supported" "$OUT/memcheck.log"; then
      echo "memcheck NOT RUN: compute-sanitizer does not support this host"; status=$before
    fi
    ;;
  perf)
    for model in ${MODELS:-qwen3-0.6b llama-3.2-1b}; do
      for batch in ${BATCHES:-1}; do
        step "bench-$model-b$batch" 150 python3 -m mpk bench --model "$model" --batch "$batch" \
          --new-tokens "${TOKENS:-200}"
      done
    done
    step profile 150 python3 -m mpk profile --model "${PROFILE_MODEL:-qwen3-0.6b}" \
      --out "$OUT/profile"
    ;;
  tp)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    step tp_tests 300 python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/gpu/test_tp_gpu.py \
      tests/parallel ${PYTEST_ARGS:-}
    step generate_tp2 100 python3 -m mpk generate --model qwen3-8b --backend cuda --tp 2 --json \
      --max-new-tokens 32
    step bench_tp2 150 python3 -m mpk bench --model qwen3-8b --tp 2 --new-tokens 100
    ;;
  *) echo "unknown mode $mode (use correctness, perf or tp)"; exit 2 ;;
esac
exit $status
