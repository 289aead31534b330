// rope_append, sm_90a: a prefill chunk's queries and keys normed and rotated, its keys and values
// appended to the cache, for one KV head and block of rows (semantics in task.py).
//
// Layouts (whole tensors through a.base): qkv [C, KVH*(G+2)*D] (row i, head h, vector j at
// i*KVH*(G+2)*D + (h*(G+2) + j)*D), q [C, KVH*G*D] (row i, head h, query g at
// i*KVH*G*D + (h*G + g)*D), k_cache / v_cache [num_pages, page_size, KVH, D].
// The task's (row, vector) pairs in row-major order go to groups of L = D/8 lanes (32/L groups a
// warp), a lane holding 8 consecutive elements (one 16-byte load and store); a group has kVecs
// vectors' loads in flight at once. RMSNorm sums over the group in lane order, RoPE takes each
// element's partner (e +- D/2) from lane +- L/2 of the group: the rounding of `attention`.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"

namespace mpk::kinds::rope_append {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kVecs = 2;  // vectors a lane group has in flight

struct Ctx {
  int G, D, KVH, PS, MAXP, NP, p0, r0, n, block, first;  // first: pages[0]'s page index
  bool norm;
  float eps;
  const bf16* qkv;  // head h's first vector of row 0 (row stride KVH*(G+2)*D)
  const float* rope;
  bf16 *kc, *vc;  // head h of slot 0 of page 0 (slot stride KVH*D)
  bf16* q;        // head h's first query of row 0 (row stride KVH*G*D)
  const float* nw;   // shared: q_norm, k_norm as floats [2][D]
  const int* pages;  // shared: the page entries of the task's rows' positions
};

// The cache row (slot index times KVH*D) of chunk row i, or -1 when its page entry is outside
// the page table or the pool.
__device__ __forceinline__ long long cache_row(const Ctx& c, int i) {
  const int p = c.p0 + i, index = p / c.PS;
  if (index >= c.MAXP) return -1;
  const int page = c.pages[index - c.first];
  if (page < 0 || page >= c.NP) return -1;
  return ((long long)page * c.PS + p % c.PS) * c.KVH * c.D;
}

struct Vec {
  int row, which;  // chunk row (-1: none) and vector (queries, the key G, the value G + 1)
  uint4 x;         // the lane's 8 elements as loaded
  float4 cs[2], sn[2];  // the table's cos and sin at those elements' columns
};

// Issue vector m's loads (m >= total: none).
__device__ __forceinline__ void load(const Ctx& c, int m, int total, int e0, Vec& v) {
  const int W = c.G + 2, half = c.D / 2;
  v.row = m < total ? c.r0 + m / W : -1;
  v.which = m % W;
  const bool live = v.row >= 0 && v.row < c.n && e0 < c.D;
  v.x = live ? dev::ld_act_v4(c.qkv + v.row * (long long)c.KVH * W * c.D +
                              (long long)v.which * c.D + e0)
             : make_uint4(0u, 0u, 0u, 0u);
  v.cs[0] = v.cs[1] = v.sn[0] = v.sn[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (live && v.which <= c.G) {
    const float* rrow = c.rope + (long long)(c.p0 + v.row) * c.D + (e0 < half ? e0 : e0 - half);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      v.cs[k] = __ldcg(reinterpret_cast<const float4*>(rrow) + k);
      v.sn[k] = __ldcg(reinterpret_cast<const float4*>(rrow + half) + k);
    }
  }
}

// Normalise, rotate and store vector v. The lanes of a warp hold different vectors (one per
// group), so every lane runs the same shuffles; only the stores depend on the lane's vector.
__device__ __forceinline__ void finish(const Ctx& c, const Vec& v, int gbase, int gl, int L) {
  const int e0 = gl * 8, half = c.D / 2;
  const bool on = v.row >= 0 && gbase + L <= 32;  // lanes past the warp's groups idle
  const bool live = on && v.row < c.n, query = v.which < c.G;
  float x[8];
  dev::unpack8(v.x, x);
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) ss = fmaf(x[k], x[k], ss);
  float total = 0.f;  // the group's lanes in order (L need not be a power of two)
  for (int j = 0; j < L; ++j) total += __shfl_sync(0xffffffffu, ss, gbase + j);
  if (c.norm) {
    const float inv = dev::rms_inv(total, c.D, c.eps);
    const float* w = c.nw + (query ? 0 : c.D) + e0;
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = dev::rmsnorm_elem(x[k], inv, on ? w[k] : 1.f);
  }
  const int partner = gbase + (gl < L / 2 ? gl + L / 2 : gl - L / 2);
  const float cs[8] = {v.cs[0].x, v.cs[0].y, v.cs[0].z, v.cs[0].w,
                       v.cs[1].x, v.cs[1].y, v.cs[1].z, v.cs[1].w};
  const float sn[8] = {v.sn[0].x, v.sn[0].y, v.sn[0].z, v.sn[0].w,
                       v.sn[1].x, v.sn[1].y, v.sn[1].z, v.sn[1].w};
  float o[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float y = __shfl_sync(0xffffffffu, x[k], partner);
    o[k] = e0 < half  // x1 * cos - x2 * sin | x2 * cos + x1 * sin
               ? __fsub_rn(__fmul_rn(x[k], cs[k]), __fmul_rn(y, sn[k]))
               : __fadd_rn(__fmul_rn(x[k], cs[k]), __fmul_rn(y, sn[k]));
  }
  if (!on) return;
  if (query) {  // a padding row's query: zeros
    *reinterpret_cast<uint4*>(c.q + v.row * (long long)c.KVH * c.G * c.D +
                              (long long)v.which * c.D + e0) =
        live ? dev::pack8(o) : make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  const long long crow = live ? cache_row(c, v.row) : -1;
  if (crow < 0) return;  // padding, or no page: nothing to append
  if (v.which == c.G + 1)  // value: as is
    *reinterpret_cast<uint4*>(c.vc + crow + e0) = v.x;
  else
    *reinterpret_cast<uint4*>(c.kc + crow + e0) = dev::pack8(o);
}

}  // namespace detail

// Out of line, as the prefill plan's other kinds (gemm, attention_prefill): a task runs for
// microseconds, and its vectors' loads in flight get a register allocation of their own.
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
  c.kc = reinterpret_cast<bf16*>(a.base[O_K_CACHE]) + (long long)h * c.D;
  c.vc = reinterpret_cast<bf16*>(a.base[O_V_CACHE]) + (long long)h * c.D;
  c.q = reinterpret_cast<bf16*>(a.base[O_Q]) + (long long)h * c.G * c.D;
  c.p0 = dev::ld_act_i32(reinterpret_cast<const int*>(a.base[O_POSITIONS]));
  const int chunk = dev::ld_act_i32(reinterpret_cast<const int*>(a.base[O_CHUNK]));
  // rope_append/task.py segment_rows: rows past the rope table (or p0 < 0) are padding
  c.n = c.p0 < 0 ? 0 : max(0, min(chunk, a.i(P_MAX_POS) - c.p0));
  if (c.PS <= 0 || c.D % 16 || c.D > 256) return;  // task.py refuses these
  // Shared: the norm weights as floats, then the page entries of the task's prompt rows.
  float* nw = reinterpret_cast<float*>(a.smem);
  int* pages = reinterpret_cast<int*>(nw + 2 * c.D);
  const int live_rows = max(0, min(c.block, c.n - c.r0));
  c.first = live_rows > 0 ? (c.p0 + c.r0) / c.PS : 0;
  const int count = live_rows > 0 ? min((c.p0 + c.r0 + live_rows - 1) / c.PS, c.MAXP - 1) -
                                        c.first + 1 : 0;
  const int* table = reinterpret_cast<const int*>(a.base[O_PAGE_TABLE]);
  for (int i = threadIdx.x; i < count; i += NUM_THREADS) pages[i] = dev::ld_act_i32(table + c.first + i);
  for (int e = threadIdx.x; c.norm && e < c.D; e += NUM_THREADS) {
    nw[e] = dev::ld_weight_bf16f(a.operand<const bf16>(O_Q_NORM) + e);
    nw[c.D + e] = dev::ld_weight_bf16f(a.operand<const bf16>(O_K_NORM) + e);
  }
  c.nw = nw;
  c.pages = pages;
  mpk::task_sync();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int L = c.D / 8, groups = 32 / L, gid = lane / L, gl = lane - gid * L;
  const int gbase = gid * L, e0 = gid < groups ? gl * 8 : c.D;  // lanes past the groups idle
  const int total = c.block * (c.G + 2);
  const int stride = kWarps * groups;  // vectors one round of every group takes
  for (int m0 = warp * groups + min(gid, groups - 1); m0 - min(gid, groups - 1) < total;
       m0 += stride * kVecs) {
    Vec v[kVecs];
#pragma unroll
    for (int u = 0; u < kVecs; ++u) load(c, m0 + u * stride, gid < groups ? total : 0, e0, v[u]);
#pragma unroll
    for (int u = 0; u < kVecs; ++u) finish(c, v[u], gbase, gl, L);
  }
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) { run_task(a); }

}  // namespace mpk::kinds::rope_append
