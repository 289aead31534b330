// moe_router, sm_90a: one batch row's softmax over its router logits, top-k and routing weights
// (semantics and rounding points in task.py; steps 3-6 below are its docstring's).
//
// Layouts (default splits, grid (B,)): logits, expert_ids, expert_weights are cut by rows, so
// their operand pointers point at this task's row. No shared scratch.
//
// Warp 0 alone (the other warps leave at once; the runtime's barrier after the task pairs with
// theirs). Lane l keeps the probabilities of experts e = l + 32 i in registers (kPer slots, a
// compile-time count, so no array is indexed at run time): all its logits are loaded before any
// is used (an activation: L2-coherent loads; a loop of load-then-store paid one L2 round trip
// per 32 experts: ~3.7 us a row on qwen3-30b-a3b, perf-log nineteenth session). Then max, exp,
// sum (each lane's experts in order, then the warp's butterfly), probabilities as torch's CPU
// softmax (p = e * (1 / sum)), then K rounds of a warp argmax over (probability, lower id
// first) keys: each lane offers its best key, the winner's lane drops that expert and finds
// its next best. Lane j keeps slot j. The renormalising sum adds the slots in order, as
// route() does.
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

constexpr int kPer = ROUTER_EXPERTS_PER_LANE;  // task.py cuda_constants: ceil(E / 32)

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// This lane's best (probability, lower id first) key; 0 when it holds no expert left.
__device__ __forceinline__ unsigned long long lane_best(const float (&prob)[kPer], int E,
                                                        int lane) {
  unsigned long long best = 0ull;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    const unsigned long long key = e < E ? dev::argmax_key(prob[i], e) : 0ull;
    best = key > best ? key : best;
  }
  return best;
}

// Steps 3-6 on warp 0 (prob: this lane's logits, overwritten); lane j < K stores slot j.
__device__ __forceinline__ void route(float (&prob)[kPer], int E, int K, bool renorm, int lane,
                                      int* ids_out, bf16* weights_out) {
  // 3. softmax over all E experts in fp32
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (lane + 32 * i < E) m = fmaxf(m, prob[i]);
  m = dev::warp_max(m);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (lane + 32 * i < E) {
      prob[i] = expf(__fsub_rn(prob[i], m));
      sum += prob[i];
    }
  }
  const float rsum = __fdiv_rn(1.f, dev::warp_sum(sum));
#pragma unroll
  for (int i = 0; i < kPer; ++i) prob[i] = __fmul_rn(prob[i], rsum);

  // 4. top-k: K rounds of a warp argmax; the chosen expert's probability becomes -1 (below
  // every probability) on its lane, which then offers its next best key.
  float mine = 0.f;
  int mine_id = 0;
  unsigned long long offer = lane_best(prob, E, lane);
#pragma unroll 1
  for (int j = 0; j < K; ++j) {
    const unsigned long long best = warp_max_u64(offer);
    const int id = dev::key_index(best);
    if (lane == j) {
      mine = dev::key_value(best);
      mine_id = id;
    }
    if ((id & 31) == lane) {
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (lane + 32 * i == id) prob[i] = -1.f;
      offer = lane_best(prob, E, lane);
    }
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
  const int lane = threadIdx.x;
  float prob[kPer];
  unsigned raw[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i)  // every load issued before any is used
    raw[i] = lane + 32 * i < E ? dev::ld_act_u16(logits + lane + 32 * i) : 0u;
#pragma unroll
  for (int i = 0; i < kPer; ++i) prob[i] = __uint_as_float(raw[i] << 16);
  route(prob, E, K, renorm, lane, ids_out, weights_out);
}

}  // namespace mpk::kinds::moe_router
