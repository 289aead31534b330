// moe_router, sm_90a: one batch row's RMSNorm, router logits, softmax, top-k and routing weights
// (semantics and rounding points in task.py; steps 1-6 below are its docstring's).
//
// Layouts (default splits, grid (B,)): x, x_norm, expert_ids, expert_weights are cut by rows, so
// their operand pointers point at this task's row; norm_weight [H] and the gate [E, H] are whole.
// Shared scratch (task.py scratch_bytes): [xs: H bf16, 16-byte rounded][red: 16 f32][prob: E f32].
//
// 1. The row is staged with cp.async (an activation: through L2); its sum of squares is reduced
//    per warp, then over the warps in a fixed order (deterministic), as the rmsnorm kind does.
// 2. x_norm replaces the staged row in place (bf16, the values the experts read) and is stored.
// 3. Logits: warp w takes experts w, w+8, ...; each lane holds up to kLoads 16-byte vectors of
//    the expert's gate row in flight (the gate is a weight: read-only path), dots them with the
//    staged row and the warp sums; the bf16-rounded logit goes to prob[e].
// 4-6. Warp 0 alone (no more task_sync: the other warps have left, and the runtime's barrier
//    after the task pairs with theirs): max, exp, sum, probabilities as torch's CPU softmax
//    (p = e * (1 / sum)), then K rounds of a warp argmax over (probability, lower id first)
//    keys; lane j keeps slot j. The renormalising sum adds the slots in order, as route() does.
// Register use stays small (the kind is inlined into the all-kinds dispatch switch): the only
// array is the kLoads in-flight vectors, outer loops are not unrolled.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/sampling.cuh"

namespace mpk::kinds::moe_router {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kLoads = 8;  // gate vectors in flight per lane: a 2048-wide row in one round

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// Step 3 for expert e: bf16(x_norm . gate[e]) (every lane returns it).
__device__ __forceinline__ float logit(const bf16* row, unsigned xs, int vpr, int lane) {
  float acc = 0.f;
#pragma unroll 1
  for (int c = 0; c < vpr; c += 32 * kLoads) {
    uint4 w[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int v = c + 32 * i + lane;
      w[i] = v < vpr ? dev::ld_weight_v4(row + v * 8) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int v = c + 32 * i + lane;
      if (v < vpr) {
        float fx[8], fw[8];
        dev::unpack8(dev::lds_v4(xs + v * 16), fx);
        dev::unpack8(w[i], fw);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(fx[e], fw[e], acc);
      }
    }
  }
  return dev::round_bf16(dev::warp_sum(acc));
}

// Steps 4-6 on warp 0 (prob: the E logits, overwritten); lane j < K stores slot j.
__device__ __forceinline__ void route(float* prob, int E, int K, bool renorm, int lane,
                                      int* ids_out, bf16* weights_out) {
  // 4. softmax over all E experts in fp32
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, prob[e]);
  m = dev::warp_max(m);
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) {
    const float ex = expf(__fsub_rn(prob[e], m));
    prob[e] = ex;
    sum += ex;
  }
  const float rsum = __fdiv_rn(1.f, dev::warp_sum(sum));
  for (int e = lane; e < E; e += 32) prob[e] = __fmul_rn(prob[e], rsum);
  __syncwarp();

  // 5. top-k: K rounds of a warp argmax; a chosen expert's probability becomes -1 (below every
  // probability), so the next round skips it.
  float mine = 0.f;
  int mine_id = 0;
#pragma unroll 1
  for (int j = 0; j < K; ++j) {
    unsigned long long best = 0ull;
    for (int e = lane; e < E; e += 32) {
      const unsigned long long key = dev::argmax_key(prob[e], e);
      best = key > best ? key : best;
    }
    best = warp_max_u64(best);
    if (lane == j) {
      mine = dev::key_value(best);
      mine_id = dev::key_index(best);
    }
    __syncwarp();
    if (lane == 0) prob[dev::key_index(best)] = -1.f;
    __syncwarp();
  }

  // 6. renormalise (slot order, fp32), round, store
  float norm = 0.f;
#pragma unroll 1
  for (int j = 0; j < K; ++j) {
    const float p = __shfl_sync(0xffffffffu, mine, j);
    norm = j == 0 ? p : __fadd_rn(norm, p);
  }
  if (lane < K) {
    ids_out[lane] = mine_id;
    weights_out[lane] = dev::to_bf16(renorm ? __fdiv_rn(mine, norm) : mine);
  }
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  const int H = a.i(P_HIDDEN), E = a.i(P_NUM_EXPERTS), K = a.i(P_TOP_K);
  const bool renorm = a.i(P_RENORMALIZE) != 0;
  const bf16* x = a.operand<const bf16>(O_X);
  const bf16* nw = a.operand<const bf16>(O_NORM_WEIGHT);
  const bf16* gate = a.operand<const bf16>(O_WEIGHT);
  bf16* xn = a.operand<bf16>(O_X_NORM);
  int* ids_out = a.operand<int>(O_EXPERT_IDS);
  bf16* weights_out = a.operand<bf16>(O_EXPERT_WEIGHTS);
  const float eps = a.f(P_EPS);
  // Nothing below reads `a`: its slot pointer is one of the values the all-kinds build keeps in
  // local memory, and every late read of it is a reload (ptxas spill loads).
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int vpr = H / 8;  // task.py: H % 8 == 0
  bf16* xs = reinterpret_cast<bf16*>(a.smem);
  float* red = reinterpret_cast<float*>(a.smem + (H * 2 + 15) / 16 * 16);
  float* prob = red + 16;

  // 1. stage the row, sum of squares, inverse rms
  for (int v = tid; v < vpr; v += NUM_THREADS) dev::cp_async_act16(xs + v * 8, x + v * 8);
  dev::cp_async_wait_all();
  mpk::task_sync();
  float ss = 0.f;
  for (int v = tid; v < vpr; v += NUM_THREADS) {
    float f[8];
    dev::unpack8(*reinterpret_cast<const uint4*>(xs + v * 8), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
  }
  ss = dev::warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  mpk::task_sync();
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += red[w];  // every thread, the same order
  const float inv = dev::rms_inv(total, H, eps);

  // 2. x_norm, in place and to global (each thread rewrites only the vectors it read)
  for (int v = tid; v < vpr; v += NUM_THREADS) {
    float f[8], w[8];
    dev::unpack8(*reinterpret_cast<const uint4*>(xs + v * 8), f);
    dev::unpack8(dev::ld_weight_v4(nw + v * 8), w);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = dev::rmsnorm_elem(f[e], inv, w[e]);
    const uint4 packed = dev::pack8(f);
    *reinterpret_cast<uint4*>(xs + v * 8) = packed;
    *reinterpret_cast<uint4*>(xn + v * 8) = packed;
  }
  mpk::task_sync();

  // 3. logits
  const unsigned xs_addr = dev::smem_addr(xs);
#pragma unroll 1
  for (int e = warp; e < E; e += kWarps) {
    const float l = logit(gate + (long long)e * H, xs_addr, vpr, lane);
    if (lane == 0) prob[e] = l;
  }
  mpk::task_sync();  // the last barrier of the task: only warp 0 goes on
  if (warp == 0) route(prob, E, K, renorm, lane, ids_out, weights_out);
}


}  // namespace mpk::kinds::moe_router
