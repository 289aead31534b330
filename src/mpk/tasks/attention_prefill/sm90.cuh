// attention_prefill, sm_90a: causal GQA attention of a prefill chunk for one KV head and block
// of query rows, with q/k RMSNorm + RoPE and the KV append fused in (semantics in task.py).
//
// Layouts (whole tensors through a.base): qkv [C, KVH*(G+2)*D] (row i, head h, vector j at
// i*KVH*(G+2)*D + (h*(G+2) + j)*D), k_cache / v_cache [num_pages, page_size, KVH, D], out
// [C, KVH*G*D] (row i, head h, query g at i*KVH*G*D + (h*G + g)*D). Task (h, j) owns rows
// [r0, r0 + block), r0 = j * block; its real rows are [r0, hi), hi = min(r0 + block, n).
//
// The task's query vectors (row, query head) in row-major order are taken 128 at a time (a
// pass: 16 per warp, one m16 tile each). Per pass, keys go in blocks of 64 positions through
// shared memory, every thread taking a quarter of one key: cached positions (< p0) are copied
// from their pages with cp.async; chunk positions are prepared from qkv (RMSNorm + RoPE, the
// rounding of `attention`; a quarter holds element pairs (e, e + D/2), so RoPE needs no
// exchange and the norm sums over the quad), and the task's own rows also go to the cache
// (other tasks read this chunk's keys from qkv, never from the cache: their writes are not
// ordered with this task). A position whose page entry is outside the table or the pool is
// masked. Scores and P.V run on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate;
// P rounded to bf16 as flash attention does), online softmax in the exp2 domain per row.
// head_dim: a multiple of 16 up to DMAX = 128 (task.py CUDA_MAX_HEAD_DIM).
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
constexpr int DMAX = 128;          // task.py CUDA_MAX_HEAD_DIM
constexpr int QROWS = 16 * kWarps;  // query vectors per pass
constexpr int KB = 64;             // key positions per block
constexpr float kLog2e = 1.4426950408889634f;
static_assert(NUM_THREADS == 4 * KB, "a key block is prepared one quarter-vector per thread");

struct Ctx {  // sizeof under 256 bytes (task.py scratch_bytes)
  int G, D, KVH, PS, MAXP, NP, r0, hi, p0;
  bool norm;
  float eps, scale2;   // scale2 = scale * log2(e)
  long long qkv_row;   // qkv row stride, elements
  long long out_row;   // out row stride
  const bf16 *qkv;     // head h's first vector of row 0
  const bf16 *qn, *kn;
  const float* rope;
  const int* pt;
  bf16 *kc, *vc;       // head h of slot 0 of page 0 (slot stride KVH*D)
  bf16* out;           // head h's first query of row 0
  int row;             // staged row length, bf16 elements (D + 8: ldmatrix rows in distinct banks)
  uint32_t qs, ks, vs;  // shared addresses: queries [QROWS][row], keys, values [KB][row]
  int* kok;            // [KB] whether each key of the block is visible at all
};

// Up to 8 bf16 activations src[0 .. n) as floats (one 16-byte load when `vec`: n = 8, aligned).
__device__ __forceinline__ void load8(const bf16* src, int n, bool vec, float (&x)[8]) {
  if (vec) {
    dev::unpack8(dev::ld_act_v4(src), x);
    return;
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) x[u] = u < n ? dev::ld_act_bf16f(src + u) : 0.f;
}

// A quarter (q = 0..3 of a quad) of head vector `src` at position `pos`: RMSNorm (when
// `normw`), RoPE, bf16, into the shared row `dst` and, when `dst_global`, the cache. The quad's
// four lanes must call it together (the norm sums over the quad: `quad` is its lane mask). The
// quarter's pairs go 8 at a time, read twice (for the sum of squares, then to transform them):
// this runs while a warp's 16 x D output tile is live, and holding the whole quarter spilled.
__device__ __forceinline__ void prepare_quarter(const Ctx& c, const bf16* src, const bf16* normw,
                                                int pos, uint32_t dst, bf16* dst_global,
                                                unsigned quad, int q) {
  const int half = c.D / 2, np = half / 4, e0 = q * np;
  const bool vec = np % 8 == 0;  // D = 64, 128: 16-byte loads
  float inv = 1.f;
  if (normw != nullptr) {
    float ss = 0.f;
#pragma unroll 1
    for (int j = 0; j < np; j += 8) {
      float x1[8], x2[8];
      load8(src + e0 + j, np - j, vec, x1);
      load8(src + half + e0 + j, np - j, vec, x2);
#pragma unroll
      for (int u = 0; u < 8; ++u) ss = fmaf(x2[u], x2[u], fmaf(x1[u], x1[u], ss));
    }
    ss += __shfl_xor_sync(quad, ss, 1);
    ss += __shfl_xor_sync(quad, ss, 2);
    inv = dev::rms_inv(ss, c.D, c.eps);
  }
  const float* rrow = c.rope + (long long)pos * c.D;
#pragma unroll 1
  for (int j = 0; j < np; j += 8) {
    float x1[8], x2[8];
    load8(src + e0 + j, np - j, vec, x1);
    load8(src + half + e0 + j, np - j, vec, x2);
#pragma unroll
    for (int u = 0; u < 8; u += 2) {
      if (j + u >= np) break;  // np is even: pairs of elements stay whole
      uint32_t lo = 0, hi = 0;  // elements (e, e + 1) of each half, packed
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int e = e0 + j + u + v;
        float a = x1[u + v], b = x2[u + v];
        if (normw != nullptr) {
          a = dev::rmsnorm_elem(a, inv, dev::ld_weight_bf16f(normw + e));
          b = dev::rmsnorm_elem(b, inv, dev::ld_weight_bf16f(normw + half + e));
        }
        const float cs = dev::ld_act_f32(rrow + e), sn = dev::ld_act_f32(rrow + half + e);
        // a * cos - b * sin | b * cos + a * sin (attention's rounding)
        lo |= dev::f2bf_bits(__fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn))) << (16 * v);
        hi |= dev::f2bf_bits(__fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn))) << (16 * v);
      }
      const int e = e0 + j + u;
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(dst + e * 2), "r"(lo));
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(dst + (half + e) * 2), "r"(hi));
      if (dst_global != nullptr) {
        *reinterpret_cast<uint32_t*>(dst_global + e) = lo;
        *reinterpret_cast<uint32_t*>(dst_global + half + e) = hi;
      }
    }
  }
}

// Zeros over this quarter's 16-byte chunks (q, q + 4, ...) of a staged row.
__device__ __forceinline__ void zero_quarter(const Ctx& c, uint32_t row, int q) {
  for (int k = q; k < c.D / 8; k += 4)
    asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};" ::"r"(row + k * 16), "r"(0));
}

// Cache row (slot index times KVH*D, head h) of position p, or -1 when its page entry is
// outside the table or the pool.
__device__ __forceinline__ long long cache_row(const Ctx& c, int p) {
  const int index = p / c.PS;
  if (index >= c.MAXP) return -1;
  const int page = dev::ld_act_i32(c.pt + index);
  if (page < 0 || page >= c.NP) return -1;
  return ((long long)page * c.PS + p % c.PS) * c.KVH * c.D;
}

// Stage keys and values of positions [k0, k0 + KB) (those below `kend`) and their flags; the
// keys of rows [ilo, ihi] (the pass's, this task's own) also go to the cache.
__device__ __forceinline__ void load_block(const Ctx& c, int k0, int kend, int ilo, int ihi) {
  const int kl = threadIdx.x >> 2, q = threadIdx.x & 3, kp = k0 + kl;
  const unsigned quad = 0xfu << (threadIdx.x & 28);
  const uint32_t krow = c.ks + kl * c.row * 2, vrow = c.vs + kl * c.row * 2;
  const long long slot = kp < kend ? cache_row(c, kp) : -1;
  if (slot < 0) {
    zero_quarter(c, krow, q);
    zero_quarter(c, vrow, q);
  } else if (kp < c.p0) {  // cached: copied as stored
    for (int k = q; k < c.D / 8; k += 4) {
      dev::cp_async_act16_or_zero(krow + k * 16, c.kc + slot + 8 * k, true);
      dev::cp_async_act16_or_zero(vrow + k * 16, c.vc + slot + 8 * k, true);
    }
  } else {  // this chunk's row i: prepared here; the task's own rows also go to the cache
    const int i = kp - c.p0;
    const bool own = i >= ilo && i <= ihi;
    const bf16* src = c.qkv + i * c.qkv_row + (long long)c.G * c.D;
    prepare_quarter(c, src, c.norm ? c.kn : nullptr, kp, krow, own ? c.kc + slot : nullptr,
                    quad, q);
    for (int k = q; k < c.D / 8; k += 4) {
      const uint4 v = dev::ld_act_v4(src + c.D + 8 * k);
      asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(vrow + k * 16), "r"(v.x),
                   "r"(v.y), "r"(v.z), "r"(v.w));
      if (own) *reinterpret_cast<uint4*>(c.vc + slot + 8 * k) = v;
    }
  }
  if (q == 0) c.kok[kl] = slot >= 0;
  dev::cp_async_commit();
  dev::cp_async_wait_all();
  mpk::task_sync();
}

static_assert(sizeof(Ctx) <= 256, "task.py scratch_bytes reserves 256 bytes for the context");

struct Rows {  // one warp's 16 query vectors: running max / sum and output per row g, g + 8
  float m[2], l[2], o[DMAX / 8][4];
  int qpos[2];  // the row's position (-1: no row: sees nothing)
};

// Scores of the warp's rows against keys [k0 + kh, k0 + kh + KSUB) of the staged block (kh:
// KSUB-key half of it, so that the scores and the output fit the registers beside each other),
// masked, folded into the running state.
constexpr int KSUB = 32;
__device__ __forceinline__ void attend_keys(const Ctx& c, Rows& r, int k0, int kh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
  float s[KSUB / 8][4];
#pragma unroll
  for (int ni = 0; ni < KSUB / 8; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[ni][e] = 0.f;
  const uint32_t qa = c.qs + ((warp * 16 + (lane & 15)) * c.row + (lane >> 4) * 8) * 2;
  const uint32_t kb =
      c.ks + ((kh + (lane & 7) + ((lane >> 4) << 3)) * c.row + ((lane >> 3) & 1) * 8) * 2;
#pragma unroll
  for (int kk = 0; kk < DMAX / 16; ++kk) {
    if (kk * 16 >= c.D) break;
    uint32_t a0, a1, a2, a3;
    dev::ldmatrix_x4(qa + kk * 32, a0, a1, a2, a3);
#pragma unroll
    for (int nj = 0; nj < KSUB / 16; ++nj) {
      uint32_t b0, b1, b2, b3;
      dev::ldmatrix_x4(kb + (nj * 16 * c.row + kk * 16) * 2, b0, b1, b2, b3);
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
        const bool visible = c.kok[kl] != 0 && k0 + kl <= r.qpos[rr];
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
      c.vs + ((kh + (lane & 7) + ((lane >> 3) & 1) * 8) * c.row + (lane >> 4) * 8) * 2;
#pragma unroll
  for (int kk = 0; kk < KSUB / 16; ++kk) {
    const uint32_t a0 = dev::pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
    const uint32_t a1 = dev::pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
    const uint32_t a2 = dev::pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    const uint32_t a3 = dev::pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
    for (int dp = 0; dp < DMAX / 16; ++dp) {
      if (dp * 16 >= c.D) break;
      uint32_t b0, b1, b2, b3;
      dev::ldmatrix_x4_trans(vb + (kk * 16 * c.row + dp * 16) * 2, b0, b1, b2, b3);
      dev::mma_bf16_16816(r.o[2 * dp], a0, a1, a2, a3, b0, b1);
      dev::mma_bf16_16816(r.o[2 * dp + 1], a0, a1, a2, a3, b2, b3);
    }
  }
}

// One pass: query vectors [mlo, mlo + count) of the task (vector m: row r0 + m / G, head m % G).
__device__ __forceinline__ void pass(const Ctx& c, int mlo, int count) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int ilo = c.r0 + mlo / c.G, ihi = c.r0 + (mlo + count - 1) / c.G;
  mpk::task_sync();  // the previous pass is done with the staged queries
  for (int m = threadIdx.x >> 2; m < QROWS; m += NUM_THREADS / 4) {
    const uint32_t dst = c.qs + m * c.row * 2;
    if (m >= count) {
      zero_quarter(c, dst, threadIdx.x & 3);
      continue;
    }
    const int i = c.r0 + (mlo + m) / c.G, gq = (mlo + m) % c.G;
    prepare_quarter(c, c.qkv + i * c.qkv_row + (long long)gq * c.D, c.norm ? c.qn : nullptr,
                    c.p0 + i, dst, nullptr, 0xfu << (threadIdx.x & 28), threadIdx.x & 3);
  }
  Rows r;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int m = warp * 16 + g + 8 * rr;
    r.m[rr] = -INFINITY;
    r.l[rr] = 0.f;
    r.qpos[rr] = m < count ? c.p0 + c.r0 + (mlo + m) / c.G : -1;
  }
#pragma unroll
  for (int dt = 0; dt < DMAX / 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) r.o[dt][e] = 0.f;
  const bool active = warp * 16 < count;  // warp-uniform
  const int kend = c.p0 + ihi + 1;        // positions any row of the pass sees
  for (int k0 = 0; k0 < kend; k0 += KB) {
    mpk::task_sync();  // everyone is done with the previous block (and the queries are staged)
    load_block(c, k0, kend, ilo, ihi);
    if (active)
#pragma unroll 1
      for (int kh = 0; kh < KB; kh += KSUB) attend_keys(c, r, k0, kh);
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int m = warp * 16 + g + 8 * rr;
    if (m >= count) continue;
    const float inv = r.l[rr] > 0.f ? 1.f / r.l[rr] : 0.f;  // a row that saw nothing: zeros
    const int i = c.r0 + (mlo + m) / c.G, gq = (mlo + m) % c.G;
    bf16* dst = c.out + i * c.out_row + (long long)gq * c.D;
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
    *reinterpret_cast<uint4*>(c.out + i * c.out_row + 8 * k) = make_uint4(0, 0, 0, 0);
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
  c.norm = a.i(P_HAS_QK_NORM) != 0;
  c.eps = a.f(P_EPS);
  c.scale2 = a.f(P_SCALE) * detail::kLog2e;
  const int h = a.point(0), block = a.i(P_BLOCK);
  c.r0 = a.point(1) * block;
  c.qkv_row = (long long)c.KVH * (c.G + 2) * c.D;
  c.out_row = (long long)c.KVH * c.G * c.D;
  c.qkv = reinterpret_cast<const bf16*>(a.base[O_QKV]) + (long long)h * (c.G + 2) * c.D;
  c.qn = a.operand<const bf16>(O_Q_NORM);
  c.kn = a.operand<const bf16>(O_K_NORM);
  c.rope = reinterpret_cast<const float*>(a.base[O_ROPE]);
  c.pt = reinterpret_cast<const int*>(a.base[O_PAGE_TABLE]);
  c.kc = reinterpret_cast<bf16*>(a.base[O_K_CACHE]) + (long long)h * c.D;
  c.vc = reinterpret_cast<bf16*>(a.base[O_V_CACHE]) + (long long)h * c.D;
  c.out = reinterpret_cast<bf16*>(a.base[O_OUT]) + (long long)h * c.G * c.D;
  c.p0 = dev::ld_act_i32(reinterpret_cast<const int*>(a.base[O_POSITIONS]));
  const int chunk = dev::ld_act_i32(reinterpret_cast<const int*>(a.base[O_CHUNK]));
  const int n = c.p0 < 0 ? 0 : min(chunk, a.i(P_MAX_POS) - c.p0);  // rows past rope: padding
  c.hi = max(c.r0, min(c.r0 + block, n));
  c.row = c.D + 8;
  const uint32_t smem = dev::smem_addr(a.smem);
  c.qs = smem;
  c.ks = c.qs + detail::QROWS * c.row * 2;
  c.vs = c.ks + detail::KB * c.row * 2;
  c.kok = reinterpret_cast<int*>(a.smem + (detail::QROWS + 2 * detail::KB) * c.row * 2);
  detail::zero_rows(c, c.hi, c.r0 + block);
  // The context lives in shared memory (after the staged rows): in registers it crowded out
  // the 16 x D output tile (spills).
  detail::Ctx* shared = reinterpret_cast<detail::Ctx*>(
      a.smem + (detail::QROWS + 2 * detail::KB) * c.row * 2 + detail::KB * 4);
  if (threadIdx.x == 0) *shared = c;
  mpk::task_sync();
  const int vectors = (c.hi - c.r0) * c.G;
  for (int mlo = 0; mlo < vectors; mlo += detail::QROWS)
    detail::pass(*shared, mlo, min(detail::QROWS, vectors - mlo));
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) { run_task(a); }

}  // namespace mpk::kinds::attention_prefill
