// attention, sm_90a: decode attention of one KV-head tile, batch row(s) and KV split.
//
// Layouts (default splits; grid = (KV-head tiles, B, S)):
//   q / out tile pointer = q[b0, h0, 0]: element (bb, hh, g, d) at + (bb*KVH + hh)*G*D + g*D + d
//   k_cache / v_cache tile = cache[0, 0, h0, 0]: (page, slot, hh, d) at
//                            + ((page*page_size + slot)*KVH + hh)*D + d
//   page_table tile = page_table[b0, 0] (row stride max_pages), positions tile = positions + b0
//   part_o tile = part_o[b0, h0, s, 0]: (bb, hh, g, d) at + (bb*KVH + hh)*S*G*D + g*D + d
//   part_lse tile = part_lse[b0, h0, s, 0]: (bb, hh, g) at + (bb*KVH + hh)*S*G + g
//   split s = grid point axis 2. KV heads per task = heads_per_task; batch rows per task =
//   batch_per_task when task.py declares it, else 1 (grid axis 1 = B).
// Semantics: row b attends to positions [lo, hi) of L = positions[b] + step + 1, chunk =
// ceil(L / S), lo = s*chunk, hi = min(L, lo + chunk); one split writes bf16 out, several write
// normalised fp32 partials + natural-log lse (-inf and zeros when the range is empty).
// Defensive: positions whose page index is past max_pages, or whose page id is negative or
// >= num_pages, are masked out.
// head_dim 64 or 128 (other values are not supported and write nothing); any group size
// (processed 8 query heads at a time).
//
// Design: tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate) for both products.
//   S^T[16 pos][8 heads] = K[16 pos][D] . q^T: a lane's 16-byte K loads (positions r, r+8; 8
//     consecutive d) are its A fragments as is (d order is free in a dot product), q^T comes
//     from smem once per task.
//   Online softmax per warp in the exp2 domain on the C fragment (a lane holds heads 2t, 2t+1 for
//     positions r and r+8; row max over the block by 3 xor-shuffles).
//   O^T[D][8 heads] += V^T[D][16 pos] . P^T: lane loads V rows of positions 2t, 2t+1, 2t+8, 2t+9
//     (8 consecutive d each) and builds A fragments with byte permutes; P goes through a 512-byte
//     per-warp smem transpose, split into bf16 hi + lo parts (two MMAs) so that P keeps ~16 bits
//     of precision (the reference multiplies fp32 probabilities).
//   Warps take 16-position blocks round-robin; their (m, l, O) states merge in smem in warp order.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"

namespace mpk::kinds::attention {

namespace detail {
using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegBig = -1e30f;  // finite "minus infinity" for running maxima (no inf - inf)

struct Ctx {
  int B, G, D, KVH, PS, MAXP, S, HT, BT, NP;
  float scale2;  // scale * log2(e)
  const bf16 *q, *kc, *vc;
  const int *pt, *pos;
  bf16* out;
  float *po, *plse;
};

// Shared memory layout (per (row, head, head-group) pass):
//   wo  [kWarps][8][D] f32 | wm [kWarps][8] f32 | wl [kWarps][8] f32 | ps [kWarps][2][8][16] bf16
//   qs  [8][D] bf16 | pages [..] i32
template <int D>
struct Smem {
  static constexpr int kWo = 0;
  static constexpr int kWm = kWo + kWarps * 8 * D * 4;
  static constexpr int kWl = kWm + kWarps * 8 * 4;
  static constexpr int kPs = kWl + kWarps * 8 * 4;
  static constexpr int kQs = kPs + kWarps * 2 * 8 * 16 * 2;
  static constexpr int kPages = kQs + 8 * D * 2;
  static constexpr int kMaxPages = (SMEM_BYTES - kPages) / 4;
};

template <int D>
__device__ __forceinline__ void one_pass(const Ctx& c, char* smem, int step, int bb, int hh,
                                         int g0, int s) {
  using SL = Smem<D>;
  constexpr int KJ = D / 32;  // 32-d chunks of a K row per lane (two MMAs each)
  constexpr int VC = D / 64;  // 64-d groups of a V row per lane
  constexpr int MT = D / 16;  // m-tiles of O^T
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = lane >> 2, t = lane & 3;
  float* wo = reinterpret_cast<float*>(smem + SL::kWo);
  float* wm = reinterpret_cast<float*>(smem + SL::kWm);
  float* wl = reinterpret_cast<float*>(smem + SL::kWl);
  bf16* ps = reinterpret_cast<bf16*>(smem + SL::kPs) + warp * 2 * 8 * 16;
  bf16* qs = reinterpret_cast<bf16*>(smem + SL::kQs);
  int* pages = reinterpret_cast<int*>(smem + SL::kPages);
  const int ng = min(8, c.G - g0);

  // ---- this split's position range (same arithmetic as the reference) ----
  const int length = dev::ld_act_i32(c.pos + bb) + step + 1;
  int lo = 0, hi = 0;
  if (length > 0) {
    const int chunk = (length + c.S - 1) / c.S;
    lo = s * chunk;
    hi = min(length, lo + chunk);
    hi = min(hi, c.MAXP * c.PS);  // positions past the page table cannot be read
  }
  const int n = max(0, hi - lo);
  const int p_first = n > 0 ? lo / c.PS : 0;
  const int n_pages = n > 0 ? (hi - 1) / c.PS - p_first + 1 : 0;
  const int staged = min(n_pages, SL::kMaxPages);

  // ---- stage q (8 heads x D, bf16; heads >= ng zero) and the page-table slice ----
  const bf16* qrow = c.q + ((long long)bb * c.KVH + hh) * c.G * D + (long long)g0 * D;
  for (int idx = tid; idx < 8 * D / 8; idx += NUM_THREADS) {
    const int g = idx / (D / 8), v = idx - g * (D / 8);
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (g < ng) val = dev::ld_act_v4(qrow + g * D + v * 8);
    *reinterpret_cast<uint4*>(qs + g * D + v * 8) = val;
  }
  const int* ptrow = c.pt + (long long)bb * c.MAXP;
  for (int i = tid; i < staged; i += NUM_THREADS) pages[i] = dev::ld_act_i32(ptrow + p_first + i);
  __syncthreads();

  // q^T fragments (B operand of the score MMA): rows g = r, d = t*8 + 32j .. +8.
  uint4 qf[KJ];
#pragma unroll
  for (int j = 0; j < KJ; ++j) qf[j] = dev::lds_v4(dev::smem_addr(qs + r * D + t * 8 + 32 * j));

  // Address of the head row of position p (or nullptr when masked).
  auto row_of = [&](const bf16* cache, int p) -> const bf16* {
    if (p >= hi) return nullptr;
    const int pi = p / c.PS;
    const int page = pi - p_first < staged ? pages[pi - p_first] : dev::ld_act_i32(ptrow + pi);
    if (page < 0 || (c.NP >= 0 && page >= c.NP)) return nullptr;
    return cache + (((long long)page * c.PS + (p - pi * c.PS)) * c.KVH + hh) * D;
  };

  float m0 = kNegBig, m1 = kNegBig, l0 = 0.f, l1 = 0.f;  // heads 2t, 2t+1
  float o[MT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  const int nblk = (n + 15) / 16;
  for (int bk = warp; bk < nblk; bk += kWarps) {
    const int pb = lo + bk * 16;
    // ---- loads: K rows r, r+8; V rows 2t, 2t+1, 2t+8, 2t+9 ----
    const bf16* ka = row_of(c.kc, pb + r);
    const bf16* kb = row_of(c.kc, pb + r + 8);
    uint4 kA[KJ], kB[KJ], vv[4][VC];
#pragma unroll
    for (int j = 0; j < KJ; ++j) {
      kA[j] = ka ? dev::ld_act_v4(ka + t * 8 + 32 * j) : make_uint4(0u, 0u, 0u, 0u);
      kB[j] = kb ? dev::ld_act_v4(kb + t * 8 + 32 * j) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int qd = 0; qd < 4; ++qd) {
      const bf16* vr = row_of(c.vc, pb + 2 * t + (qd & 1) + 8 * (qd >> 1));
#pragma unroll
      for (int cc = 0; cc < VC; ++cc)
        vv[qd][cc] = vr ? dev::ld_act_v4(vr + 64 * cc + 8 * r) : make_uint4(0u, 0u, 0u, 0u);
    }
    // ---- scores ----
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < KJ; ++j) {
      dev::mma_bf16_16816(sc, kA[j].x, kB[j].x, kA[j].y, kB[j].y, qf[j].x, qf[j].y);
      dev::mma_bf16_16816(sc, kA[j].z, kB[j].z, kA[j].w, kB[j].w, qf[j].z, qf[j].w);
    }
    const float ninf = -__int_as_float(0x7f800000);
    const float s0 = ka ? sc[0] * c.scale2 : ninf;  // pos r,   head 2t
    const float s1 = ka ? sc[1] * c.scale2 : ninf;  // pos r,   head 2t+1
    const float s2 = kb ? sc[2] * c.scale2 : ninf;  // pos r+8, head 2t
    const float s3 = kb ? sc[3] * c.scale2 : ninf;  // pos r+8, head 2t+1
    float mx0 = fmaxf(s0, s2), mx1 = fmaxf(s1, s3);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float corr0 = exp2f(m0 - n0), corr1 = exp2f(m1 - n1);
    m0 = n0;
    m1 = n1;
    const float p0 = exp2f(s0 - n0), p1 = exp2f(s1 - n1);
    const float p2 = exp2f(s2 - n0), p3 = exp2f(s3 - n1);
    l0 = l0 * corr0 + (p0 + p2);
    l1 = l1 * corr1 + (p1 + p3);
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      o[i][0] *= corr0;
      o[i][1] *= corr1;
      o[i][2] *= corr0;
      o[i][3] *= corr1;
    }
    // ---- P^T through smem: ps[hi/lo][head][pos] ----
    {
      const float pv[4] = {p0, p1, p2, p3};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int g = 2 * t + (e & 1), p = r + 8 * (e >> 1);
        const bf16 h = __float2bfloat16_rn(pv[e]);
        ps[g * 16 + p] = h;
        ps[128 + g * 16 + p] = __float2bfloat16_rn(pv[e] - __bfloat162float(h));
      }
    }
    __syncwarp();
    const unsigned pbase = dev::smem_addr(ps + r * 16 + 2 * t);
    const uint32_t bh0 = dev::lds_u32(pbase), bh1 = dev::lds_u32(pbase + 16);
    const uint32_t bl0 = dev::lds_u32(pbase + 256), bl1 = dev::lds_u32(pbase + 256 + 16);
    __syncwarp();
    // ---- O^T += V^T P^T ----
#pragma unroll
    for (int cc = 0; cc < VC; ++cc) {
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const uint32_t w0 = (&vv[0][cc].x)[mm], w1 = (&vv[1][cc].x)[mm];
        const uint32_t w2 = (&vv[2][cc].x)[mm], w3 = (&vv[3][cc].x)[mm];
        const uint32_t a0 = __byte_perm(w0, w1, 0x5410), a1 = __byte_perm(w0, w1, 0x7632);
        const uint32_t a2 = __byte_perm(w2, w3, 0x5410), a3 = __byte_perm(w2, w3, 0x7632);
        dev::mma_bf16_16816(o[cc * 4 + mm], a0, a1, a2, a3, bh0, bh1);
        dev::mma_bf16_16816(o[cc * 4 + mm], a0, a1, a2, a3, bl0, bl1);
      }
    }
  }

  // ---- warp state -> smem ----
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  if (r == 0) {
    wm[warp * 8 + 2 * t] = m0;
    wm[warp * 8 + 2 * t + 1] = m1;
    wl[warp * 8 + 2 * t] = l0;
    wl[warp * 8 + 2 * t + 1] = l1;
  }
  float* wow = wo + warp * 8 * D;
#pragma unroll
  for (int cc = 0; cc < VC; ++cc) {
#pragma unroll
    for (int mm = 0; mm < 4; ++mm) {
      const int d = 64 * cc + 8 * r + 2 * mm;
      const float* v = o[cc * 4 + mm];
      *reinterpret_cast<float2*>(wow + (2 * t) * D + d) = make_float2(v[0], v[2]);
      *reinterpret_cast<float2*>(wow + (2 * t + 1) * D + d) = make_float2(v[1], v[3]);
    }
  }
  __syncthreads();

  // ---- merge the warps (fixed order) and write ----
  for (int idx = tid; idx < ng * D; idx += NUM_THREADS) {
    const int g = idx / D, d = idx - g * D;
    float mstar = kNegBig;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mstar = fmaxf(mstar, wm[w * 8 + g]);
    float lsum = 0.f, osum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(wm[w * 8 + g] - mstar);
      lsum += wl[w * 8 + g] * f;
      osum += wo[(w * 8 + g) * D + d] * f;
    }
    const bool empty = !(lsum > 0.f);
    const float val = empty ? 0.f : osum / lsum;
    if (c.S == 1) {
      c.out[((long long)bb * c.KVH + hh) * c.G * D + (long long)(g0 + g) * D + d] = dev::to_bf16(val);
    } else {
      c.po[((long long)bb * c.KVH + hh) * c.S * c.G * D + (long long)(g0 + g) * D + d] = val;
      if (d == 0)
        c.plse[((long long)bb * c.KVH + hh) * c.S * c.G + g0 + g] =
            empty ? -__int_as_float(0x7f800000) : (mstar + __log2f(lsum)) * kLn2;
    }
  }
  __syncthreads();  // smem is reused by the next pass
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  Ctx c;
  c.B = a.i(P_BATCH);
  c.G = a.i(P_GROUP);
  c.D = a.i(P_HEAD_DIM);
  c.KVH = a.i(P_KV_HEADS);
  c.PS = a.i(P_PAGE_SIZE);
  c.MAXP = a.i(P_MAX_PAGES);
  c.S = a.i(P_NUM_SPLITS);
  c.HT = a.i(P_HEADS_PER_TASK);
  c.BT = a.i(P_BATCH_PER_TASK);
  c.NP = a.i(P_NUM_PAGES);
  c.scale2 = a.f(P_SCALE) * kLog2e;
  c.q = a.operand<const bf16>(O_Q);
  c.kc = a.operand<const bf16>(O_K_CACHE);
  c.vc = a.operand<const bf16>(O_V_CACHE);
  c.pt = a.operand<const int>(O_PAGE_TABLE);
  c.pos = a.operand<const int>(O_POSITIONS);
  c.out = a.operand<bf16>(O_OUT);
  c.po = a.operand<float>(O_PART_O);
  c.plse = a.operand<float>(O_PART_LSE);
  const int s = a.point(2);
  if (c.PS <= 0 || c.S <= 0) return;  // uniform
  if (c.S == 1 ? c.out == nullptr : (c.po == nullptr || c.plse == nullptr)) return;
  for (int bb = 0; bb < c.BT; ++bb)
    for (int hh = 0; hh < c.HT; ++hh)
      for (int g0 = 0; g0 < c.G; g0 += 8) {
        if (c.D == 128) one_pass<128>(c, a.smem, a.step, bb, hh, g0, s);
        else if (c.D == 64) one_pass<64>(c, a.smem, a.step, bb, hh, g0, s);
      }
}

}  // namespace mpk::kinds::attention
