// linear, sm_90a: out = prologue(x) @ weight^T (+ residual) for one tile of weight rows.
//
// Layout assumptions (default splits of task.py; nothing else is needed from the grid point):
//   weight tile: tile_m x tile_n rows of K bf16; row (mi, ni) at W + mi*N*K + ni*K (W = tile
//                pointer), i.e. a 2-D [N, K] weight is the case tile_m = 1.
//   out / residual tile: element (b, mi, ni) at ptr + b*M*N + mi*N + ni (full-tensor strides).
//   x: [B, K] (or [B, 2, K] for silu_mul), never split: the operand pointer is the tensor base.
//   K % 8 == 0 and 16-byte aligned rows for the fast path; anything else takes a slow scalar path.
//   Tiles of more than 1024 rows are processed in blocks of 1024 rows (x is re-staged per block).
//
// Design (batch-1..8 decode is weight-bandwidth bound):
//   * The prologue'd input rows (x, rmsnorm(x) or silu(g)*u, bf16 values exactly as numerics.py
//     rounds them) are staged once per task in shared memory, 8 rows x K (+64 B row padding, so the
//     16-byte fragment reads of consecutive lanes hit distinct banks). Rows b >= B read row B-1;
//     their results are discarded. For B > 8 the task loops over groups of 8 rows; when 8 rows of
//     K do not fit in shared memory, K is processed in chunks (fp32 accumulators in smem).
//   * The matrix-vector product runs on the tensor cores with mma.sync m16n8k16 (bf16 in, fp32
//     accumulate) in the "swap AB" form: A = 16 weight rows x 16 k, B = x^T (16 k x 8 batch rows).
//     Because a dot product may visit k in any order, each lane's 16-byte weight load (8
//     consecutive k of one row) IS its A fragment for two MMAs, and one 16-byte smem read of x is
//     its B fragment: no conversions, no shuffles, no cross-lane reduction (the C fragment of a
//     lane holds complete sums for rows g, g+8 and batch columns 2t, 2t+1).
//   * Work item = 16 rows x 128 k (8 rows x 256 k when the tile's row count is not a multiple of
//     16): 8 16-byte weight copies per lane, 4 KB per warp. Items are ordered row-group-major and
//     split into 8 contiguous ranges, one per warp, so every warp streams the same number of
//     bytes whatever the tile shape.
//   * Weights stream through a per-warp ring of S stages (S = 2..6, as shared memory allows:
//     up to 192 KB in flight per SM) with cp.async.cg 16-byte copies: each lane copies exactly
//     the fragments it will read back, so only per-thread commit/wait groups are needed (no
//     barriers). The first S items are issued before the prologue, so HBM latency overlaps the
//     staging of x (which comes from L2).
//   * A warp's partial sums for each row group it touched go to smem slot (row_group + warp),
//     which is unique; the epilogue adds the slots of a row group in warp order (deterministic),
//     rounds to the output dtype, adds the residual (rounding again for bf16), stores.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"

namespace mpk::kinds::linear {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kPad = 32;        // bf16 elements of padding per staged x row (64 bytes)
constexpr int kKAlign = 256;    // chunk lengths are multiples of the largest item k-span
constexpr int kPrologueNone = 0, kPrologueRms = 1, kPrologueSilu = 2;
constexpr int kMaxStages = 6;    // weight ring depth per warp (x 4 KB)
constexpr int kRowBlock = 1024;  // rows per pass of the fast path (bounds its smem bookkeeping)

struct Shape {
  int B, K, N, M, tm, tn, R, prologue;
  int r0;  // first tile row of the current row block (fast path: blocks of <= kRowBlock rows)
  bool res, f32;
  float eps;
  const bf16* x;
  const bf16* nw;
  const bf16* w;
  void* out;
  const void* resid;
};

// ---- epilogue: one output element -------------------------------------------------------------
__device__ __forceinline__ void store_out(const Shape& s, int b, int r, float acc) {
  r += s.r0;
  const int mi = r / s.tn, ni = r - (r / s.tn) * s.tn;
  const long long off = (long long)b * s.M * s.N + (long long)mi * s.N + ni;
  if (s.f32) {
    float y = acc;
    if (s.res) y = __fadd_rn(y, dev::ld_act_f32(static_cast<const float*>(s.resid) + off));
    static_cast<float*>(s.out)[off] = y;
  } else {
    float y = dev::round_bf16(acc);
    if (s.res) y = __fadd_rn(y, dev::ld_act_bf16f(static_cast<const bf16*>(s.resid) + off));
    static_cast<bf16*>(s.out)[off] = dev::to_bf16(y);
  }
}

// ---- rmsnorm prologue: inverse rms of rows [b0, b0+nb) read straight from global ---------------
// The tail both rmsnorm paths share: warp `warp` of the CTA adds its lanes' sums of squares of
// row b into red[b][warp]; after every row, finish_rms_inv turns red into inv[b].
__device__ __forceinline__ void store_warp_ss(float ss, int b, float* red, int lane, int warp) {
  ss = dev::warp_sum(ss);
  if (lane == 0) red[b * kWarps + warp] = ss;
}

__device__ __forceinline__ void finish_rms_inv(const Shape& s, int nb, const float* red,
                                               float* inv) {
  const int tid = threadIdx.x;
  __syncthreads();
  if (tid < nb) {
    float t = 0.f;
    for (int w = 0; w < kWarps; ++w) t += red[tid * kWarps + w];
    inv[tid] = dev::rms_inv(t, s.K, s.eps);
  }
  __syncthreads();
}

__device__ __forceinline__ void rms_inv_global(const Shape& s, int b0, int nb, float* red,
                                            float* inv) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool vec = (s.K % 8 == 0) && dev::aligned16(s.x);
  for (int b = 0; b < nb; ++b) {
    const bf16* row = s.x + (long long)(b0 + b) * s.K;
    float ss = 0.f;
    if (vec) {
      for (int v = tid; v < s.K / 8; v += NUM_THREADS) {
        float f[8];
        dev::unpack8(dev::ld_act_v4(row + v * 8), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
      }
    } else {
      for (int k = tid; k < s.K; k += NUM_THREADS) {
        float f = dev::ld_act_bf16f(row + k);
        ss = fmaf(f, f, ss);
      }
    }
    store_warp_ss(ss, b, red, lane, warp);
  }
  finish_rms_inv(s, nb, red, inv);
}

// ---- slow path: any K, any alignment (scalar loads, CUDA cores) -------------------------------
__device__ __forceinline__ float x_elem(const Shape& s, int b, int k, const float* inv) {
  if (s.prologue == kPrologueSilu) {
    const bf16* row = s.x + (long long)b * 2 * s.K;
    return dev::silu_mul_f32(dev::ld_act_bf16f(row + k), dev::ld_act_bf16f(row + s.K + k));
  }
  float v = dev::ld_act_bf16f(s.x + (long long)b * s.K + k);
  if (s.prologue == kPrologueRms) v = dev::rmsnorm_elem(v, inv[b], dev::ld_weight_bf16f(s.nw + k));
  return v;
}

__device__ __forceinline__ void run_slow(const Shape& s, char* smem) {
  float* red = reinterpret_cast<float*>(smem);
  float* inv = red + 8 * kWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int b0 = 0; b0 < s.B; b0 += 8) {
    const int nb = min(8, s.B - b0);
    if (s.prologue == kPrologueRms) rms_inv_global(s, b0, nb, red, inv);
    for (int r = warp; r < s.R; r += kWarps) {
      const int mi = r / s.tn, ni = r - mi * s.tn;
      const bf16* wr = s.w + (long long)mi * s.N * s.K + (long long)ni * s.K;
      for (int b = b0; b < b0 + nb; ++b) {
        float acc = 0.f;
        for (int k = lane; k < s.K; k += 32)
          acc = fmaf(dev::ld_weight_bf16f(wr + k), x_elem(s, b, k, inv - b0), acc);
        acc = dev::warp_sum(acc);
        if (lane == 0) store_out(s, b, r, acc);
      }
    }
    __syncthreads();  // red/inv are rewritten by the next row group
  }
}

// ---- fast path ----------------------------------------------------------------------------------
// HALVES = 2: an item is 16 rows x 128 k (rows g and g+8 of the MMA are real rows).
// HALVES = 1: an item is  8 rows x 256 k (MMA rows g+8 duplicate rows g and are discarded).
template <int HALVES>
struct Tiling {
  static constexpr int kRows = 8 * HALVES;          // rows per row group
  static constexpr int kSpan = 256 / HALVES;        // k per item
  static constexpr int kLoads = 8;                  // 16-byte weight loads per lane per item
};

// Walks a warp's items in order (row group major, then k), issuing each item's 8 16-byte weight
// copies (this lane's fragments) into a ring stage. Division only when the row group changes.
// Copy L of lane l lands at stage + L*512 + l*16; out-of-range rows / k read nothing and store
// zeros (cp.async src-size 0). The caller commits the group.
template <int HALVES>
struct ItemIssuer {
  using T = Tiling<HALVES>;
  const bf16* row[HALVES];
  bool valid[HALVES];
  int rg, ks;

  __device__ __forceinline__ void set_rows(const Shape& s, int kc0, int g) {
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      const int r = rg * T::kRows + g + 8 * h;
      valid[h] = r < s.R;
      const int rr = s.r0 + (valid[h] ? r : 0);
      const int mi = rr / s.tn, ni = rr - mi * s.tn;
      row[h] = s.w + (long long)mi * s.N * s.K + (long long)ni * s.K + kc0;
    }
  }
  __device__ __forceinline__ void start(const Shape& s, int it, int ks_per_rg, int kc0, int g) {
    rg = it / ks_per_rg;
    ks = it - rg * ks_per_rg;
    set_rows(s, kc0, g);
  }
  // Issue the current item into `dst` and advance to the next one.
  __device__ __forceinline__ void issue(unsigned dst, const Shape& s, int ks_per_rg, int kc0,
                                        int kc_len, int g, int t, int lane) {
    const int k0 = ks * T::kSpan + t * 8;
    const bool full = ks * T::kSpan + T::kSpan <= kc_len;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
#pragma unroll
      for (int j = 0; j < 8 / HALVES; ++j) {
        const int k = k0 + j * 32;
        const bool ok = valid[h] && (full || k < kc_len);
        dev::cp_async_weight16(dst + (j * HALVES + h) * 512 + lane * 16,
                               ok ? row[h] + k : row[h], ok);
      }
    }
    if (++ks == ks_per_rg) {
      ks = 0;
      ++rg;
      set_rows(s, kc0, g);
    }
  }
};

template <int HALVES>
__device__ __forceinline__ void mma_item(float (&c)[4], const uint4 (&v)[8], unsigned xrow,
                                         int k0, int t) {
  using T = Tiling<HALVES>;
#pragma unroll
  for (int j = 0; j < 8 / HALVES; ++j) {
    const uint4 xb = dev::lds_v4(xrow + 2u * (k0 + j * 32 + t * 8));
    const uint4& lo = v[j * HALVES];
    const uint4& hi = v[j * HALVES + HALVES - 1];  // == lo when HALVES == 1
    dev::mma_bf16_16816(c, lo.x, hi.x, lo.y, hi.y, xb.x, xb.y);
    dev::mma_bf16_16816(c, lo.z, hi.z, lo.w, hi.w, xb.z, xb.w);
  }
  (void)T::kRows;
}

template <int HALVES>
__device__ __forceinline__ void flush(float* part, int seg, const float (&c)[4], int g, int t) {
  float* p = part + seg * 128;
  *reinterpret_cast<float2*>(p + g * 8 + 2 * t) = make_float2(c[0], c[1]);
  if (HALVES == 2) *reinterpret_cast<float2*>(p + (g + 8) * 8 + 2 * t) = make_float2(c[2], c[3]);
}

// Copy `nb` rows of `len` bf16 (len % 8 == 0) from global (row stride `ss`) to smem (row stride
// `ds`) with cp.async; the caller waits (cp_async_wait_all + barrier).
__device__ __forceinline__ void copy_rows_async(bf16* dst, int ds, const bf16* src, long long ss,
                                                int nb, int len) {
  const unsigned vpr = static_cast<unsigned>(len) / 8u;
  const unsigned total = static_cast<unsigned>(nb) * vpr;
  for (unsigned idx = threadIdx.x; idx < total; idx += NUM_THREADS) {
    const unsigned b = idx / vpr, v = idx - b * vpr;
    dev::cp_async_act16(dst + b * ds + v * 8, src + b * ss + v * 8);
  }
}

// Start copying the raw input rows [b0, b0+nb), k in [kc0, kc0+kc_len), into smem (xs rows of
// stride XS, or for silu_mul the gate/up rows into `raw`, 2 * nb rows of stride KC) and commit
// them as one cp.async group. The caller waits for that group, then calls stage_x_finish.
__device__ __forceinline__ void stage_x_issue(const Shape& s, bf16* xs, int XS, bf16* raw, int KC,
                                              int b0, int nb, int kc0, int kc_len) {
  if (s.prologue == kPrologueSilu) {
    const bf16* src = s.x + (long long)b0 * 2 * s.K + kc0;
    copy_rows_async(raw, KC, src, 2LL * s.K, nb, kc_len);                 // gate rows
    copy_rows_async(raw + nb * KC, KC, src + s.K, 2LL * s.K, nb, kc_len);  // up rows
  } else {
    copy_rows_async(xs, XS, s.x + (long long)b0 * s.K + kc0, s.K, nb, kc_len);
  }
  dev::cp_async_commit();
}

// Turn the staged raw rows into the prologue'd input (bf16 values exactly as numerics.py rounds
// them) and zero-fill k in [kc_len, kc_fill). rmsnorm: with `single` (the whole row is staged)
// the inverse rms is computed here from smem; otherwise inv[] holds it already. Starts and ends
// with a barrier (the caller has waited for its own copies).
__device__ __forceinline__ void stage_x_finish(const Shape& s, bf16* xs, int XS, bf16* raw, int KC,
                                               int nb, int kc0, int kc_len, int kc_fill,
                                               bool single, float* red, float* inv) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  __syncthreads();

  const unsigned vpr = static_cast<unsigned>(kc_len) / 8u;
  const unsigned total = static_cast<unsigned>(nb) * vpr;
  if (s.prologue == kPrologueRms) {
    if (single) {
      for (int b = 0; b < nb; ++b) {
        float ss = 0.f;
        for (unsigned v = tid; v < vpr; v += NUM_THREADS) {
          float f[8];
          dev::unpack8(*reinterpret_cast<const uint4*>(xs + b * XS + v * 8), f);
#pragma unroll
          for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
        }
        store_warp_ss(ss, b, red, lane, warp);
      }
      finish_rms_inv(s, nb, red, inv);
    }
#pragma unroll 1
    for (unsigned idx = tid; idx < total; idx += NUM_THREADS) {
      const unsigned b = idx / vpr, v = idx - b * vpr;
      uint4* p = reinterpret_cast<uint4*>(xs + b * XS + v * 8);
      float fx[8], fw[8], fo[8];
      dev::unpack8(*p, fx);
      dev::unpack8(dev::ld_weight_v4(s.nw + kc0 + v * 8), fw);
      const float ib = inv[b];
#pragma unroll
      for (int e = 0; e < 8; ++e) fo[e] = dev::rmsnorm_elem(fx[e], ib, fw[e]);
      *p = dev::pack8(fo);
    }
  } else if (s.prologue == kPrologueSilu) {
#pragma unroll 1
    for (unsigned idx = tid; idx < total; idx += NUM_THREADS) {
      const unsigned b = idx / vpr, v = idx - b * vpr;
      float fg[8], fu[8], fo[8];
      dev::unpack8(*reinterpret_cast<const uint4*>(raw + b * KC + v * 8), fg);
      dev::unpack8(*reinterpret_cast<const uint4*>(raw + (nb + b) * KC + v * 8), fu);
#pragma unroll
      for (int e = 0; e < 8; ++e) fo[e] = dev::silu_mul_f32(fg[e], fu[e]);
      *reinterpret_cast<uint4*>(xs + b * XS + v * 8) = dev::pack8(fo);
    }
  }
  const int zpr = (kc_fill - kc_len) / 8;
  for (int idx = tid; idx < nb * zpr; idx += NUM_THREADS) {
    const int b = idx / zpr, v = idx - b * zpr;
    *reinterpret_cast<uint4*>(xs + b * XS + kc_len + v * 8) = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();
}

template <int HALVES>
__device__ __forceinline__ void run_fast(const Shape& s, char* smem) {
  using T = Tiling<HALVES>;
  constexpr int kStageBytes = 32 * 8 * 16;  // one item: 8 x 16 B per lane
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int RG = (s.R + T::kRows - 1) / T::kRows;
  const int nseg = RG + kWarps - 1;

  // Shared memory: [part: nseg*128 f32][acc: R*8 f32][red: 64 f32][inv: 8 f32]
  //                [ring: kWarps x S stages x 4 KB][xs: nb rows x XS bf16][raw (silu): 2*nb x KC]
  float* part = reinterpret_cast<float*>(smem);
  float* acc = part + nseg * 128;
  float* red = acc + s.R * 8;
  float* inv = red + 8 * kWarps;
  char* ring = reinterpret_cast<char*>(inv + 8);
  const int fixed_bytes = (nseg * 128 + s.R * 8 + 8 * kWarps + 8) * 4;
  const int per_k = s.prologue == kPrologueSilu ? 6 : 2;  // smem bytes per staged x element

  for (int b0 = 0; b0 < s.B; b0 += 8) {
    const int nb = min(8, s.B - b0);
    // Ring depth S and K chunking: the whole row if it fits next to >= 2 stages per warp.
    const int avail = SMEM_BYTES - fixed_bytes;
    const int k_full = (s.K + kKAlign - 1) / kKAlign * kKAlign;
    const int x_full = nb * (per_k * k_full + 2 * kPad);
    int S, kc_max;
    if (x_full + 2 * kWarps * kStageBytes <= avail) {
      S = min(kMaxStages, (avail - x_full) / (kWarps * kStageBytes));
      kc_max = k_full;
    } else {
      S = 2;
      kc_max = ((avail - S * kWarps * kStageBytes) / nb - 2 * kPad) / per_k / kKAlign * kKAlign;
      if (kc_max < kKAlign) kc_max = kKAlign;
    }
    const int nchunks = (s.K + kc_max - 1) / kc_max;
    const int KC = ((s.K + nchunks - 1) / nchunks + kKAlign - 1) / kKAlign * kKAlign;
    const int XS = KC + kPad;
    const unsigned ring_w = dev::smem_addr(ring) + warp * S * kStageBytes;
    bf16* xs = reinterpret_cast<bf16*>(ring + kWarps * S * kStageBytes);
    bf16* raw = xs + nb * XS;
    const unsigned xrow = dev::smem_addr(xs + min(g, nb - 1) * XS);

    if (s.prologue == kPrologueRms && nchunks > 1) rms_inv_global(s, b0, nb, red, inv);

    for (int ch = 0; ch < nchunks; ++ch) {
      const int kc0 = ch * KC;
      const int kc_len = min(KC, s.K - kc0);
      const int ks_per_rg = (kc_len + T::kSpan - 1) / T::kSpan;
      const int total = RG * ks_per_rg;
      const int it0 = (int)((long long)warp * total / kWarps);
      const int it1 = (int)((long long)(warp + 1) * total / kWarps);

      // Input rows first (one group), then the first S items of this warp (one group each),
      // so the weight stream is in flight while the prologue runs.
      stage_x_issue(s, xs, XS, raw, KC, b0, nb, kc0, kc_len);
      ItemIssuer<HALVES> iss;
      iss.start(s, it0, ks_per_rg, kc0, g);
      for (int q = 0; q < S; ++q) {
        if (it0 + q < it1) iss.issue(ring_w + q * kStageBytes, s, ks_per_rg, kc0, kc_len, g, t, lane);
        dev::cp_async_commit();
      }
      dev::cp_async_wait_group(S);  // the input rows have landed (weights may still fly)
      stage_x_finish(s, xs, XS, raw, KC, nb, kc0, kc_len, ks_per_rg * T::kSpan, nchunks == 1,
                     red, inv);

      // Main loop: item i sits in stage i % S; S groups are always pending.
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      int cur_rg = it0 / ks_per_rg;
      int ks = it0 - cur_rg * ks_per_rg;
      int stage = 0;
      for (int it = it0; it < it1; ++it) {
        dev::cp_async_wait_group(S - 1);
        const unsigned src = ring_w + stage * kStageBytes + lane * 16;
        uint4 v[8];
#pragma unroll
        for (int L = 0; L < 8; ++L) v[L] = dev::lds_v4(src + L * 512);
        mma_item<HALVES>(c, v, xrow, ks * T::kSpan, t);
        // The MMAs consumed v, so the stage can be refilled.
        if (it + S < it1)
          iss.issue(ring_w + stage * kStageBytes, s, ks_per_rg, kc0, kc_len, g, t, lane);
        dev::cp_async_commit();
        stage = stage + 1 == S ? 0 : stage + 1;
        if (++ks == ks_per_rg && it + 1 < it1) {  // next item starts a new row group
          flush<HALVES>(part, cur_rg + warp, c, g, t);
          c[0] = c[1] = c[2] = c[3] = 0.f;
          ks = 0;
          ++cur_rg;
        }
      }
      if (it0 < it1) flush<HALVES>(part, cur_rg + warp, c, g, t);
      __syncthreads();

      // Reduce the warps' partial sums in a fixed order; epilogue after the last chunk.
      const bool last = ch == nchunks - 1;
      for (int idx = tid; idx < nb * s.R; idx += NUM_THREADS) {
        const int b = idx / s.R, r = idx - (idx / s.R) * s.R;
        const int rg = r / T::kRows, rr = r - rg * T::kRows;
        const int lo = rg * ks_per_rg, hi = lo + ks_per_rg;
        float sum = 0.f;
        for (int w = 0; w < kWarps; ++w) {
          const int w0 = (int)((long long)w * total / kWarps);
          const int w1 = (int)((long long)(w + 1) * total / kWarps);
          if (w0 < w1 && w0 < hi && w1 > lo) sum += part[(rg + w) * 128 + rr * 8 + b];
        }
        if (ch > 0) sum += acc[r * 8 + b];
        if (last) store_out(s, b0 + b, r, sum);
        else acc[r * 8 + b] = sum;
      }
      __syncthreads();
    }
  }
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  Shape s;
  s.B = a.i(P_BATCH);
  s.K = a.i(P_K);
  s.N = a.i(P_N);
  s.M = a.i(P_M);
  s.tm = a.i(P_TILE_M);
  s.tn = a.i(P_TILE_N);
  s.R = s.tm * s.tn;
  s.r0 = 0;
  s.prologue = a.i(P_PROLOGUE);
  s.res = a.i(P_HAS_RESIDUAL) != 0 && a.has(O_RESIDUAL);
  s.f32 = a.i(P_OUT_F32) != 0;
  s.eps = a.f(P_EPS);
  s.x = a.operand<const bf16>(O_X);
  s.nw = a.operand<const bf16>(O_NORM_WEIGHT);
  s.w = a.operand<const bf16>(O_WEIGHT);
  // Typed operand pointers: the tile offset is in elements of the tensor's dtype.
  if (s.f32) {
    s.out = a.operand<float>(O_OUT);
    s.resid = s.res ? static_cast<const void*>(a.operand<const float>(O_RESIDUAL)) : nullptr;
  } else {
    s.out = a.operand<bf16>(O_OUT);
    s.resid = s.res ? static_cast<const void*>(a.operand<const bf16>(O_RESIDUAL)) : nullptr;
  }
  if (s.prologue == kPrologueRms && s.nw == nullptr) s.prologue = kPrologueNone;
  if (s.B <= 0 || s.R <= 0 || s.K <= 0) return;  // uniform across the CTA

  const bool fast = (s.K % 8 == 0) && dev::aligned16(s.w) && dev::aligned16(s.x) &&
                    (s.prologue != kPrologueRms || dev::aligned16(s.nw));
  if (!fast) {
    run_slow(s, a.smem);
    return;
  }
  const int rows = s.R;
  const bool halves2 = rows % 16 == 0;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    s.r0 = r0;
    s.R = min(kRowBlock, rows - r0);
    if (halves2) run_fast<2>(s, a.smem);
    else run_fast<1>(s, a.smem);
  }
}

}  // namespace mpk::kinds::linear
