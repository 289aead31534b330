// rope_append, sm_90a: a prefill chunk's queries and keys normed and rotated, its keys and values
// appended to the cache, for one KV head and block of rows (semantics in task.py).
//
// Layouts (whole tensors through a.base): qkv [C, KVH*(G+2)*D] (row i, head h, vector j at
// i*KVH*(G+2)*D + (h*(G+2) + j)*D), q [C, KVH*G*D] (row i, head h, query g at
// i*KVH*G*D + (h*G + g)*D), k_cache / v_cache [num_pages, page_size, KVH, D].
// A warp takes the task's (row, vector) pairs warp, warp + 8, ..., kPairs at a time with their
// loads in flight together; lane l holds elements l + 32i of a vector (common/rope.cuh).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/rope.cuh"

namespace mpk::kinds::rope_append {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kLanes = 128 / 32;  // elements per lane: head dims up to 128 (models/prefill.py)
constexpr int kPairs = 4;         // (row, vector) pairs a warp has in flight

struct Ctx {
  int G, D, KVH, PS, MAXP, NP, p0, r0, n, block;
  bool norm;
  float eps;
  const bf16* qkv;  // head h's first vector of row 0 (row stride KVH*(G+2)*D)
  const float* rope;
  const int* pt;
  bf16 *kc, *vc;  // head h of slot 0 of page 0 (slot stride KVH*D)
  bf16* q;        // head h's first query of row 0 (row stride KVH*G*D)
};

// The cache row (slot index times KVH*D) of position p, or -1 when its page entry is outside
// the page table or the pool.
__device__ __forceinline__ long long cache_row(const Ctx& c, int p) {
  const int index = p / c.PS;
  if (index >= c.MAXP) return -1;
  const int page = dev::ld_act_i32(c.pt + index);
  if (page < 0 || page >= c.NP) return -1;
  return ((long long)page * c.PS + p % c.PS) * c.KVH * c.D;
}

// Pair m of the task: row r0 + m / (G+2), vector m % (G+2) (queries, then the key, the value).
__device__ __forceinline__ void pairs(const Ctx& c, int m0, const float* nw, float* buf) {
  const int lane = threadIdx.x & 31, W = c.G + 2, half = c.D / 2;
  const long long qkv_row = (long long)c.KVH * W * c.D, q_row = (long long)c.KVH * c.G * c.D;
  float v[kPairs][kLanes], cs[kPairs][kLanes], sn[kPairs][kLanes];
  int row[kPairs], which[kPairs];
  long long crow[kPairs];
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {  // every load of the pairs first
    const int m = m0 + u * kWarps;
    row[u] = m < c.block * W ? c.r0 + m / W : -1;
    which[u] = m % W;
    const bool live = row[u] >= 0 && row[u] < c.n;
    const int p = c.p0 + row[u];
    crow[u] = live && which[u] >= c.G ? cache_row(c, p) : -1;
    const bf16* src = c.qkv + row[u] * qkv_row + (long long)which[u] * c.D;
    const float* rrow = c.rope + (long long)p * c.D;
#pragma unroll
    for (int i = 0; i < kLanes; ++i) {
      const int e = lane + 32 * i, r = e < half ? e : e - half;
      const bool on = live && e < c.D;
      v[u][i] = on ? dev::ld_act_bf16f(src + e) : 0.f;
      cs[u][i] = on && which[u] <= c.G ? dev::ld_act_f32(rrow + r) : 0.f;
      sn[u][i] = on && which[u] <= c.G ? dev::ld_act_f32(rrow + half + r) : 0.f;
    }
  }
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {
    if (row[u] < 0) continue;  // warp-uniform: past the task's pairs
    const bool query = which[u] < c.G, live = row[u] < c.n;
    if (!query && crow[u] < 0) continue;  // padding, or no page: nothing to append
    if (which[u] == c.G + 1) {  // value: as is
      for (int i = 0; i < kLanes; ++i) {
        const int e = lane + 32 * i;
        if (e < c.D) c.vc[crow[u] + e] = dev::to_bf16(v[u][i]);
      }
      continue;
    }
    bf16* dst = query ? c.q + row[u] * q_row + (long long)which[u] * c.D : c.kc + crow[u];
    if (!live) {  // a padding row's query: zeros
      for (int e = lane; e < c.D; e += 32) dst[e] = dev::to_bf16(0.f);
      continue;
    }
    float w[kLanes];
#pragma unroll
    for (int i = 0; i < kLanes; ++i) {
      const int e = lane + 32 * i;
      w[i] = c.norm && e < c.D ? nw[(query ? 0 : c.D) + e] : 1.f;
    }
    dev::norm_rope(v[u], cs[u], sn[u], w, c.norm, c.D, c.eps, buf,
                   [&](int e, bf16 ob) { dst[e] = ob; });
  }
}

}  // namespace detail

// Out of line, as the prefill plan's other kinds (gemm, attention_prefill): a task runs for
// microseconds, and its pairs' loads in flight get a register allocation of their own.
__device__ __noinline__ void run_task(const mpk::TaskArgs& a) {
  using namespace detail;
  Ctx c;
  c.G = a.i(P_GROUP);
  c.D = a.i(P_HEAD_DIM);
  c.KVH = a.i(P_KV_HEADS);
  c.PS = a.i(P_PAGE_SIZE);
  c.MAXP = a.i(P_MAX_PAGES);
  c.NP = a.i(P_NUM_PAGES);
  c.block = a.i(P_BLOCK);
  c.norm = a.i(P_HAS_QK_NORM) != 0 && a.has(O_Q_NORM) && a.has(O_K_NORM);
  c.eps = a.f(P_EPS);
  const int h = a.point(0);
  c.r0 = a.point(1) * c.block;
  c.qkv = reinterpret_cast<const bf16*>(a.base[O_QKV]) + (long long)h * (c.G + 2) * c.D;
  c.rope = reinterpret_cast<const float*>(a.base[O_ROPE]);
  c.pt = reinterpret_cast<const int*>(a.base[O_PAGE_TABLE]);
  c.kc = reinterpret_cast<bf16*>(a.base[O_K_CACHE]) + (long long)h * c.D;
  c.vc = reinterpret_cast<bf16*>(a.base[O_V_CACHE]) + (long long)h * c.D;
  c.q = reinterpret_cast<bf16*>(a.base[O_Q]) + (long long)h * c.G * c.D;
  c.p0 = dev::ld_act_i32(reinterpret_cast<const int*>(a.base[O_POSITIONS]));
  const int chunk = dev::ld_act_i32(reinterpret_cast<const int*>(a.base[O_CHUNK]));
  const int max_pos = a.i(P_MAX_POS);
  // task.py prompt_rows: rows at positions past the rope table (or p0 < 0) are padding
  c.n = c.p0 < 0 ? 0 : max(0, min(chunk, max_pos - c.p0));
  if (c.PS <= 0 || c.D % 16) return;  // task.py refuses these
  // Prefill plans run on CUDA up to attention_prefill's CUDA_MAX_HEAD_DIM (supports_prefill).
  if (c.D > 32 * kLanes) __trap();
  // The norm weights as floats (shared by every pair), then each warp's RoPE buffer.
  float* nw = reinterpret_cast<float*>(a.smem);
  float* buf = nw + 2 * c.D + (threadIdx.x >> 5) * c.D;
  for (int e = threadIdx.x; c.norm && e < c.D; e += NUM_THREADS) {
    nw[e] = dev::ld_weight_bf16f(a.operand<const bf16>(O_Q_NORM) + e);
    nw[c.D + e] = dev::ld_weight_bf16f(a.operand<const bf16>(O_K_NORM) + e);
  }
  mpk::task_sync();
  const int total = c.block * (c.G + 2);
  for (int m0 = threadIdx.x >> 5; m0 < total; m0 += kWarps * kPairs) pairs(c, m0, nw, buf);
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) { run_task(a); }

}  // namespace mpk::kinds::rope_append
