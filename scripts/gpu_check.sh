#!/usr/bin/env bash
# One device call per mode (each fits the 10-minute limit), logs under $OUT (default ./out).
#   bash scripts/gpu_check.sh kernels      the runtime's and every kernel's GPU tests (~400 s)
#   bash scripts/gpu_check.sh models       the model GPU tests, `mpk generate`, memcheck (~450 s)
#   bash scripts/gpu_check.sh correctness  kernels, then models (over one call's 600 s: two calls)
#   bash scripts/gpu_check.sh real         SmolLM2-135M on CUDA against transformers (GGUF: see
#                                          GGUF_PARTS below), `mpk generate` and `mpk bench` on it
#   bash scripts/gpu_check.sh gates        the issues' gates, `mpk bench` each (torch.compile in the
#                                          same run): qwen3-0.6b b1 / b16 / b8, llama-3.2-1b b1,
#                                          serving on qwen3-0.6b, qwen3-30b-a3b b1 (~400-560 s)
#   bash scripts/gpu_check.sh perf         mpk bench (MODELS x BATCHES) and mpk profile
#   bash scripts/gpu_check.sh probe        scripts/probe_stream.py: the weight-page pipeline alone
#                                          (GB/s per SM by page count, page size, L2 vs HBM, ...),
#                                          then probe_phases.py (a linear task's phases, ablations)
#   bash scripts/gpu_check.sh wgmma        scripts/wgmma_gemm_probe.cu: the prefill GEMM tile on
#                                          warpgroup MMAs alone (correct? TFLOP/s?), before a port
#   bash scripts/gpu_check.sh splits       where attention's KV splits pay: scripts/ab_decode.py on
#                                          qwen3-0.6b b1 at 128, 200-300, 576 and 1,504 positions
#                                          and a 2048-position plan at 128, the builder's
#                                          SPLIT_POSITIONS 64 against 32 and 128 (--split-positions)
#   bash scripts/gpu_check.sh tp           tensor parallelism (needs >= 2 GPUs: nvidia-h200-x2+)
#   bash scripts/gpu_check.sh runs         the fifth session's unrun CUDA (attention's run rows,
#                                          sampling positions): its kernel tests, the engine's runs
#                                          against the reference, then qwen3-0.6b b1 (must stay 1.13)
#   bash scripts/gpu_check.sh prefill      the prefill plan's kernel and engine tests, then mpk
#                                          bench --prefill (TTFT of one long prompt through the
#                                          prefill plan, CHUNKS positions a launch, vs torch cuBLAS
#                                          + SDPA) on qwen3-0.6b and qwen3-8b (PREFILL, default
#                                          2048), then the serving bench with long prompts
#                                          (64-1024 tokens) on qwen3-0.6b
#   bash scripts/gpu_check.sh attention    the attention and flag kernel tests, every buffer of the
#                                          small models and their teacher-forced runs, mpk bench
#                                          qwen3-0.6b at batch 1 and 8, then probe_model.py's
#                                          attention and linear phase marks (perf-log, sixteenth
#                                          session: what the next attention and epilogue work needs)
#   bash scripts/gpu_check.sh marks        mpk bench qwen3-0.6b at batch 1 and 8, then probe_model.py's
#                                          linear epilogue marks: lin_e_done (finish_shared's
#                                          share) and epi_cycles (thread 0's clock64 in it: the
#                                          barrier, the sums, the stores, pc.finish(); perf-log,
#                                          eighteenth session: where finish_shared's 0.9 us goes)
#   bash scripts/gpu_check.sh serve        mpk bench --serving (engine: 16 slots vs one request,
#                                          outputs equal solo runs) on qwen3-0.6b and qwen3-8b, then
#                                          scripts/bench_serve.py against `mpk serve --backend cuda`
#                                          (SERVE_MODEL, default qwen3-8b; REQUESTS, default 200)
#   bash scripts/gpu_check.sh moe          the MoE kernel tests (moe_down's cases, two MoE layers, the
#                                          tiny model's every buffer), scripts/prefetch_bench.cu
#                                          (what a bulk L2 prefetch costs beside bulk copies and
#                                          register loads), qwen3-30b-a3b's phases and mpk bench,
#                                          then qwen3-8b's phases with and without the loader
#                                          (perf-log, twenty-first session: Next 0-1)
# Tune with MODELS="qwen3-0.6b ..." BATCHES="1 8" TOKENS=200 PYTEST_ARGS=... BUDGET=540;
# prefill: PREFILL_MODELS, CHUNKS, SERVING_LONG=0 (no long-prompt serving bench); serve:
# SERVING_MODELS, SERVE_SERVER=0 (no HTTP server bench).
# GGUF_PARTS: files whose concatenation is the SmolLM2 GGUF (a call carries at most 64 MiB, so
# it travels in two calls; stash the first in /tmp with GGUF_STASH=path of the part).
# Steps run in order while the call's BUDGET (seconds) lasts; a failing gate step skips the rest.
# Wheels the GPU image lacks travel in .whl/ (git-ignored; carry it): gguf for `real`, and for
# `serve` the server and client stack, fetched here with
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 -d .whl gguf fastapi uvicorn prometheus_client openai
set -uo pipefail
mode=${1:-correctness}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-/tmp/mpk-cache}
export MPK_WATCHDOG_S=${MPK_WATCHDOG_S:-3}
START=$(date +%s); BUDGET=${BUDGET:-540}
if [ -n "${GGUF_STASH:-}" ]; then cp "$GGUF_STASH" /tmp/gguf.stash; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels the GPU image lacks (gguf, server stack)
  # Resolved against what the image has: only missing packages are installed, none shadowed.
  python3 -m pip install -q --no-index --find-links .whl --no-compile \
    $(ls .whl | sed -n 's/^\(gguf\|fastapi\|uvicorn\|prometheus_client\|openai\)-.*/\1/p') \
    >>"$OUT/install.log" 2>&1 || echo "wheel install failed: see install.log"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/env.log"
status=0
step() {  # step NAME LIMIT CMD...: run within the call's budget, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 20 ]; then echo "SKIPPED (budget): $name"; status=1; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s) rc=0
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  grep -v -e Warning -e '^$' "$OUT/$name.log" | tail -${TAIL:-12}
  echo "-- $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || { status=1; return 1; }
}
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE --timeout ${TEST_TIMEOUT:-90} ${PYTEST_ARGS:-}"
case $mode in
  correctness|kernels|models)
    case $mode in models) ;; *)
    step runtime 120 $PYTEST tests/gpu/test_runtime.py || exit $status
    step kernels_linear 200 $PYTEST tests/gpu/test_kernels_linear.py
    step kernels_attention 150 $PYTEST tests/gpu/test_kernels_attention.py
    step kernels_other 100 $PYTEST tests/gpu/test_kernels.py
    step kernels_moe 150 $PYTEST tests/gpu/test_kernels_moe.py
    step kernels_flags 100 $PYTEST tests/gpu/test_flags.py
    step kernels_prefill 150 $PYTEST tests/gpu/test_kernels_prefill.py
    [ $status -eq 0 ] || exit $status
    [ "$mode" = kernels ] && exit $status ;;
    esac
    # The interpreter side of every_buffer on qwen3-8b alone takes minutes: two steps, so the
    # engine tests are not starved by it (seventh session: one 240 s step ran out).
    step models_buffers 300 $PYTEST --timeout 280 tests/gpu/test_model_gpu.py -k every_buffer
    step models_engine 240 $PYTEST --timeout 200 tests/gpu/test_model_gpu.py tests/profile \
      -k "not every_buffer"
    step moe_transformers 120 $PYTEST tests/models/test_moe_mpk.py -k cuda
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
  real)
    gguf=$MPK_CACHE_DIR/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$(dirname "$gguf")"
    cat ${GGUF_PARTS:-/tmp/gguf.stash} > "$gguf"
    sha256sum "$gguf"
    step real_model 300 $PYTEST --timeout 280 tests/models/test_smollm2.py -k cuda
    step generate_real 90 python3 -m mpk generate --model smollm2-135m --backend cuda \
      --prompt "The capital of France is"
    step bench_real 150 python3 -m mpk bench --model smollm2-135m --new-tokens 100
    ;;
  gates)  # in the order the b1 gates need them; each step's log holds the bench's report
    step gate-qwen3-0.6b-b1 120 python3 -m mpk bench --model qwen3-0.6b --new-tokens 100
    step gate-llama-3.2-1b-b1 120 python3 -m mpk bench --model llama-3.2-1b --new-tokens 100
    for batch in 16 8; do
      step "gate-qwen3-0.6b-b$batch" 100 python3 -m mpk bench --model qwen3-0.6b \
        --batch "$batch" --new-tokens 50
    done
    step gate-serving 150 python3 -m mpk bench --serving --model qwen3-0.6b --requests 48 \
      --max-batch 16
    step gate-qwen3-30b-a3b-b1 150 python3 -m mpk bench --model qwen3-30b-a3b --new-tokens 50
    ;;
  perf)
    for model in ${MODELS:-qwen3-0.6b llama-3.2-1b}; do
      for batch in ${BATCHES:-1}; do
        step "bench-$model-b$batch" 150 python3 -m mpk bench --model "$model" --batch "$batch" \
          --new-tokens "${TOKENS:-200}"
      done
    done
    [ -n "${PROFILE_MODEL:-qwen3-0.6b}" ] && step profile 150 python3 -m mpk profile \
      --model "${PROFILE_MODEL:-qwen3-0.6b}" --out "$OUT/profile"
    ;;
  probe)
    step probe_stream 200 python3 scripts/probe_stream.py --json
    step probe_phases 300 python3 scripts/probe_phases.py --json
    ;;
  wgmma)
    step wgmma_build 120 nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a \
      scripts/wgmma_gemm_probe.cu -o /tmp/wgmma_probe || exit $status
    step wgmma_probe 120 /tmp/wgmma_probe
    ;;
  tp)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    step tp_tests 300 $PYTEST --timeout 300 tests/gpu/test_tp_gpu.py tests/parallel
    step generate_tp2 100 python3 -m mpk generate --model qwen3-8b --backend cuda --tp 2 --json \
      --max-new-tokens 32
    step bench_tp2 150 python3 -m mpk bench --model qwen3-8b --tp 2 --new-tokens 100
    ;;
  serve)
    for model in ${SERVING_MODELS:-qwen3-0.6b qwen3-8b}; do
      step "bench-serving-$model" 150 python3 -m mpk bench --serving --model "$model" \
        --requests 48 --max-batch 16 --json
    done
    [ "${SERVE_SERVER:-1}" = 1 ] && step serve_bench 300 python3 scripts/bench_serve.py --num-requests "${REQUESTS:-200}" \
      --launch "python3 -m mpk serve --backend cuda --model ${SERVE_MODEL:-qwen3-8b} \
      --max-batch 16 --port 0" --out "$OUT/bench-serve.json"
    ;;
  splits)
    ab() {
      python3 scripts/ab_decode.py --rounds 3 --new-tokens 100 "$@" 2>&1 | tail -1 | cut -c1-300
    }
    # model:prompt length:plan positions (0: what the prompt and tokens need):SPLIT_POSITIONS
    # values, timed in this order (64 is the builder's; perf-log fortieth session)
    cases="qwen3-0.6b:16:0:64,128 qwen3-0.6b:16:2048:64 qwen3-0.6b:200:0:64,128,32"
    cases="$cases qwen3-0.6b:462:0:64,128,32 qwen3-0.6b:1400:0:64,128"
    for c in $cases; do  # builds first, in parallel (nvcc only)
      IFS=: read -r model len plan sps <<< "$c"
      for sp in ${sps//,/ }; do
        ab --model "$model" --prompt-len "$len" --plan-positions "$plan" --split-positions "$sp" \
          --build-only > "$OUT/build-$model-$len-$plan-$sp.txt" &
      done
    done
    wait
    cat "$OUT"/build-*.txt | cut -c1-160
    for c in $cases; do
      IFS=: read -r model len plan sps <<< "$c"
      for sp in ${sps//,/ }; do
        left=$((BUDGET - ($(date +%s) - START)))
        [ "$left" -gt 40 ] && echo "$model $len (plan $plan) split-positions $sp: $(ab --model \
          "$model" --prompt-len "$len" --plan-positions "$plan" --split-positions "$sp")"
      done
    done
    ;;
  runs)
    step kernels_attention 150 $PYTEST tests/gpu/test_kernels_attention.py || exit $status
    step kernels_sampling 120 $PYTEST tests/gpu/test_kernels_linear.py -k "samples or argmax"
    step model_runs 240 $PYTEST --timeout 200 tests/gpu/test_model_gpu.py -k \
      "runs or batched or tiny"
    step bench-qwen3-0.6b-b1 120 python3 -m mpk bench --model qwen3-0.6b --new-tokens 100
    ;;
  marks)
    for batch in 1 8; do
      step "bench-qwen3-0.6b-b$batch" 120 python3 -m mpk bench --model qwen3-0.6b --batch "$batch" \
        --new-tokens 100
    done
    runs=none,lin_e_done,epi_cycles
    step probe_marks 240 bash -c "cd scripts && python3 probe_model.py --model qwen3-0.6b \
      --steps 30 --runs $runs"
    ;;
  moe)
    step kernels_moe 200 $PYTEST tests/gpu/test_kernels_moe.py -k "down or two_moe or every_buffer" \
      || exit $status
    step prefetch_bench 60 bash -c "nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/pfb \
      scripts/prefetch_bench.cu && /tmp/pfb 4 8 8"
    step probe_moe 120 bash -c "cd scripts && python3 probe_model.py --model qwen3-30b-a3b \
      --steps 20 --runs none"
    step bench-qwen3-30b-a3b 120 python3 -m mpk bench --model qwen3-30b-a3b --new-tokens 50
    TAIL=24 step probe_qwen3-8b 160 bash -c "cd scripts && python3 probe_model.py --model qwen3-8b \
      --steps 20 --runs none,no_loader"
    ;;
  attention)
    step kernels_attention 150 $PYTEST tests/gpu/test_kernels_attention.py tests/gpu/test_flags.py \
      || exit $status
    step model_attention 240 $PYTEST --timeout 200 tests/gpu/test_model_gpu.py -k \
      "(every_buffer and (tiny or 0.6b or llama-3.2-1b-1)) or (teacher_forced and (0.6b or llama))"
    for batch in 1 8; do
      step "bench-qwen3-0.6b-b$batch" 120 python3 -m mpk bench --model qwen3-0.6b --batch "$batch" \
        --new-tokens 100
    done
    step probe_marks 200 bash -c "cd scripts && python3 probe_model.py --model qwen3-0.6b \
      --steps 30 --runs none,attn_m_polled,attn_m_scores,attn_m_block,lin_m_allwalked"
    ;;
  prefill)
    step kernels_prefill 150 $PYTEST tests/gpu/test_kernels_prefill.py || exit $status
    step model_prefill 300 $PYTEST --timeout 280 tests/gpu/test_model_gpu.py -k prefill_plan
    for model in ${PREFILL_MODELS:-qwen3-0.6b qwen3-8b}; do
      for chunk in ${CHUNKS:-256 1024}; do
        step "prefill-$model-c$chunk" 200 python3 -m mpk bench --prefill "${PREFILL:-2048}" \
          --model "$model" --max-batch 16 --prefill-chunk "$chunk" --json
      done
    done
    [ "${SERVING_LONG:-1}" = 1 ] && step bench-serving-long 200 python3 -m mpk bench --serving --model qwen3-0.6b \
      --requests 32 --max-batch 16 --prompt-len 64:1024 --json
    ;;
  *) echo "unknown mode $mode (use kernels, models, correctness, real, perf, probe, wgmma, tp," \
       "serve, runs, prefill, attention, marks or moe)"
     exit 2 ;;
esac
exit $status
