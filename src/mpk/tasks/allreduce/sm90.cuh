// allreduce, sm_90a: out = round(partial_0 + ... + partial_{G-1}) (+ residual) for one tile of H,
// where partial_q is rank q's partial product, read from peer q's memory (tensor parallelism).
//
// Layouts: partial, residual, out are [B, H] split along H; the operand pointers point at column
// n0 of row 0, element (b, j) at ptr + b*H + j. Numerics as task.py: fp32 sum in rank order
// 0..G-1 (so every rank computes the same bits), rounded once to bf16 for a bf16 output, then
// the residual is added (rounding again), exactly the single-rank linear's epilogue.
//
// Cross-GPU protocol (docs/tensor-parallel.md), run by thread 0 of the CTA at global step g,
// after the runtime's local wait has acquired this rank's producers of the tile:
//   1. publish: for every rank q, a system-scope release store of g + 1 into q's flag
//      [task * G + me] (peer memory; every arena holds the same flags at the same offset);
//   2. wait, bounded by the watchdog: this rank's flags [task * G + q] >= g + 1 for every q
//      (acquire, system scope): each peer's partial tile of step g is complete and visible;
//   3. the CTA sums the peers' tiles with L2-coherent loads from their arenas.
// Flags are monotonic (never reset), so a fast peer can run ahead by whole steps without a
// re-arming race; the partial buffers are per layer, and a rank rewrites one only after a later
// all-reduce that needs every peer past its read of it (the "no WAR wait" argument of the docs).
// A peer that never publishes stops this kernel with ERR_CODE_PEER_TIMEOUT (COUNTER = its rank).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"

namespace mpk::kinds::allreduce {

// Thread 0: steps 1 and 2. False when the wait timed out or another CTA aborted the launch.
__device__ __forceinline__ bool exchange_flags(const mpk::TaskArgs& a, int ranks) {
  const mpk::Params& p = *a.p;
  const long long g = p.step_begin + a.step;
  const unsigned long long target = (unsigned long long)(g + 1);
  const long long slot0 = (long long)a.rec[REC_TASK] * ranks;
  // A stopped launch publishes nothing more: a peer must time out rather than sum partials
  // this rank may never have written.
  if (mpk::ptx::ld_relaxed_s32(p.abort_flag)) return false;
  __threadfence_system();  // the acquired producer writes, visible system-wide before the flag
  for (int q = 0; q < ranks; ++q) {
    auto* flags = reinterpret_cast<unsigned long long*>(p.peer_arenas[q] + p.xflags_offset);
    mpk::ptx::st_release_sys_u64(flags + slot0 + p.rank, target);
  }
  const auto* mine = reinterpret_cast<const unsigned long long*>(p.peer_arenas[p.rank] +
                                                                 p.xflags_offset);
  for (int q = 0; q < ranks; ++q) {
    const unsigned long long t0 = mpk::ptx::globaltimer();
    unsigned long long v;
    while ((v = mpk::ptx::ld_acquire_sys_u64(mine + slot0 + q)) < target) {
      if (mpk::ptx::ld_relaxed_s32(p.abort_flag)) return false;
      if (mpk::ptx::globaltimer() - t0 > (unsigned long long)p.timeout_ns) {
        mpk::report_failure(p.error, p.abort_flag, ERR_CODE_PEER_TIMEOUT, blockIdx.x, a.rec, -1,
                            q, v, target, g);
        return false;
      }
    }
  }
  return true;
}

// Rank q's copy of the local pointer `mine` (same offset in q's arena).
template <class T>
__device__ __forceinline__ const T* on_peer(const mpk::Params& p, const T* mine, int q) {
  const long long off = reinterpret_cast<const char*>(mine) -
                        reinterpret_cast<const char*>(p.peer_arenas[p.rank]);
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(p.peer_arenas[q]) + off);
}

// Partial element e of rank q, as fp32 (P = float or bf16).
template <class P>
__device__ __forceinline__ float peer_partial(const mpk::TaskArgs& a, const P* mine, int q,
                                              int ranks) {
  const P* src = ranks > 1 ? on_peer(*a.p, mine, q) : mine;
  if constexpr (sizeof(P) == 4) {
    return dev::ld_act_f32(src);
  } else {
    return dev::ld_act_bf16f(src);
  }
}

// The tile's sums (steps 3 and the epilogue). Operand offsets are in elements of the tensor's
// dtype, so each operand is fetched with its own type.
template <class P, class O>
__device__ __forceinline__ void sum_tile(const mpk::TaskArgs& a, int B, int H, int TN, int G) {
  const P* partial = a.operand<const P>(O_PARTIAL);
  const O* residual = a.operand<const O>(O_RESIDUAL);  // nullptr when absent
  O* out = a.operand<O>(O_OUT);
  for (int idx = threadIdx.x; idx < B * TN; idx += NUM_THREADS) {
    const int b = idx / TN, j = idx - b * TN;
    const long long e = (long long)b * H + j;
    float acc = peer_partial(a, partial + e, 0, G);  // rank order, as task.py (keeps -0.0)
    for (int q = 1; q < G; ++q) acc += peer_partial(a, partial + e, q, G);
    if constexpr (sizeof(O) == 4) {
      if (residual) acc += dev::ld_act_f32(residual + e);
      out[e] = acc;
    } else {
      acc = dev::round_bf16(acc);  // the product rounded once, as the single-rank linear does
      if (residual) acc += dev::ld_act_bf16f(residual + e);
      out[e] = dev::to_bf16(acc);
    }
  }
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using bf16 = __nv_bfloat16;
  const int B = a.i(P_BATCH), H = a.i(P_HIDDEN), TN = a.i(P_TILE_N), G = a.i(P_RANKS);
  if (G > 1) {
    int* stop = reinterpret_cast<int*>(a.smem);
    if (threadIdx.x == 0) *stop = exchange_flags(a, G) ? 0 : 1;
    mpk::task_sync();
    if (*stop) return;  // reported; the runtime stops this CTA, the host raises KernelHangError
  }
  const bool partial_f32 = a.i(P_PARTIAL_F32) != 0, out_f32 = a.i(P_OUT_F32) != 0;
  if (partial_f32) {
    out_f32 ? sum_tile<float, float>(a, B, H, TN, G) : sum_tile<float, bf16>(a, B, H, TN, G);
  } else {
    out_f32 ? sum_tile<bf16, float>(a, B, H, TN, G) : sum_tile<bf16, bf16>(a, B, H, TN, G);
  }
}

}  // namespace mpk::kinds::allreduce
