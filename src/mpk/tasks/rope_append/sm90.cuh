// rope_append, sm_90a: a prefill chunk's queries and keys normed and rotated, its keys and values
// appended to the cache, for one KV head and block of rows (semantics in task.py).
//
// Layouts (whole tensors through a.base): qkv [C, KVH*(G+2)*D] (row i, head h, vector j at
// i*KVH*(G+2)*D + (h*(G+2) + j)*D), q [C, KVH*G*D] (row i, head h, query g at
// i*KVH*G*D + (h*G + g)*D), k_cache / v_cache [num_pages, page_size, KVH, D].
// The task's rows go to groups of L = D/8 lanes (32/L groups a warp), a lane holding 8
// consecutive elements of each vector (one 16-byte load and store); a group asks for a row's
// vectors (kRowVecs at a time) and prefetches the table's cos and sin at its position to L1 at
// once, then finishes the vectors one by one, each query and the key reading cos and sin from
// L1: a round trip a row where G + 2 <= kRowVecs. (Two vectors a round trip, qwen3-8b's
// 2,048-row chunk's tasks took 34 us each on the H100; a row at once, 32 us on the H200: the
// task time barely moved, the chunk's TTFT did with the scheduler's spread, task.py cost:
// perf-log, thirty-sixth session.) RMSNorm sums over the group in lane order, RoPE takes each
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
// A row's vectors in flight at once: qwen3-8b's and llama's G + 2 = 6 (4 queries, the key, the
// value) in one round trip; a wider group takes its row in rounds of kRowVecs.
constexpr int kRowVecs = ROPE_ROW_VECS;  // task.py ROW_VECS

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

// One lane's part of a row: where the table's cos and sin of its 8 columns are (one position:
// the row's queries and key share them) and vectors [w0, w0 + kRowVecs) of the row as loaded.
struct RowPart {
  int row;              // chunk row (-1: none)
  bool live;            // a prompt row whose lane holds columns
  const float* rrow;    // the lane's cos at its position (sin D/2 further on)
  uint4 x[kRowVecs];
};

// Issue the loads of row `row`'s vectors [w0, w0 + kRowVecs) (and, with w0 == 0, an L1
// prefetch of its table entries).
__device__ __forceinline__ void load_row(const Ctx& c, int row, int w0, int e0, RowPart& r) {
  const int W = c.G + 2, half = c.D / 2;
  r.row = row;
  r.live = row >= 0 && row < c.n && e0 < c.D;
  const bf16* src = c.qkv + row * (long long)c.KVH * W * c.D + e0;
#pragma unroll
  for (int u = 0; u < kRowVecs; ++u)
    r.x[u] = r.live && w0 + u < W ? dev::ld_act_v4(src + (long long)(w0 + u) * c.D)
                                  : make_uint4(0u, 0u, 0u, 0u);
  r.rrow = c.rope + (long long)(c.p0 + (r.live ? row : 0)) * c.D + (e0 < half ? e0 : e0 - half);
  // The row's cos and sin lines into L1 beside the vectors (finish reads them from there for
  // each of the row's queries and its key; held in registers, six vectors' worth, they spilled
  // in the prefill plan's build: 32 / 48 B here and the kernel body's 184 -> 580 B). The table
  // is a weight (task.py cuda_unsupported): nothing writes it during a launch, so L1 is safe.
  if (r.live && w0 == 0) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(r.rrow));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(r.rrow + half));
  }
}

// Normalise, rotate and store vector `which` (x as loaded) of the row. The lanes of a warp hold
// different rows (one per group), so every lane runs the same shuffles; only the stores depend
// on the lane's row.
__device__ __forceinline__ void finish(const Ctx& c, const RowPart& r, const uint4& xv,
                                       int which, long long crow, int gbase, int gl, int L) {
  const int e0 = gl * 8, half = c.D / 2;
  const bool on = r.row >= 0 && gbase + L <= 32;  // lanes past the warp's groups idle
  const bool live = on && r.live, query = which < c.G;
  float x[8];
  dev::unpack8(xv, x);
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
  float cs[8] = {}, sn[8] = {};
  if (live && which <= c.G) {  // the table is read-only for the launch: the L1 path
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(r.rrow) + k);
      const float4 b = __ldg(reinterpret_cast<const float4*>(r.rrow + half) + k);
      cs[4 * k] = a.x, cs[4 * k + 1] = a.y, cs[4 * k + 2] = a.z, cs[4 * k + 3] = a.w;
      sn[4 * k] = b.x, sn[4 * k + 1] = b.y, sn[4 * k + 2] = b.z, sn[4 * k + 3] = b.w;
    }
  }
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
    *reinterpret_cast<uint4*>(c.q + r.row * (long long)c.KVH * c.G * c.D +
                              (long long)which * c.D + e0) =
        live ? dev::pack8(o) : make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  if (!live || crow < 0) return;  // padding, or no page: nothing to append
  if (which == c.G + 1)  // value: as is
    *reinterpret_cast<uint4*>(c.vc + crow + e0) = xv;
  else
    *reinterpret_cast<uint4*>(c.kc + crow + e0) = dev::pack8(o);
}

// Row `row` (-1: none) of the task: its vectors kRowVecs at a time, each round's loads issued
// together (one round trip a round, not one per two vectors).
__device__ __forceinline__ void row_task(const Ctx& c, int row, int e0, int gbase, int gl, int L) {
  const long long crow = row >= 0 && row < c.n && e0 < c.D ? cache_row(c, row) : -1;
  RowPart r;
#pragma unroll 1
  for (int w0 = 0; w0 < c.G + 2; w0 += kRowVecs) {
    load_row(c, row, w0, e0, r);
#pragma unroll
    for (int u = 0; u < kRowVecs; ++u)  // past the row's vectors: warp-uniform
      if (w0 + u < c.G + 2) finish(c, r, r.x[u], w0 + u, crow, gbase, gl, L);
  }
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
  // Group `gid` of warp `warp` takes rows r0 + its index, then every kWarps * groups rows on;
  // the bound follows the warp's first group, so every lane of a warp runs every shuffle.
  const int stride = kWarps * groups, first = warp * groups;
  for (int i = first; i < c.block; i += stride) {
    const int mine = i + min(gid, groups - 1);
    row_task(c, gid < groups && mine < c.block ? c.r0 + mine : -1, e0, gbase, gl, L);
  }
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) { run_task(a); }

}  // namespace mpk::kinds::rope_append
