// attention, sm_90a: q/k RMSNorm + RoPE + KV append + decode attention of one KV-head tile,
// batch row(s) and KV split (semantics in task.py).
//
// Layouts (grid = (KV heads x P, B, S): P query-head parts, each GP = G/P heads, q0 = its first;
// P > 1 only with S = 1), W = (G+2)*D elements per head:
//   qkv tile = qkv[0, h0*W] (every row: a run reads its earlier rows; every part its KV head's
//              whole block): row b, head hh, vector j at + (b*KVH + hh)*W + j*D
//   k_cache / v_cache tile = cache[0, 0, h0, 0]: (page, slot, hh, d) at
//                            + ((page*page_size + slot)*KVH + hh)*D + d
//   page_table tile = page_table[b0, 0] (row stride max_pages), positions tile = positions + b0,
//   runs tile = runs[b0, 0] (or null)
//   out tile = out[b0, (h0*G + q0)*D]: (bb, hh, g, d) at + (bb*KVH + hh)*G*D + g*D + d
//   part_o tile = part_o[b0, h0, 0, 0]: (bb, hh, s, g, d) at + ((bb*KVH + hh)*S + s)*G*D + g*D + d
//   part_lse tile = part_lse[b0, h0, 0, 0]: (bb, hh, s, g) at + ((bb*KVH + hh)*S + s)*G + g
//
// Prologue (before the waits: task.py prologue_operands): the row's position and split range,
// the page-table slice, the RoPE table rows of this step's positions and the norm weights go to
// shared memory (Setup), so that after the waits the qkv read is the only global round trip
// before the attention.
// Phase 1 (prepare): one warp per head vector (the row's G queries, then the key and value of
// each of this step's positions in the split's range: the row's own and, in a run, its earlier
// rows'); lane holds d = lane + 32i. RMSNorm with a warp sum, RoPE with the partner element
// through a per-warp buffer, rounding as the reference. Everything goes to shared memory (bf16);
// the split covering position p also writes the row's key and value to the cache: phase 2 reads
// this step's positions from shared memory, never back from global (a global write and an L2
// read by other threads of this CTA are not ordered by the barrier between them, and the other
// run rows' writes are not ordered with this task at all).
// Phase 2 (attend), tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate):
//   S^T[16 pos][8 heads] = K[16 pos][D] . q^T: a lane's K loads (positions r, r+8; d 8t..8t+7
//     of each 32-d chunk, d 4t..4t+3 of a 16-d tail) are its A fragments as is (d order is free
//     in a dot product); q^T comes from shared memory once per pass.
//   Online softmax per warp in the exp2 domain on the C fragment.
//   O^T[D][8 heads] += V^T[D][16 pos] . P^T: the block's V rows are copied into the warp's part
//     of wo (cp.async, issued right after the K loads, so they land during the scores); lane
//     reads rows of positions 2t, 2t+1, 2t+8, 2t+9 there (d 4r..4r+3 of each 32-d group,
//     2r..2r+1 of a 16-d tail) and builds A fragments with byte permutes; P goes through a 512-byte per-warp transpose, split into bf16 hi + lo parts (two
//     MMAs) so that P keeps ~16 bits (the reference multiplies fp32 probabilities).
//   Warps take 16-position blocks round-robin; their (m, l, O) states merge in smem in warp order.
// Several splits: a row uses SE of the S (effective_splits, by its context). SE = 1: split 0 writes
// out as with one split, no split arrives. SE > 1: each of the SE writes its partials, then all S
// arrive on the (row, KV head)'s counter; the last to arrive merges the SE partials into out
// (merge_splits).
// head_dim: any multiple of 16 up to 256 (task.py checks); DMAX = 128 or 256 sizes the registers.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/flags.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/rope.cuh"
#include "../common/runs.cuh"

namespace mpk::kinds::attention {

namespace detail {
using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegBig = -1e30f;  // finite "minus infinity" for running maxima (no inf - inf)
constexpr int kLanes = ATTN_MAX_HEAD_DIM / 32;  // head-vector elements per lane in prepare()

struct Ctx {
  int B, G, D, KVH, PS, MAXP, S, NP, MAXPOS;
  int SP;  // split_positions (task.py effective_splits; 0: every split always)
  int SE;  // splits the task's row uses this step (run() sets it from the prologue's Setup)
  int GP, q0;  // this task's query heads: GP of the group's G, from q0 (task.py: parts)
  int row;  // this task's batch row (the qkv tile holds every row)
  bool norm;
  float eps, scale2;  // scale2 = scale * log2(e)
  const bf16 *qkv, *qn, *kn;
  const float* rope;
  const int *pt, *pos, *runs;
  bf16 *kc, *vc, *out;
  float *po, *plse;
  uint32_t qkv_ep, out_ep;  // epochs of a flagged qkv / out (common/flags.cuh; 0: plain)
};

// Shared memory (one (row, head) at a time):
//   wo [kWarps][8][D] f32 | kst [kWarps][16][D] bf16 (a block's keys; kStageKeys) |
//   wm, wl [kWarps][8] f32 | ps [kWarps][2][8][16] bf16 |
//   qs [G][D] bf16 (prepared queries) | knew, vnew [B][D] bf16 (this step's keys and values, by
//   position from the split's first one: at most B, a run's width) |
//   buf [kWarps][D] f32 (RoPE partners) | pre (the prologue's Setup) | rope [B][D] f32 (the
//   table rows of this step's positions f0 .. p) | qn, kn [D] f32 (norm weights) | pages [..] i32
// Keys staged in shared memory (kst) up to head_dim 128; larger heads read them from L2 (at 256
// the staging, 64 KB, would leave a 16-row run too few weight pages).
constexpr bool kStageKeys = ATTN_MAX_HEAD_DIM <= 128;

struct Layout {
  int wo, kst, wm, wl, ps, qs, knew, vnew, buf, pre, rope, norm, pages, max_pages;
  __device__ Layout(const Ctx& c) {
    wo = 0;
    kst = wo + kWarps * 8 * c.D * 4;
    wm = kst + (kStageKeys ? kWarps * 16 * c.D * 2 : 0);
    wl = wm + kWarps * 8 * 4;
    ps = wl + kWarps * 8 * 4;
    qs = ps + kWarps * 2 * 8 * 16 * 2;
    knew = qs + ((c.G * c.D * 2 + 15) / 16) * 16;
    vnew = knew + c.B * c.D * 2;
    buf = vnew + c.B * c.D * 2;
    pre = buf + kWarps * c.D * 4;
    rope = pre + 64;
    norm = rope + c.B * c.D * 4;
    pages = norm + 2 * c.D * 4;
    max_pages = (SMEM_BYTES - pages) / 4;
  }
};

// A flagged qkv: this KV head's columns of every row polled into wo (free until attend) as bf16
// rows of W = (G+2)*D, one 16-byte vector (four words) a thread, so that prepare reads shared
// memory where it reads global memory otherwise (task.py keeps B*(G+2) <= 16*kWarps: it fits).
// Polling inside prepare's loads (or per warp before them) kept more registers live there and
// spilled.
__device__ __forceinline__ void stage_flagged_qkv(const mpk::TaskArgs& a, const Ctx& c,
                                                  const Layout& L) {
  const int W = c.G + 2, vecs = W * c.D / 8;  // per row
  const dev::flag_word* words = dev::flag_operand<const dev::flag_word>(a, O_QKV);
  uint4* dst = reinterpret_cast<uint4*>(a.smem + L.wo);
  const dev::Poll poll;
  for (int idx = threadIdx.x; idx < c.B * vecs; idx += NUM_THREADS) {
    const int r = idx / vecs, v = idx - r * vecs;
    dst[idx] = dev::poll8(words + (long long)r * c.KVH * W * c.D / 2 + v * 4, c.qkv_ep, poll);
  }
}

// ---- phase 1: prepare q of the task's row and k, v of this step's positions [flo, fhi) ------
// The key and value of position f come from row c.row - (p - f) (the run's earlier rows hold
// the positions before p). Returns through smem; the row's own key and value also go to the
// cache row `crow` (-1: not this split's, or no page).
__device__ __forceinline__ void prepare(const Ctx& c, const Layout& L, char* smem, int hh, int p,
                                        int flo, int fhi, long long crow, int f0) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = c.G + 2, half = c.D / 2;
  bf16* qs = reinterpret_cast<bf16*>(smem + L.qs);
  bf16* knew = reinterpret_cast<bf16*>(smem + L.knew);
  bf16* vnew = reinterpret_cast<bf16*>(smem + L.vnew);
  float* buf = reinterpret_cast<float*>(smem + L.buf) + warp * c.D;
  const int vectors = c.GP + 2 * max(0, fhi - flo);
  for (int j = warp; j < vectors; j += kWarps) {
    const bool query = j < c.GP;
    const int f = query ? p : flo + (j - c.GP) / 2;  // the vector's position
    // q head q0 + j, key (G) or value (G + 1)
    const int which = query ? c.q0 + j : c.G + ((j - c.GP) & 1);
    const bool staged = c.qkv_ep != 0;  // a flagged qkv was polled into wo
    const bf16* src =
        staged ? reinterpret_cast<const bf16*>(smem + L.wo) +
                     ((long long)(c.row - (p - f)) * W + which) * c.D
               : c.qkv + ((long long)(c.row - (p - f)) * c.KVH + hh) * W * c.D +
                     (long long)which * c.D;
    const bool own = f == p && crow >= 0;
    // Each vector's elements are loaded before any is used. (A use right after each load, a
    // bf16 -> f32 shift or a store that may alias the next load, made kLanes L2 round trips in a
    // row per vector: perf-log, thirteenth session.)
    if (which == c.G + 1) {  // value: as is, 4 elements (8 bytes) a lane: one load at D <= 128
      bf16* dst = vnew + (f - flo) * c.D;
      for (int e = 4 * lane; e < c.D; e += 128) {  // D % 16 == 0 (supported): 8-byte aligned
        const uint2 v = staged ? *reinterpret_cast<const uint2*>(src + e) : dev::ld_act_v2(src + e);
        *reinterpret_cast<uint2*>(dst + e) = v;
        if (own) *reinterpret_cast<uint2*>(c.vc + (crow + hh) * c.D + e) = v;
      }
      continue;
    }
    // The prologue staged the table rows and the norm weights: qkv is the only global read.
    const float* rrow = reinterpret_cast<const float*>(smem + L.rope) + (f - f0) * c.D;
    const float* nw = reinterpret_cast<const float*>(smem + L.norm) + (query ? 0 : c.D);
    float v[kLanes], cs[kLanes], sn[kLanes], w[kLanes];
#pragma unroll
    for (int i = 0; i < kLanes; ++i) {
      const int e = lane + 32 * i;
      v[i] = cs[i] = sn[i] = 0.f;
      w[i] = 1.f;
      if (e < c.D) {
        const uint32_t bits = staged ? __bfloat16_as_ushort(src[e]) : dev::ld_act_u16(src + e);
        v[i] = __uint_as_float(bits);  // raw bits: shifted below
        const int r = e < half ? e : e - half;
        cs[i] = rrow[r];
        sn[i] = rrow[half + r];
        if (c.norm) w[i] = nw[e];
      }
    }
#pragma unroll
    for (int i = 0; i < kLanes; ++i) v[i] = dev::bf16lo(__float_as_uint(v[i]));
    bf16* dst = query ? qs + j * c.D : knew + (f - flo) * c.D;
    dev::norm_rope(v, cs, sn, w, c.norm, c.D, c.eps, buf, [&](int e, bf16 ob) {
      dst[e] = ob;
      if (!query && own) c.kc[(crow + hh) * c.D + e] = ob;
    });
  }
}

// ---- phase 2: attention of 8 query heads over this split's positions -------------------------
struct Range {
  int lo, hi;  // the split's positions
  int flo;     // positions [flo, hi) are this step's: read from shared memory (when their page
               // entry is valid; masked otherwise, as every position); flo >= lo
  int p_first, staged;
};

template <int DMAX>
__device__ __forceinline__ void attend(const mpk::TaskArgs& a, const Ctx& c, const Layout& L,
                                       char* smem, int bb, int hh, int g0, int s, const Range& R) {
  constexpr int KJ_MAX = DMAX / 32;  // 32-d chunks
  constexpr int MT_MAX = DMAX / 16;  // m-tiles of O^T
  const int D = c.D, KJ = D / 32;
  const bool tail = (D & 31) != 0;  // a 16-d tail after the 32-d chunks
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = lane >> 2, t = lane & 3;
  float* wo = reinterpret_cast<float*>(smem + L.wo);
  float* wm = reinterpret_cast<float*>(smem + L.wm);
  float* wl = reinterpret_cast<float*>(smem + L.wl);
  bf16* ps = reinterpret_cast<bf16*>(smem + L.ps) + warp * 2 * 8 * 16;
  const bf16* qs = reinterpret_cast<const bf16*>(smem + L.qs);
  const bf16* knew = reinterpret_cast<const bf16*>(smem + L.knew);
  const bf16* vnew = reinterpret_cast<const bf16*>(smem + L.vnew);
  const int* pages = reinterpret_cast<const int*>(smem + L.pages);
  const int ng = min(8, c.GP - g0);
  const int* ptrow = c.pt + (long long)bb * c.MAXP;

  // q^T fragments (B operand of the score MMA): head r, d = 32j + 8t .. +8, read from shared
  // memory at each use (registers go to the K and V loads in flight). Heads past ng read head 0
  // (their scores are discarded).
  const bf16* qrow = qs + (g0 + (r < ng ? r : 0)) * D;

  // Row of position q (global, or this step's shared copy), or nullptr when masked (outside
  // the split, or its page entry outside the pool).
  auto row_of = [&](const bf16* cache, const bf16* fresh, int q) -> const bf16* {
    if (q >= R.hi || q < R.lo) return nullptr;
    const int pi = q / c.PS;
    const int page = pi - R.p_first < R.staged ? pages[pi - R.p_first] : dev::ld_act_i32(ptrow + pi);
    if (page < 0 || page >= c.NP) return nullptr;
    if (q >= R.flo) return fresh + (q - R.flo) * D;
    return cache + (((long long)page * c.PS + (q - pi * c.PS)) * c.KVH + hh) * D;
  };
  // knew and vnew are one block of shared memory: a row inside it is this step's (compared as
  // integers: the cache rows are global memory, far outside the block).
  const uintptr_t fresh_base = reinterpret_cast<uintptr_t>(knew);
  const uintptr_t fresh_bytes = 2u * c.B * D * 2u;
  auto in_smem = [&](const bf16* row) -> bool {
    return reinterpret_cast<uintptr_t>(row) - fresh_base < fresh_bytes;
  };

  // The keys of a block [pb, pb + 16) go to this warp's part of kst (kStageKeys), its values to
  // its part of wo (free until the merge: 8 x D f32 is 16 x D bf16), two lanes per position:
  // cached rows by cp.async, this step's rows copied from shared memory, masked rows as zeros.
  // Both are issued together, so a block waits for one L2 round trip (keys loaded from L2 into
  // registers and used by the score MMAs one 32-d chunk at a time were KJ round trips in a row:
  // perf-log, sixteenth session).
  bf16* kst = reinterpret_cast<bf16*>(smem + L.kst) + warp * 16 * D;
  bf16* vst = reinterpret_cast<bf16*>(wo + warp * 8 * D);
  // 16 (8) bytes of a key row at element e: staged (kStageKeys), or this step's row in shared
  // memory, a cached one in L2, zeros when masked (nullptr).
  auto key16 = [&](const bf16* row, int e) -> uint4 {
    if (kStageKeys || in_smem(row)) return *reinterpret_cast<const uint4*>(row + e);
    if (row == nullptr) return make_uint4(0u, 0u, 0u, 0u);
    return dev::ld_act_v4(row + e);
  };
  auto key8 = [&](const bf16* row, int e) -> uint2 {
    if (kStageKeys || in_smem(row)) return *reinterpret_cast<const uint2*>(row + e);
    if (row == nullptr) return make_uint2(0u, 0u);
    return dev::ld_act_v2(row + e);
  };
  // Returns whether position pb + lane / 2 is attended (not masked).
  auto stage_rows = [&](const bf16* cache, const bf16* fresh, bf16* dst_rows, int pb) -> bool {
    const int q = lane >> 1, half = D / 2;
    const bf16* row = row_of(cache, fresh, pb + q);
    bf16* dst = dst_rows + q * D + (lane & 1) * half;
    const int e0 = (lane & 1) * half;
    for (int e = 0; e < half; e += 8) {
      if (row == nullptr)
        *reinterpret_cast<uint4*>(dst + e) = make_uint4(0u, 0u, 0u, 0u);
      else if (in_smem(row))
        *reinterpret_cast<uint4*>(dst + e) = *reinterpret_cast<const uint4*>(row + e0 + e);
      else
        dev::cp_async_act16(dst + e, row + e0 + e);
    }
    return row != nullptr;
  };

  float m0 = kNegBig, m1 = kNegBig, l0 = 0.f, l1 = 0.f;  // heads 2t, 2t+1
  float o[MT_MAX][4], ot[4] = {0.f, 0.f, 0.f, 0.f};  // 32-d groups' m-tiles, the 16-d tail's
#pragma unroll
  for (int i = 0; i < MT_MAX; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  const int n = R.hi - R.lo;
  const int nblk = (n + 15) / 16;
  for (int bk = warp; bk < nblk; bk += kWarps) {
    const int pb = R.lo + bk * 16;
    // ---- the block's keys and values, then the scores: K rows r, r+8 ----
    const bf16 *kra, *krb;  // the rows (staged, or where they are)
    bool ka, kb;            // attended (else masked)
    if constexpr (kStageKeys) {
      // Bit 2q: position pb + q is attended (lanes 2q and 2q + 1 staged it).
      const unsigned attended = __ballot_sync(0xffffffffu, stage_rows(c.kc, knew, kst, pb));
      stage_rows(c.vc, vnew, vst, pb);
      dev::cp_async_commit();
      ka = (attended >> (2 * r)) & 1u;
      kb = (attended >> (2 * r + 16)) & 1u;
      kra = kst + r * D;
      krb = kst + (r + 8) * D;
      dev::cp_async_wait_all();
      __syncwarp();  // every lane's copies of the block's keys and values have landed
    } else {
      kra = row_of(c.kc, knew, pb + r);
      krb = row_of(c.kc, knew, pb + r + 8);
      ka = kra != nullptr;
      kb = krb != nullptr;
      stage_rows(c.vc, vnew, vst, pb);  // in flight with the keys' loads
      dev::cp_async_commit();
    }
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < KJ_MAX; ++j) {
      if (j >= KJ) break;
      const uint4 a = key16(kra, 32 * j + 8 * t), b = key16(krb, 32 * j + 8 * t);
      const uint4 q = *reinterpret_cast<const uint4*>(qrow + 32 * j + 8 * t);
      dev::mma_bf16_16816(sc, a.x, b.x, a.y, b.y, q.x, q.y);
      dev::mma_bf16_16816(sc, a.z, b.z, a.w, b.w, q.z, q.w);
    }
    if (tail) {
      const uint2 a = key8(kra, 32 * KJ + 4 * t), b = key8(krb, 32 * KJ + 4 * t);
      const uint2 q = *reinterpret_cast<const uint2*>(qrow + 32 * KJ + 4 * t);
      dev::mma_bf16_16816(sc, a.x, b.x, a.y, b.y, q.x, q.y);
    }
    if constexpr (!kStageKeys) {
      dev::cp_async_wait_all();
      __syncwarp();  // every lane's copies of the block's values have landed
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
    for (int i = 0; i < MT_MAX; ++i) {
      o[i][0] *= corr0;
      o[i][1] *= corr1;
      o[i][2] *= corr0;
      o[i][3] *= corr1;
    }
    ot[0] *= corr0;
    ot[1] *= corr1;
    ot[2] *= corr0;
    ot[3] *= corr1;
    // ---- P^T through smem: ps[hi/lo][head][pos] ----
    {
      const float pv[4] = {p0, p1, p2, p3};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int g = 2 * t + (e & 1), q = r + 8 * (e >> 1);
        const bf16 h = __float2bfloat16_rn(pv[e]);
        ps[g * 16 + q] = h;
        ps[128 + g * 16 + q] = __float2bfloat16_rn(pv[e] - __bfloat162float(h));
      }
    }
    __syncwarp();
    const unsigned pbase = dev::smem_addr(ps + r * 16 + 2 * t);
    const uint32_t bh0 = dev::lds_u32(pbase), bh1 = dev::lds_u32(pbase + 16);
    const uint32_t bl0 = dev::lds_u32(pbase + 256), bl1 = dev::lds_u32(pbase + 256 + 16);
    __syncwarp();
    // ---- O^T += V^T P^T: V rows of positions 2t, 2t+1, 2t+8, 2t+9 (staged) ----
    const bf16* vr[4];
#pragma unroll
    for (int qd = 0; qd < 4; ++qd) vr[qd] = vst + (2 * t + (qd & 1) + 8 * (qd >> 1)) * D;
#pragma unroll
    for (int cc = 0; cc < KJ_MAX; ++cc) {
      if (cc >= KJ) break;
      uint2 w[4];
#pragma unroll
      for (int qd = 0; qd < 4; ++qd) w[qd] = *reinterpret_cast<const uint2*>(vr[qd] + 32 * cc + 4 * r);
#pragma unroll
      for (int mm = 0; mm < 2; ++mm) {
        const uint32_t w0 = mm ? w[0].y : w[0].x, w1 = mm ? w[1].y : w[1].x;
        const uint32_t w2 = mm ? w[2].y : w[2].x, w3 = mm ? w[3].y : w[3].x;
        const uint32_t a0 = __byte_perm(w0, w1, 0x5410), a1 = __byte_perm(w0, w1, 0x7632);
        const uint32_t a2 = __byte_perm(w2, w3, 0x5410), a3 = __byte_perm(w2, w3, 0x7632);
        dev::mma_bf16_16816(o[cc * 2 + mm], a0, a1, a2, a3, bh0, bh1);
        dev::mma_bf16_16816(o[cc * 2 + mm], a0, a1, a2, a3, bl0, bl1);
      }
    }
    if (tail) {
      uint32_t w[4];
#pragma unroll
      for (int qd = 0; qd < 4; ++qd) w[qd] = *reinterpret_cast<const uint32_t*>(vr[qd] + 32 * KJ + 2 * r);
      const uint32_t a0 = __byte_perm(w[0], w[1], 0x5410), a1 = __byte_perm(w[0], w[1], 0x7632);
      const uint32_t a2 = __byte_perm(w[2], w[3], 0x5410), a3 = __byte_perm(w[2], w[3], 0x7632);
      dev::mma_bf16_16816(ot, a0, a1, a2, a3, bh0, bh1);
      dev::mma_bf16_16816(ot, a0, a1, a2, a3, bl0, bl1);
    }
    __syncwarp();  // the staged rows are read before the next block's copies overwrite them
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
  for (int i = 0; i < MT_MAX; ++i) {
    // m-tile i covers 32-d group i/2: rows d = 32(i/2) + 4r + 2(i%2) + {0, 1}
    if (i >= 2 * KJ) break;
    const int d = 32 * (i >> 1) + 4 * r + 2 * (i & 1);
    *reinterpret_cast<float2*>(wow + (2 * t) * D + d) = make_float2(o[i][0], o[i][2]);
    *reinterpret_cast<float2*>(wow + (2 * t + 1) * D + d) = make_float2(o[i][1], o[i][3]);
  }
  if (tail) {  // the 16-d tail: rows d = 32KJ + 2r + {0, 1}
    const int d = 32 * KJ + 2 * r;
    *reinterpret_cast<float2*>(wow + (2 * t) * D + d) = make_float2(ot[0], ot[2]);
    *reinterpret_cast<float2*>(wow + (2 * t + 1) * D + d) = make_float2(ot[1], ot[3]);
  }
  mpk::task_sync();
  a.mark(1);  // profiling: every warp's positions are attended (the last pass's mark stays)

  // ---- merge the warps (fixed order) and write ----
  // Head g's running max and sum over the warps, then column d's value (0 for an empty head).
  auto head_state = [&](int g, float& mstar, float& lsum) {
    mstar = kNegBig;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mstar = fmaxf(mstar, wm[w * 8 + g]);
    lsum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) lsum += wl[w * 8 + g] * exp2f(wm[w * 8 + g] - mstar);
  };
  auto column = [&](int g, int d, float mstar, float lsum) -> float {
    float osum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) osum += wo[(w * 8 + g) * D + d] * exp2f(wm[w * 8 + g] - mstar);
    return lsum > 0.f ? osum / lsum : 0.f;
  };
  const long long head0 = (((long long)bb * c.KVH + hh) * c.G + g0) * D;  // out's element
  if (c.out_ep && c.SE == 1) {  // flagged out: one word per pair of columns
    const int half = D / 2;
    dev::flag_word* words = dev::flag_operand<dev::flag_word>(a, O_OUT) + head0 / 2;
    for (int idx = tid; idx < ng * half; idx += NUM_THREADS) {
      const int g = idx / half, d = 2 * (idx - g * half);
      float mstar, lsum;
      head_state(g, mstar, lsum);
      const uint32_t pair = dev::pack_bf16x2(column(g, d, mstar, lsum),
                                             column(g, d + 1, mstar, lsum));
      dev::st_flag(words + (long long)g * half + d / 2, dev::make_flag_word(pair, c.out_ep));
    }
  } else {
    for (int idx = tid; idx < ng * D; idx += NUM_THREADS) {
      const int g = idx / D, d = idx - g * D;
      float mstar, lsum;
      head_state(g, mstar, lsum);
      const float val = column(g, d, mstar, lsum);
      if (c.SE == 1) {
        c.out[head0 + (long long)g * D + d] = dev::to_bf16(val);
      } else {
        c.po[(((long long)bb * c.KVH + hh) * c.S + s) * c.G * D + (long long)(g0 + g) * D + d] =
            val;
        if (d == 0)
          c.plse[(((long long)bb * c.KVH + hh) * c.S + s) * c.G + g0 + g] =
              lsum > 0.f ? (mstar + __log2f(lsum)) * kLn2 : -__int_as_float(0x7f800000);
      }
    }
  }
  mpk::task_sync();  // smem is reused by the next pass
}

// What the prologue leaves for run(): the row's position, cache row and this split's range.
struct Setup {
  int valid;  // the row's position is inside the rope table
  int se;     // the splits the row uses this step (effective_splits)
  int p, f0;  // f0: the first of this step's positions of the row's run (>= 0)
  long long crow;
  Range R;
};
static_assert(sizeof(Setup) <= 64, "Layout reserves 64 bytes for the prologue's Setup");

// The splits a row of `length` positions uses (task.py effective_splits): all S when SP is 0,
// else one up to 2 * SP positions, then ceil(length / SP), at most S.
__device__ __forceinline__ int effective_splits(int length, int S, int SP) {
  if (SP <= 0) return S;
  if (length <= 2 * SP) return 1;
  return min(S, (length + SP - 1) / SP);
}

// Position, the splits the row uses and this split's range for the tile's row, and whether this
// task appends its key (loads: the row's run and position only; what depends on them is loaded
// by the caller). A row outside the table uses the splits of a one-position context.
__device__ __forceinline__ bool row_range(const Ctx& c, const Layout& L, int s, int step, int& p,
                                          int& f0, int& se, bool& writer, Range& R) {
  const int bb = 0;  // positions, runs and page_table tiles start at the task's row
  const dev::RowRun run = dev::row_run(c.runs, c.row);
  const long long pos = (long long)dev::ld_act_i32(c.pos + bb) + (long long)step * run.width;
  se = effective_splits(1, c.S, c.SP);
  if (pos < 0 || pos >= c.MAXPOS) return false;
  p = (int)pos;
  f0 = max(0, p - run.index);
  const int length = p + 1;
  se = effective_splits(length, c.S, c.SP);
  const int chunk = (length + se - 1) / se;
  R.lo = s * chunk;
  R.hi = min(length, R.lo + chunk);
  R.hi = min(R.hi, c.MAXP * c.PS);  // positions past the page table cannot be read
  writer = p / chunk == s && c.q0 == 0 && p / c.PS < c.MAXP;  // query-head part 0 appends
  R.flo = max(R.lo, p - run.index);
  const int n = max(0, R.hi - R.lo);
  R.p_first = n > 0 ? R.lo / c.PS : 0;
  const int n_pages = n > 0 ? (R.hi - 1) / c.PS - R.p_first + 1 : 0;
  R.staged = min(n_pages, L.max_pages);
  return true;
}

// A row outside the rope table: zeros (or split s's empty partials), nothing appended. Only
// split s < SE calls it.
__device__ __forceinline__ void write_empty(const mpk::TaskArgs& a, const Ctx& c, int bb, int hh,
                                            int s) {
  const int GD = c.GP * c.D;  // S > 1: GP = G
  if (c.out_ep && c.SE == 1) {
    dev::flag_word* words =
        dev::flag_operand<dev::flag_word>(a, O_OUT) + ((long long)bb * c.KVH + hh) * GD / 2;
    for (int idx = threadIdx.x; idx < GD / 2; idx += NUM_THREADS)
      dev::st_flag(words + idx, dev::make_flag_word(0u, c.out_ep));
    return;
  }
  for (int idx = threadIdx.x; idx < GD; idx += NUM_THREADS) {
    if (c.SE == 1) {
      c.out[((long long)bb * c.KVH + hh) * GD + idx] = dev::to_bf16(0.f);
    } else {
      c.po[(((long long)bb * c.KVH + hh) * c.S + s) * GD + idx] = 0.f;
      if (idx < c.GP)
        c.plse[(((long long)bb * c.KVH + hh) * c.S + s) * c.G + idx] = -__int_as_float(0x7f800000);
    }
  }
}

// SE > 1: this split's partials are stored (or it has none: s >= SE); add its arrival to the
// (row, KV head)'s counter (task.py arrivals: mpk::launch_counters from params[ARRIVALS_PARAM],
// monotonic: S a step in which the row uses several splits, none in one where it uses one).
// True in every thread of the split whose add made the counter a multiple of S, which may then
// read every split's partials: each split stored its own before its release (the barrier, then
// thread 0's fence and add), and thread 0 of this one acquires them (its fence after the add)
// before the barrier that lets the others load.
__device__ __forceinline__ bool last_arrival(const mpk::TaskArgs& a, const Ctx& c) {
  mpk::task_sync();  // every thread's partials are stored
  bool last = false;
  if (threadIdx.x == 0) {
    unsigned long long* counter =
        mpk::launch_counters + a.i(REC_ARRIVALS_PARAM) + (long long)c.row * c.KVH + a.point(0);
    ptx::fence_acq_rel_gpu();
    const unsigned long long old = ptx::atom_relaxed_add_u64(counter, 1ull);
    // A step's adds take the counter from a multiple of S to the next one.
    last = (old + 1ull) % (unsigned long long)c.S == 0ull;
    if (last) ptx::fence_acq_rel_gpu();
  }
  return mpk::task_sync_or(last);
}

// The last split's merge of the SE used splits (in split order, so the value does not depend on
// which split came last): out = sum_s exp(lse_s - lse) * o_s, lse = log(sum_s exp(lse_s)); an
// empty split (lse = -inf) weighs 0, an all-empty head gives 0. Every used split's partials come
// to shared memory first (from byte 0: attend's regions are free; task.py scratch_bytes holds
// them), all copies in flight together (one L2 round trip; held in registers they spilled the
// kernel). Then a thread takes 4 columns of one query head; a flagged out gets two words.
__device__ __forceinline__ void merge_splits(const mpk::TaskArgs& a, const Ctx& c) {
  const int GD = c.G * c.D, SG = c.SE * c.G;  // S > 1: GP = G, q0 = 0
  float* so = reinterpret_cast<float*>(a.smem);  // [SE][GD]
  float* sl = so + c.SE * GD;                    // [SE][G]
  for (int i = threadIdx.x; i < c.SE * GD / 4; i += NUM_THREADS)
    dev::cp_async_act16(so + 4 * i, c.po + 4 * i);
  dev::cp_async_commit();
  for (int i = threadIdx.x; i < SG; i += NUM_THREADS) sl[i] = dev::ld_act_f32(c.plse + i);
  dev::cp_async_wait_all();
  mpk::task_sync();
  const float ninf = -__int_as_float(0x7f800000);
  for (int j = 4 * threadIdx.x; j < GD; j += 4 * NUM_THREADS) {
    const float* lse = sl + j / c.D;
    float m = ninf;
    for (int s = 0; s < c.SE; ++s) m = fmaxf(m, lse[s * c.G]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m != ninf && m == m) {
      float sum = 0.f;
      for (int s = 0; s < c.SE; ++s) sum += expf(lse[s * c.G] - m);
      const float total = m + logf(sum);
      for (int s = 0; s < c.SE; ++s) {
        const float w = expf(lse[s * c.G] - total);
        const float4 v = *reinterpret_cast<const float4*>(so + s * GD + j);
        acc.x = fmaf(v.x, w, acc.x);
        acc.y = fmaf(v.y, w, acc.y);
        acc.z = fmaf(v.z, w, acc.z);
        acc.w = fmaf(v.w, w, acc.w);
      }
    }
    const uint32_t lo = dev::pack_bf16x2(acc.x, acc.y), hi = dev::pack_bf16x2(acc.z, acc.w);
    if (c.out_ep)
      dev::st_flag2(dev::flag_operand<dev::flag_word>(a, O_OUT) + j / 2,
                    dev::make_flag_word(lo, c.out_ep), dev::make_flag_word(hi, c.out_ep));
    else
      *reinterpret_cast<uint2*>(c.out + j) = make_uint2(lo, hi);
  }
}

__device__ __forceinline__ Ctx ctx_of(const mpk::TaskArgs& a) {
  Ctx c;
  c.B = a.i(P_BATCH);
  c.G = a.i(P_GROUP);
  c.GP = c.G / max(1, a.i(P_PARTS));
  c.q0 = (a.point(0) % max(1, a.i(P_PARTS))) * c.GP;
  c.D = a.i(P_HEAD_DIM);
  c.KVH = a.i(P_KV_HEADS);
  c.PS = a.i(P_PAGE_SIZE);
  c.MAXP = a.i(P_MAX_PAGES);
  c.S = a.i(P_NUM_SPLITS);
  c.SP = a.i(P_SPLIT_POSITIONS);
  c.SE = c.S;
  c.NP = a.i(P_NUM_PAGES);
  c.MAXPOS = a.i(P_MAX_POS);
  c.norm = a.i(P_HAS_QK_NORM) != 0 && a.has(O_Q_NORM) && a.has(O_K_NORM);
  c.eps = a.f(P_EPS);
  c.scale2 = a.f(P_SCALE) * kLog2e;
  c.qkv = a.operand<const bf16>(O_QKV);
  c.qn = a.operand<const bf16>(O_Q_NORM);
  c.kn = a.operand<const bf16>(O_K_NORM);
  c.rope = a.operand<const float>(O_ROPE);
  c.pt = a.operand<const int>(O_PAGE_TABLE);
  c.pos = a.operand<const int>(O_POSITIONS);
  c.runs = a.operand<const int>(O_RUNS);
  c.row = a.point(1);
  c.kc = a.operand<bf16>(O_K_CACHE);
  c.vc = a.operand<bf16>(O_V_CACHE);
  c.out = a.operand<bf16>(O_OUT);
  c.po = a.operand<float>(O_PART_O);
  c.plse = a.operand<float>(O_PART_LSE);
  c.qkv_ep = dev::flag_epoch<FLAGGED>(a, O_QKV);
  c.out_ep = dev::flag_epoch<FLAGGED>(a, O_OUT);
  return c;
}

__device__ __forceinline__ bool supported(const Ctx& c) {  // task.py refuses the others
  return c.PS > 0 && c.S > 0 && c.D % 16 == 0 && c.D <= ATTN_MAX_HEAD_DIM;
}

}  // namespace detail

// Before the waits (task.py prologue_operands: positions, runs, page table, rope, norms; none is
// written by a task): the row's position and split, the page-table slice, the table rows of this
// step's positions and the norm weights go to shared memory, so the qkv read is the only global
// round trip between the waits and the attention. Two dependent round trips: the norm weights
// load with the row's run and position; then every thread's first page entry, table element and
// (thread 0) the appended slot's page entry load together, before any of them is stored (each
// store waits for its load; at batch 1 the prologue is on the layer's critical path: the SM runs
// it when its own qkv task ends).
MPK_TASK_ENTRY void prologue(const mpk::TaskArgs& a) {
  using namespace detail;
  static_assert(ATTN_MAX_HEAD_DIM <= NUM_THREADS, "a norm weight per thread");
  const Ctx c = ctx_of(a);
  if (!supported(c)) return;  // uniform; run() returns too
  const Layout L(c);
  const int t = threadIdx.x;
  const bool norm = c.norm && t < c.D;
  const uint32_t qn = norm ? dev::ld_weight_u16(c.qn + t) : 0u;  // bf16 bits, stored below
  const uint32_t kn = norm ? dev::ld_weight_u16(c.kn + t) : 0u;
  Setup st = {};  // p and f0 stay 0 for a row outside the table (nothing is loaded for it)
  bool writer = false;
  st.valid = row_range(c, L, a.point(2), a.step, st.p, st.f0, st.se, writer, st.R);
  const int* ptrow = c.pt;
  const float* rows = c.rope + (long long)st.f0 * c.D;
  const int n_rope = st.valid ? (st.p - st.f0 + 1) * c.D : 0, n_pages = st.valid ? st.R.staged : 0;
  const int wpage = dev::ld_act_i32_if(ptrow + st.p / c.PS, st.valid && writer && t == 0, -1);
  const int page = dev::ld_act_i32_if(ptrow + st.R.p_first + t, t < n_pages, 0);
  const float rope0 = t < n_rope ? dev::ld_act_f32(rows + t) : 0.f;
  float* nw = reinterpret_cast<float*>(a.smem + L.norm);
  if (norm) {
    nw[t] = __uint_as_float(qn << 16);
    nw[c.D + t] = __uint_as_float(kn << 16);
  }
  int* pages = reinterpret_cast<int*>(a.smem + L.pages);
  if (t < n_pages) pages[t] = page;
  for (int i = t + NUM_THREADS; i < n_pages; i += NUM_THREADS)
    pages[i] = dev::ld_act_i32(ptrow + st.R.p_first + i);
  float* rope = reinterpret_cast<float*>(a.smem + L.rope);
  if (t < n_rope) rope[t] = rope0;
  for (int e = t + NUM_THREADS; e < n_rope; e += NUM_THREADS) rope[e] = dev::ld_act_f32(rows + e);
  if (t == 0) {
    st.crow = wpage >= 0 && wpage < c.NP ? ((long long)wpage * c.PS + st.p % c.PS) * c.KVH : -1;
    *reinterpret_cast<Setup*>(a.smem + L.pre) = st;
  }
  mpk::task_sync();
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  Ctx c = ctx_of(a);
  if (!supported(c)) return;
  // One KV head (or part of its query heads) and one batch row per task (task.py: grid
  // (KVH x P, B, S)).
  const Layout L(c);
  const Setup st = *reinterpret_cast<const Setup*>(a.smem + L.pre);
  c.SE = st.se;
  const int s = a.point(2);
  // A flagged qkv is polled by every split the row uses, an empty row's split 0 too: the
  // controller skipped this task's qkv wait, and what follows it (o_proj's rewrite of hidden,
  // which qkv reads) is ordered only through these polls (compiler/flags.py). A split the row
  // does not use (s >= SE) reads and writes none of this step's activations (split 0 of its row
  // and head polls the same words), so o_proj seeing out while it still runs orders nothing
  // it touches.
  if (c.qkv_ep && s < c.SE) {
    stage_flagged_qkv(a, c, L);
    mpk::task_sync();
  }
  if (!st.valid) {
    if (s < c.SE) write_empty(a, c, 0, 0, s);
  } else if (s < c.SE) {  // splits s >= SE have no positions this step: nothing to write
    const Range& R = st.R;
    prepare(c, L, a.smem, 0, st.p, R.flo, max(R.flo, R.hi), st.crow, st.f0);
    mpk::task_sync();  // queries, this step's keys and values
    a.mark(0);  // profiling: the inputs are prepared
    // ATTN_MAX_HEAD_DIM (generated: 128, or 256 when the plan has larger heads) sizes the
    // registers; one instantiation per build keeps the smaller heads' register budget.
    for (int g0 = 0; g0 < c.GP; g0 += 8)
      attend<ATTN_MAX_HEAD_DIM>(a, c, L, a.smem, 0, 0, g0, s, R);
  }
  if (ATTN_MERGES && c.SE > 1 && last_arrival(a, c)) merge_splits(a, c);
}

}  // namespace mpk::kinds::attention
