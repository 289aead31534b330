// moe_router, sm_90a: one batch row's softmax over its router logits, top-k and routing weights
// (semantics and rounding points in task.py; steps 3-6 below are its docstring's).
//
// Layouts (default splits, grid (B,)): logits, expert_ids, expert_weights are cut by rows, so
// their operand pointers point at this task's row. Shared scratch (task.py scratch_bytes):
// [prob: E f32].
//
// Warp 0 alone (the other warps leave at once; the runtime's barrier after the task pairs with
// theirs): the E bf16 logits (an activation: L2-coherent loads) into prob, then max, exp, sum,
// probabilities as torch's CPU softmax (p = e * (1 / sum)), then K rounds of a warp argmax over
// (probability, lower id first) keys; lane j keeps slot j. The renormalising sum adds the slots
// in order, as route() does.
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

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// Steps 3-6 on warp 0 (prob: the E logits, overwritten); lane j < K stores slot j.
__device__ __forceinline__ void route(float* prob, int E, int K, bool renorm, int lane,
                                      int* ids_out, bf16* weights_out) {
  // 3. softmax over all E experts in fp32
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

  // 4. top-k: K rounds of a warp argmax; a chosen expert's probability becomes -1 (below every
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

  // 5-6. renormalise (slot order, fp32), round, store
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
  if (threadIdx.x >= 32) return;  // warp 0 routes the row
  const int E = a.i(P_NUM_EXPERTS), K = a.i(P_TOP_K);
  const bool renorm = a.i(P_RENORMALIZE) != 0;
  const bf16* logits = a.operand<const bf16>(O_LOGITS);
  int* ids_out = a.operand<int>(O_EXPERT_IDS);
  bf16* weights_out = a.operand<bf16>(O_EXPERT_WEIGHTS);
  float* prob = reinterpret_cast<float*>(a.smem);
  const int lane = threadIdx.x;
  for (int e = lane; e < E; e += 32) prob[e] = dev::ld_act_bf16f(logits + e);
  __syncwarp();
  route(prob, E, K, renorm, lane, ids_out, weights_out);
}

}  // namespace mpk::kinds::moe_router
