// attention_prefill, sm_90a: causal GQA attention of a prefill chunk for one KV head and block
// of query rows, every key and value read from the cache (rope_append prepared the queries and
// appended the chunk's keys before it; semantics in task.py).
//
// Layouts (whole tensors through a.base): q, out [C, KVH*G*D] (row i, head h, query g at
// i*KVH*G*D + (h*G + g)*D), k_cache / v_cache [num_pages, page_size, KVH, D]. Task (h, j) owns
// the row pieces [ra, ra + block) and [rb, rb + block), ra = j * block, rb = C - (j + 1) * block
// (task.py row_pieces; one piece of C rows when block is C); a piece's real rows end at n.
//
// The task's query vectors (row, query head) of its real rows, piece by piece in row-major
// order, are taken 128 at a time (a pass: 16 per warp, one m16 tile each), copied into shared
// memory with cp.async. Per pass, keys and values go in blocks of 64 positions through two
// shared-memory buffers: block b + 1 is copied (cp.async, every thread a quarter of one key;
// masked positions as zeros) while block b is attended. The page table of the positions the
// task sees is staged once. A position whose page entry is outside the table or the pool is
// masked. Scores and P.V run on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate; P
// rounded to bf16 as flash attention does), online softmax in the exp2 domain per row.
// head_dim: a multiple of 16 up to 128 (task.py CUDA_MAX_HEAD_DIM). Rows are staged DMAX wide
// (PREFILL_HEAD_DIM, generated: 64 or 128, task.py staged_head_dim), zeros past D, so the loops
// over the head dimension have compile-time bounds: with a branch on the runtime D between k
// steps, ptxas issued each ldmatrix just before its MMAs (ncu: 24% of the samples were MMAs
// waiting for their ldmatrix; twenty-sixth session).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/tile.cuh"

namespace mpk::kinds::attention_prefill {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int DMAX = PREFILL_HEAD_DIM;  // staged row width (task.py staged_head_dim)
constexpr int ROW = DMAX + 8;           // a staged row, bf16 (+ 8: ldmatrix rows in distinct banks)
constexpr int QROWS = 16 * kWarps;  // query vectors per pass
constexpr int KB = 64;             // key positions per block
constexpr float kLog2e = 1.4426950408889634f;
static_assert(NUM_THREADS == 4 * KB, "a key block is prepared one quarter-vector per thread");

struct Ctx {  // sizeof under 256 bytes (task.py scratch_bytes)
  int G, D, KVH, PS, MAXP, NP, p0;
  int ra, na, rb;      // the pieces' first rows; piece a's real rows (b's follow only if all are)
  float scale2;        // scale * log2(e)
  long long q_row;     // q / out row stride, elements
  const bf16* q;       // head h's first query of row 0
  const bf16 *kc, *vc; // head h of slot 0 of page 0 (slot stride KVH*D)
  bf16* out;           // head h's first query of row 0
  uint32_t qs;         // shared addresses: queries [QROWS][row]
  uint32_t ks[2], vs[2];  // keys, values [KB][row] of the two block buffers
  int* kok[2];         // [KB] whether each key of a buffer's block is visible at all
  const int* pages;    // the staged page-table entries of positions [0, p0 + hi)
};

// Zeros over this quarter's 16-byte chunks (q, q + 4, ...) of a staged row.
__device__ __forceinline__ void zero_quarter(uint32_t row, int q) {
#pragma unroll
  for (int k = q; k < DMAX / 8; k += 4)
    asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};" ::"r"(row + k * 16), "r"(0));
}

// Cache row (slot index times KVH*D, head h) of position p (< p0 + hi: staged), or -1 when its
// page entry is outside the table or the pool.
__device__ __forceinline__ long long cache_row(const Ctx& c, int p) {
  const int index = p / c.PS;
  if (index >= c.MAXP) return -1;
  const int page = c.pages[index];
  if (page < 0 || page >= c.NP) return -1;
  return ((long long)page * c.PS + p % c.PS) * c.KVH * c.D;
}

// Issue the copies of positions [k0, k0 + KB) (those below `kend`) into buffer `buf`, and their
// flags; the caller commits them as one group.
__device__ __forceinline__ void issue_block(const Ctx& c, int k0, int kend, int buf) {
  const int kl = threadIdx.x >> 2, q = threadIdx.x & 3, kp = k0 + kl;
  const uint32_t krow = c.ks[buf] + kl * ROW * 2, vrow = c.vs[buf] + kl * ROW * 2;
  const long long slot = kp < kend ? cache_row(c, kp) : -1;
  if (slot < 0) {
    zero_quarter(krow, q);
    zero_quarter(vrow, q);
  } else {
#pragma unroll
    for (int k = q; k < DMAX / 8; k += 4) {  // zeros past D (nothing read there)
      dev::cp_async_act16_or_zero(krow + k * 16, c.kc + slot + 8 * k, k < c.D / 8);
      dev::cp_async_act16_or_zero(vrow + k * 16, c.vc + slot + 8 * k, k < c.D / 8);
    }
  }
  if (q == 0) c.kok[buf][kl] = slot >= 0;
}

static_assert(sizeof(Ctx) <= 256, "task.py scratch_bytes reserves 256 bytes for the context");

// The chunk row of the task's query vector m, and its query head (G vectors a row, piece a's
// real rows first).
__device__ __forceinline__ int vector_row(const Ctx& c, int m) {
  const int ma = c.na * c.G;
  return m < ma ? c.ra + m / c.G : c.rb + (m - ma) / c.G;
}
__device__ __forceinline__ int vector_head(const Ctx& c, int m) {
  const int ma = c.na * c.G;
  return (m < ma ? m : m - ma) % c.G;
}

struct Rows {  // one warp's 16 query vectors: running max / sum and output per row g, g + 8
  float m[2], l[2], o[DMAX / 8][4];
  int qpos[2];  // the row's position (-1: no row: sees nothing)
};

// Scores of the warp's rows against keys [k0 + kh, k0 + kh + KSUB) of the staged block, masked,
// folded into the running state. KSUB is the whole block: 32 (two updates a block) measured
// 0.8 ms slower in qwen3-8b's 1,024-row chunk on the H100 (half the rescales and shuffles go;
// the 64 scores a thread still fit beside the output; twenty-sixth session).
constexpr int KSUB = 64;
__device__ __forceinline__ void attend_keys(const Ctx& c, Rows& r, int k0, int kh, int buf) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
  float s[KSUB / 8][4];
#pragma unroll
  for (int ni = 0; ni < KSUB / 8; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[ni][e] = 0.f;
  const uint32_t qa = c.qs + ((warp * 16 + (lane & 15)) * ROW + (lane >> 4) * 8) * 2;
  const uint32_t kb =
      c.ks[buf] + ((kh + (lane & 7) + ((lane >> 4) << 3)) * ROW + ((lane >> 3) & 1) * 8) * 2;
#pragma unroll
  for (int kk = 0; kk < DMAX / 16; ++kk) {
    uint32_t a0, a1, a2, a3;
    dev::ldmatrix_x4(qa + kk * 32, a0, a1, a2, a3);
#pragma unroll
    for (int nj = 0; nj < KSUB / 16; ++nj) {
      uint32_t b0, b1, b2, b3;
      dev::ldmatrix_x4(kb + (nj * 16 * ROW + kk * 16) * 2, b0, b1, b2, b3);
      dev::mma_bf16_16816(s[2 * nj], a0, a1, a2, a3, b0, b1);
      dev::mma_bf16_16816(s[2 * nj + 1], a0, a1, a2, a3, b2, b3);
    }
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = -INFINITY;
#pragma unroll
    for (int ni = 0; ni < KSUB / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kl = kh + ni * 8 + 2 * t + e;
        const bool visible = c.kok[buf][kl] != 0 && k0 + kl <= r.qpos[rr];
        const float x = visible ? s[ni][2 * rr + e] * c.scale2 : -INFINITY;
        s[ni][2 * rr + e] = x;
        mx = fmaxf(mx, x);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(r.m[rr], mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: all p are 0
    const float alpha = exp2f(r.m[rr] - base);
    float sum = 0.f;
#pragma unroll
    for (int ni = 0; ni < KSUB / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2f(s[ni][2 * rr + e] - base);
        s[ni][2 * rr + e] = p;
        sum += p;
      }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    r.l[rr] = r.l[rr] * alpha + sum;
    r.m[rr] = m_new;
#pragma unroll
    for (int dt = 0; dt < DMAX / 8; ++dt) {
      r.o[dt][2 * rr] *= alpha;
      r.o[dt][2 * rr + 1] *= alpha;
    }
  }
  const uint32_t vb =
      c.vs[buf] + ((kh + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW + (lane >> 4) * 8) * 2;
#pragma unroll
  for (int kk = 0; kk < KSUB / 16; ++kk) {
    const uint32_t a0 = dev::pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
    const uint32_t a1 = dev::pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
    const uint32_t a2 = dev::pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    const uint32_t a3 = dev::pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
    for (int dp = 0; dp < DMAX / 16; ++dp) {
      uint32_t b0, b1, b2, b3;
      dev::ldmatrix_x4_trans(vb + (kk * 16 * ROW + dp * 16) * 2, b0, b1, b2, b3);
      dev::mma_bf16_16816(r.o[2 * dp], a0, a1, a2, a3, b0, b1);
      dev::mma_bf16_16816(r.o[2 * dp + 1], a0, a1, a2, a3, b2, b3);
    }
  }
}

// One pass: query vectors [mlo, mlo + count) of the task (vector_row, vector_head).
__device__ __forceinline__ void pass(const Ctx& c, int mlo, int count) {
  // The context, its flags and page entries are in shared memory: said so, ptxas reads them with
  // shared loads (generic loads wait on the long scoreboard, like global ones).
  __builtin_assume(__isShared(&c));
  __builtin_assume(__isShared(c.kok[0]) && __isShared(c.kok[1]) && __isShared(c.pages));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int ihi = vector_row(c, mlo + count - 1);  // rows grow with m
  mpk::task_sync();  // the previous pass is done with the staged queries and both buffers
  for (int m = threadIdx.x >> 2; m < QROWS; m += NUM_THREADS / 4) {  // a quarter row each
    const uint32_t dst = c.qs + m * ROW * 2;
    const int q = threadIdx.x & 3;
    if (m >= count) {
      zero_quarter(dst, q);
      continue;
    }
    const int i = vector_row(c, mlo + m), gq = vector_head(c, mlo + m);
    const bf16* src = c.q + i * c.q_row + (long long)gq * c.D;
#pragma unroll
    for (int k = q; k < DMAX / 8; k += 4)
      dev::cp_async_act16_or_zero(dst + k * 16, src + 8 * k, k < c.D / 8);
  }
  Rows r;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int m = warp * 16 + g + 8 * rr;
    r.m[rr] = -INFINITY;
    r.l[rr] = 0.f;
    r.qpos[rr] = m < count ? c.p0 + vector_row(c, mlo + m) : -1;
  }
#pragma unroll
  for (int dt = 0; dt < DMAX / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) r.o[dt][e] = 0.f;
  const bool active = warp * 16 < count;  // warp-uniform
  const int kend = c.p0 + ihi + 1;        // positions any row of the pass sees
  const int blocks = (kend + KB - 1) / KB;
  issue_block(c, 0, kend, 0);
  dev::cp_async_commit();  // the queries and block 0
  for (int b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) {  // block b + 1 lands while block b is attended
      issue_block(c, (b + 1) * KB, kend, (b + 1) & 1);
      dev::cp_async_commit();
      dev::cp_async_wait_group(1);
    } else {
      dev::cp_async_wait_all();
    }
    mpk::task_sync();  // every thread's copies and flags of block b
    if (active)
#pragma unroll 1
      for (int kh = 0; kh < KB; kh += KSUB) attend_keys(c, r, b * KB, kh, b & 1);
    mpk::task_sync();  // buffer b & 1 is refilled next
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int m = warp * 16 + g + 8 * rr;
    if (m >= count) continue;
    const float inv = r.l[rr] > 0.f ? 1.f / r.l[rr] : 0.f;  // a row that saw nothing: zeros
    const int i = vector_row(c, mlo + m), gq = vector_head(c, mlo + m);
    bf16* dst = c.out + i * c.q_row + (long long)gq * c.D;
#pragma unroll
    for (int dt = 0; dt < DMAX / 8; ++dt) {
      if (dt * 8 >= c.D) break;
      *reinterpret_cast<uint32_t*>(dst + dt * 8 + 2 * t) =
          dev::pack_bf16x2(r.o[dt][2 * rr] * inv, r.o[dt][2 * rr + 1] * inv);
    }
  }
}

// Zeros for the rows [from, to) of the task's head (padding rows, or every row).
__device__ __forceinline__ void zero_rows(const Ctx& c, int from, int to) {
  const int width = c.G * c.D / 8;  // 16-byte chunks per row
  for (int e = threadIdx.x; e < (to - from) * width; e += NUM_THREADS) {
    const int i = from + e / width, k = e % width;
    *reinterpret_cast<uint4*>(c.out + i * c.q_row + 8 * k) = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace detail

// Out of line, unlike the decode kinds: a task runs for tens of microseconds or more, so the call
// costs nothing measurable, and its 16 x D output tile per warp gets a register allocation of
// its own (inlined into a prefill plan's dispatch switch, ptxas spilled the runtime's loop
// state; sixth session).
__device__ __noinline__ void run_task(const mpk::TaskArgs& a) {
  using detail::bf16;
  detail::Ctx c;
  c.G = a.i(P_GROUP);
  c.D = a.i(P_HEAD_DIM);
  c.KVH = a.i(P_KV_HEADS);
  c.PS = a.i(P_PAGE_SIZE);
  c.MAXP = a.i(P_MAX_PAGES);
  c.NP = a.i(P_NUM_PAGES);
  c.scale2 = a.f(P_SCALE) * detail::kLog2e;
  const int h = a.point(0), block = a.i(P_BLOCK), rows = a.i(P_CHUNK_ROWS);
  c.ra = a.point(1) * block;
  c.rb = rows - (a.point(1) + 1) * block;
  c.q_row = (long long)c.KVH * c.G * c.D;
  c.q = reinterpret_cast<const bf16*>(a.base[O_Q]) + (long long)h * c.G * c.D;
  c.kc = reinterpret_cast<const bf16*>(a.base[O_K_CACHE]) + (long long)h * c.D;
  c.vc = reinterpret_cast<const bf16*>(a.base[O_V_CACHE]) + (long long)h * c.D;
  c.out = reinterpret_cast<bf16*>(a.base[O_OUT]) + (long long)h * c.G * c.D;
  c.p0 = dev::ld_act_i32(reinterpret_cast<const int*>(a.base[O_POSITIONS]));
  const int chunk = dev::ld_act_i32(reinterpret_cast<const int*>(a.base[O_CHUNK]));
  // rope_append/task.py segment_rows: rows past the rope table (or p0 < 0) are padding
  const int n = c.p0 < 0 ? 0 : max(0, min(chunk, a.i(P_MAX_POS) - c.p0));
  const int hi_a = max(c.ra, min(c.ra + block, n));
  const int hi_b = block < rows ? max(c.rb, min(c.rb + block, n)) : c.rb;  // no piece b: none
  c.na = hi_a - c.ra;
  const uint32_t smem = dev::smem_addr(a.smem);
  const int rows_bytes = (detail::QROWS + 4 * detail::KB) * detail::ROW * 2;
  c.qs = smem;
  c.ks[0] = c.qs + detail::QROWS * detail::ROW * 2;
  c.vs[0] = c.ks[0] + detail::KB * detail::ROW * 2;
  c.ks[1] = c.vs[0] + detail::KB * detail::ROW * 2;
  c.vs[1] = c.ks[1] + detail::KB * detail::ROW * 2;
  c.kok[0] = reinterpret_cast<int*>(a.smem + rows_bytes);
  c.kok[1] = c.kok[0] + detail::KB;
  // After the flags: the context (256 bytes), then the page-table entries the task reads.
  detail::Ctx* shared = reinterpret_cast<detail::Ctx*>(a.smem + rows_bytes + 2 * detail::KB * 4);
  int* pages = reinterpret_cast<int*>(reinterpret_cast<char*>(shared) + 256);
  c.pages = pages;
  detail::zero_rows(c, hi_a, c.ra + block);
  if (block < rows) detail::zero_rows(c, hi_b, c.rb + block);
  const int vectors = (c.na + hi_b - c.rb) * c.G;
  const int top = hi_b > c.rb ? hi_b : hi_a;  // one past the task's last real row
  const int seen = vectors > 0 ? min((c.p0 + top + c.PS - 1) / c.PS, c.MAXP) : 0;
  const int* table = reinterpret_cast<const int*>(a.base[O_PAGE_TABLE]);
  for (int i = threadIdx.x; i < seen; i += NUM_THREADS) pages[i] = dev::ld_act_i32(table + i);
  // The context lives in shared memory: in registers it crowded out the 16 x D output tile.
  if (threadIdx.x == 0) *shared = c;
  mpk::task_sync();
  for (int mlo = 0; mlo < vectors; mlo += detail::QROWS)
    detail::pass(*shared, mlo, min(detail::QROWS, vectors - mlo));
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) { run_task(a); }

}  // namespace mpk::kinds::attention_prefill
