// moe_router, sm_90a: one batch row's softmax over its router logits, top-k and routing weights
// (semantics and rounding points in task.py; steps 3-6 below are its docstring's).
//
// Layouts (default splits, grid (B,)): logits, expert_ids, expert_weights are cut by rows, so
// their operand pointers point at this task's row. Shared scratch (task.py scratch_bytes):
// [keys: E u32, zero-padded to a multiple of 4][top_p: 8 f32][top_id: 8 i32] (slots < K used).
//
// 1. Warp 0: lane l keeps the probabilities of experts e = l + 32 i in registers (kPer slots, a
//    compile-time count, so no array is indexed at run time), all its logits loaded before any
//    is used (an activation: L2-coherent loads; flagged logits, common/flags.cuh: word e / 2,
//    half e & 1, each word polled until it carries its epoch). Max, exp, sum (each lane's
//    experts in order, then the warp's butterfly), probabilities as torch's CPU softmax (p = e *
//    (1 / sum)), each stored as its order-preserving key (dev::ordered_key).
// 2. Every thread: the rank of an expert e is the number of experts whose key is larger, or
//    equal with a lower id (the (probability, lower id first) order of dev::argmax_key); ranks
//    below K are the slots. All ranks at once: the K rounds of a warp argmax this replaces were
//    a serial chain of shuffles, ~3.2 us a row even with the code warm (perf-log, nineteenth
//    session, probe router_twice).
// 3. Warp 0: lane j < K takes slot j; the renormalising sum adds the slots in order, as
//    route() does. Flagged ids (batch 1): each id is stored as a word with its epoch, after
//    every read of the task (the logits, in step 1).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/flags.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/sampling.cuh"

namespace mpk::kinds::moe_router {
namespace detail {

using bf16 = __nv_bfloat16;

constexpr int kPer = ROUTER_EXPERTS_PER_LANE;  // task.py cuda_constants: ceil(E / 32)
constexpr int kMaxTopK = 8;                    // task.py MAX_TOP_K

// Step 1 on warp 0 (prob: this lane's logits, overwritten): keys[e] = ordered key of p_e.
__device__ __forceinline__ void softmax_keys(float (&prob)[kPer], int E, int E4, int lane,
                                             unsigned* keys) {
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
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    if (e < E) keys[e] = dev::ordered_key(__fmul_rn(prob[i], rsum));
    else if (e < E4) keys[e] = 0u;  // padding: below every real key
  }
}

// Step 1's loads: this lane's logits (experts lane + 32 i) as raw bf16 bits, all in flight
// before any is used. Flagged (ep != 0): expert e is half e & 1 of word e / 2, and every word of
// the row is polled (lanes 2m and 2m + 1 both poll word m) until it carries epoch ep.
__device__ __forceinline__ void load_logits(const mpk::TaskArgs& a, int E, int lane, uint32_t ep,
                                            unsigned (&raw)[kPer]) {
  if (ep == 0u) {
    const bf16* logits = a.operand<const bf16>(O_LOGITS);
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      raw[i] = lane + 32 * i < E ? dev::ld_act_u16(logits + lane + 32 * i) : 0u;
    return;
  }
  const dev::flag_word* words = dev::flag_operand<const dev::flag_word>(a, O_LOGITS);
  dev::flag_word w[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    w[i] = e < E ? dev::ld_flag(words + e / 2) : 0ull;
  }
  const dev::Poll poll;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    raw[i] = 0u;
    if (e < E) {
      const uint32_t pair = dev::poll_word(words + e / 2, w[i], ep, poll);
      raw[i] = (e & 1) ? pair >> 16 : pair & 0xffffu;
    }
  }
}

// Step 2 for expert e: its rank among the E4 (padded) keys; slots below K are written.
__device__ __forceinline__ void rank_expert(const unsigned* keys, int E4, int K, int e,
                                            float* top_p, int* top_id) {
  const unsigned ke = keys[e];
  int r0 = 0, r1 = 0, r2 = 0, r3 = 0;  // four counts: no one chain of dependent adds
#pragma unroll 4
  for (int f = 0; f < E4; f += 4) {
    const uint4 q = *reinterpret_cast<const uint4*>(keys + f);
    r0 += (q.x > ke) | ((q.x == ke) & (f < e));
    r1 += (q.y > ke) | ((q.y == ke) & (f + 1 < e));
    r2 += (q.z > ke) | ((q.z == ke) & (f + 2 < e));
    r3 += (q.w > ke) | ((q.w == ke) & (f + 3 < e));
  }
  const int rank = r0 + r1 + r2 + r3;
  if (rank < K) {
    top_p[rank] = dev::ordered_value(ke);
    top_id[rank] = e;
  }
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  const int E = a.i(P_NUM_EXPERTS), K = a.i(P_TOP_K), E4 = (E + 3) & ~3;
  const bool renorm = a.i(P_RENORMALIZE) != 0;
  unsigned* keys = reinterpret_cast<unsigned*>(a.smem);
  float* top_p = reinterpret_cast<float*>(a.smem + E4 * 4);
  int* top_id = reinterpret_cast<int*>(top_p + kMaxTopK);
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid < 32) {  // 1.
    float prob[kPer];
    unsigned raw[kPer];
    load_logits(a, E, lane, dev::flag_epoch<FLAGGED>(a, O_LOGITS), raw);
#pragma unroll
    for (int i = 0; i < kPer; ++i) prob[i] = __uint_as_float(raw[i] << 16);
    softmax_keys(prob, E, E4, lane, keys);
  }
  mpk::task_sync();
  for (int e = tid; e < E; e += NUM_THREADS) rank_expert(keys, E4, K, e, top_p, top_id);  // 2.
  mpk::task_sync();
  if (tid >= 32) return;  // 3. on warp 0
  float norm = 0.f;
#pragma unroll 1
  for (int j = 0; j < K; ++j) norm = j == 0 ? top_p[0] : __fadd_rn(norm, top_p[j]);
  if (lane < K) {
    const float mine = top_p[lane];
    const uint32_t ids_ep = dev::flag_epoch<FLAGGED>(a, O_EXPERT_IDS);
    if (ids_ep == 0u)
      a.operand<int>(O_EXPERT_IDS)[lane] = top_id[lane];
    else  // batch 1 (task.py): moe_gate_up polls the words, not this task's counter
      dev::st_flag(dev::flag_operand<dev::flag_word, 1>(a, O_EXPERT_IDS) + lane,
                   dev::make_flag_word(static_cast<uint32_t>(top_id[lane]), ids_ep));
    a.operand<bf16>(O_EXPERT_WEIGHTS)[lane] = dev::to_bf16(renorm ? __fdiv_rn(mine, norm) : mine);
  }
}

}  // namespace mpk::kinds::moe_router
