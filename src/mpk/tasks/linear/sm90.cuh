// linear, sm_90a: out = epilogue(prologue(x) @ W^T) for one task's range of outputs, with the
// weights read from the runtime's shared-memory pages (the loader streamed them ahead). The MMA
// walk over a block's pages is in linear/sm90_walk.cuh (this file includes it).
//
// The page contents and their order are defined in tasks/linear/geometry.py (read it first):
// units of 8 stream rows x 32 k (512 B, row-major), ordered chunk -> block (8/4/2/1 row groups)
// -> k group -> row group, 32 units per page.
//
// Work split: consumer warp w takes the task's units w, w+8, w+16, ... Inside a block of n row
// groups (n divides 8) those are always row group (w - block_start) mod n of the block, at
// k groups (u - block_start) / n: so a warp accumulates ONE row group per block in registers.
// A block of 8 gives every warp its own row group: no cross-warp reduction, each warp writes its
// outputs itself. Smaller blocks (a task's last few row groups) reduce the warps' partial sums
// in shared memory in warp order (deterministic), then the CTA writes them.
//
// MMA (mma.m16n8k16, bf16 in, fp32 accumulate): A = the staged input rows (M = batch rows,
// 16 at most), B = the weight unit (N = its 8 stream rows). A lane's 16-byte unit read (row
// g = lane/4, t = lane%4) holds words W0..W3 = the k pairs (8t, 8t+1), (8t+4, 8t+5),
// (8t+2, 8t+3), (8t+6, 8t+7) of its row (geometry.LANE_KPAIRS: laid out so at bind time), and
// is, untouched, the B fragment of two MMAs: (W0, W1) and (W2, W3). A dot product may visit k
// in any order, so MMA 1 pairs its k slots (2t, 2t+1 | 2t+8, 2t+9) with k (8t, 8t+1 | 8t+4,
// 8t+5) and MMA 2 with (8t+2, 8t+3 | 8t+6, 8t+7). With x's words w0..w3 = its natural k pairs
// 8t+2i, +1:
//   Rows are staged in natural order, and a lane's 16-byte read q of row g is both MMAs' whole A
//     fragment with no register moves: MMA 1's rows 0-7 meet words w0, w2 (right), MMA 2's rows
//     8-15 meet w1, w3 of the same input row (right); the other halves of D are discarded.
//     Output (g, n) = D1[g][n] + D2[g + 8][n], both held by lane (g, n / 2).
//   batch 9-16 ("wide"): the same two MMAs once more for row g + 8 (its own accumulators): four
//     MMAs a unit, where rows g and g + 8 interleaved into one A fragment took two but needed a
//     permute pass over the staged rows (1.1-1.6 us of a b16 input: perf-log, twenty-seventh
//     session). Rows past B are staged as zeros (16 rows are staged).
// A lane (g, t) ends with outputs (batch g and g + 8) x (stream rows 2t, 2t + 1). Rows past the
// batch: at b <= 8 the walk reads a clamped real row (its sums are discarded), wide they are
// staged zeros (their outputs are not stored).
//
// Input rows: copied with cp.async into place in natural order, row after row (a 16-byte vector
// per 8 k: a warp's copies are contiguous in global AND shared memory, at the same relative
// offsets, so they coalesce; a strided shared destination, or lanes alternating between two
// rows, made every lane's copy its own wavefront and sector: perf-log, tenth and eleventh
// sessions), and stay so. The row stride (64 mod 128 bytes) spreads a quarter-warp's 16-byte
// reads over all banks. Several chunks (large K x batch) add each chunk's sums into fp32 `acc`.
// rmsnorm prologue: the stream's weights carry the norm weight folded into their columns
// (bf16(W * g): geometry.build_stream, numerics.fold_norm), so the walk reads the raw rows and
// the epilogue scales each row's fp32 sums by its inverse rms (the rows' sums of squares, taken
// as the chunks land). That replaced an in-place normalising pass over the staged rows and its
// barrier (0.4 us a phase at batch 1, 1.0 at 16: perf-log, forty-first session) and the page
// that carried the norm weight.
// Flagged x / residual / out (compiler/flags.py, common/flags.cuh): x is polled into place
// instead of copied, the residual's word checked for its epoch after the walk, outputs written as
// one word per pair of columns (every epilogue writes pairs).
// Epilogues: plain (round to out's dtype, + residual rounded again for bf16), silu_mul (stream rows
// r < 4 are gate, r + 4 up: lanes t and t ^ 2, paired by a shuffle), argmax (each output's key goes
// into a shared 64-bit atomicMax: value-ordered, ties to the lowest index, NaN first;
// deterministic; a row that samples ranks out / T + Gumbel noise, tasks/sampling.py).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/flags.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/runs.cuh"
#include "../common/sampling.cuh"
#include "../common/split.cuh"

namespace mpk::kinds::linear {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kRows = 8;
static_assert(kRows == 8, "task_of divides by the row alignment (8, or 4 for silu) with a shift");
constexpr int kUnitK = 32;
constexpr int kUnitBytes = 512;
constexpr int kPageUnits = PAGE_BYTES / kUnitBytes;
constexpr int kXPad = 32;  // bf16 elements of padding per staged row (task.py X_PAD)
constexpr int kMaxB = 16;
// The warps' partial sums of a shared block: float (warp w, row g, batch b) at w * kPartWarp +
// g * kPartRow + b (task.py PART_BYTES). Padded so that neither finish_shared's stores nor its
// sums meet bank conflicts of more than 2 ways at any batch: unpadded (16, 128), at batch 1 every
// thread's sum loads hit bank 0 (16 ways), and the stores 4 ways (perf-log, nineteenth session;
// the smallest padding with 2 ways at most, searched over strides).
constexpr int kPartRow = 18;
constexpr int kPartWarp = 144;
static_assert(kPartRow >= kMaxB && kPartWarp >= kRows * kPartRow, "partials must not overlap");
static_assert(kWarps * kMaxB * 4 + 3 * kMaxB * 8 + kMaxB * 4 <= 1024,
              "red, best and sampling fit task.py's 1 KB");

struct Task {
  int B, K, N, T, xc, nch, align, rgs, n0, n1;
  bool wide;  // B > 8: rows g and g + 8 hold MMA 1's and MMA 2's A fragments (header)
  bool silu, rms, res, f32, argmax, sampling;
  float eps;
  const bf16* x;
  void* out;          // element n of row b at out + b*N + n (full-tensor pointer)
  const void* resid;  // same layout as out
  float* pval;        // part_val tile: row b at + b*T
  int* pidx;
  const int* samp;    // sampling [B, SAMPLING_WORDS] (tasks/sampling.py)
  const int* pos;     // positions [B]
  const int* runs;    // runs [B, RUN_WORDS] (tasks/runs.py), or null: every row alone
  int step;
  uint32_t x_ep, res_ep, out_ep;  // epochs of the flagged operands (common/flags.cuh; 0: plain)
};

// Shared scratch: a 1 KB head at fixed offsets [red: 16 x kWarps f32][best: 16 u64]
// [sampling: 16 x (seed u64, position i64, temperature f32)], then [xs: B (wide: 16) rows of XS
// bf16][part: 2 x kWarps x kPartWarp f32][acc: rgs x 8 x B f32]. Plans with a wide linear pass
// the prologue's Task to run() in red's bytes (kPre): run() copies it to registers before its
// first barrier, red is first written after it.
constexpr int kHeadBytes = 1024;
constexpr bool kPre = LINEAR_MAX_BATCH > kRows;
static_assert(sizeof(Task) <= sizeof(float) * kWarps * kMaxB, "red's bytes hold the Task");
struct Scratch {
  bf16* xs;
  float* part;
  float* red;
  unsigned long long* best;
  unsigned long long* seed;
  long long* spos;
  float* temp;
  float* acc;
  int XS;  // staged row stride (bf16 elements)
};

// Rows staged: B, or 16 when wide (rows past B zero).
__device__ __forceinline__ int staged_rows(const Task& t) { return t.wide ? 2 * kRows : t.B; }
// Rows a staging pass walks: B, or, wide, the 8 rows p whose vectors are handled with row
// p + 8's.
__device__ __forceinline__ int pass_rows(const Task& t) { return t.wide ? kRows : t.B; }

__device__ __forceinline__ Scratch carve(const Task& t, char* smem) {
  Scratch s;
  // Row stride 64 mod 128 bytes (header: conflict-free A reads).
  s.XS = (t.xc + 2 * kXPad - 1) / (2 * kXPad) * (2 * kXPad) + kXPad;
  char* p = smem;
  s.red = reinterpret_cast<float*>(p);
  p += kWarps * kMaxB * 4;
  s.best = reinterpret_cast<unsigned long long*>(p);
  p += kMaxB * 8;
  s.seed = reinterpret_cast<unsigned long long*>(p);
  p += kMaxB * 8;
  s.spos = reinterpret_cast<long long*>(p);
  p += kMaxB * 8;
  s.temp = reinterpret_cast<float*>(p);
  p = smem + kHeadBytes;
  s.xs = reinterpret_cast<bf16*>(p);
  p += ((staged_rows(t) * s.XS * 2 + 15) / 16) * 16;
  s.part = reinterpret_cast<float*>(p);
  p += 2 * kWarps * kPartWarp * 4;
  s.acc = reinterpret_cast<float*>(p);
  return s;
}

// The key of output n of batch row b: its stored value, or for a row that samples
// (temperature > 0) value / T plus its Gumbel noise.
__device__ __forceinline__ unsigned long long rank_key(const Scratch& s, int b, float y, int n) {
  const float T = s.temp[b];
  if (T > 0.f) y = __fadd_rn(__fdiv_rn(y, T), dev::gumbel(s.seed[b], s.spos[b], n));
  return dev::argmax_key(y, n);
}

// ---- epilogue: outputs in pairs of columns (n, n + 1; n even), a flagged output's words --------

// Plain: the value out[b][n] stores from the fp32 sum and the residual (rounded to bf16 unless
// out is f32; argmax ranks it).
__device__ __forceinline__ float plain_value(const Task& t, float sum, float resid) {
  if (t.f32) return t.res ? __fadd_rn(sum, resid) : sum;
  const float y = dev::round_bf16(sum);
  return t.res ? dev::round_bf16(__fadd_rn(y, resid)) : y;
}
__device__ __forceinline__ float silu_value(float gate, float up) {
  return dev::silu_mul_f32(dev::round_bf16(gate), dev::round_bf16(up));
}

// Write out[b][n], out[b][n + 1] (the second only when n + 1 < n1: N may be odd unless flagged).
__device__ __forceinline__ void store_out(const Task& t, int b, int n, float y0, float y1) {
  const long long off = (long long)b * t.N + n;
  if (t.out_ep) {
    dev::st_flag(static_cast<dev::flag_word*>(t.out) + off / 2,
                 dev::make_flag_word(dev::pack_bf16x2(y0, y1), t.out_ep));
  } else if (t.f32) {
    static_cast<float*>(t.out)[off] = y0;
    if (n + 1 < t.n1) static_cast<float*>(t.out)[off + 1] = y1;
  } else {
    static_cast<bf16*>(t.out)[off] = dev::to_bf16(y0);
    if (n + 1 < t.n1) static_cast<bf16*>(t.out)[off + 1] = dev::to_bf16(y1);
  }
}

// The residual pair's raw words, loaded before the walk and used only after it, so the L2 round
// trip runs under the walk (a conversion right after each load made the warp wait for it:
// perf-log, thirteenth session). Plain: each element's bits (f32, or bf16 zero-extended);
// flagged: the word's pair and its epoch.
__device__ __forceinline__ void load_resid(const Task& t, int b, int n, unsigned& w0,
                                           unsigned& w1) {
  const long long off = (long long)b * t.N + n;
  if (t.res_ep) {
    const dev::flag_word w = dev::ld_flag(static_cast<const dev::flag_word*>(t.resid) + off / 2);
    w0 = dev::word_pair(w);
    w1 = dev::word_epoch(w);
  } else if (t.f32) {
    w0 = dev::ld_act_u32(static_cast<const float*>(t.resid) + off);
    w1 = n + 1 < t.n1 ? dev::ld_act_u32(static_cast<const float*>(t.resid) + off + 1) : 0u;
  } else {
    w0 = dev::ld_act_u16(static_cast<const bf16*>(t.resid) + off);
    w1 = n + 1 < t.n1 ? dev::ld_act_u16(static_cast<const bf16*>(t.resid) + off + 1) : 0u;
  }
}
// load_resid's words as the two residual values (a flagged word polled until it carries its epoch).
__device__ __forceinline__ void resid_values(const Task& t, int b, int n, unsigned w0, unsigned w1,
                                             float& r0, float& r1) {
  if (t.res_ep) {
    const dev::Poll poll;
    const long long off = (long long)b * t.N + n;
    const unsigned pair = dev::poll_word(static_cast<const dev::flag_word*>(t.resid) + off / 2,
                                         dev::make_flag_word(w0, w1), t.res_ep, poll);
    r0 = dev::bf16lo(pair);
    r1 = dev::bf16hi(pair);
  } else {
    r0 = t.f32 ? __uint_as_float(w0) : dev::bf16lo(w0);
    r1 = t.f32 ? __uint_as_float(w1) : dev::bf16lo(w1);
  }
}

// Output column of stream row r (task-local) for the plain epilogue.
__device__ __forceinline__ int out_col(const Task& t, int rg, int g) {
  return t.n0 + rg * kRows + g;
}

// ---- input staging ---------------------------------------------------------------------------
// Where the 8 k of vector v of input row b land (natural order).
__device__ __forceinline__ bf16* landing(const Scratch& s, int b, int v) {
  return s.xs + b * s.XS + v * 8;
}

// Copy (or zero) vector v of input row b: k < kc of real rows, zeros elsewhere.
__device__ __forceinline__ void stage_vec(const Task& t, const Scratch& s, int b, int v, int k0,
                                          int vpr) {
  if (v < vpr && b < t.B)
    dev::cp_async_act16(landing(s, b, v), t.x + (long long)b * t.K + k0 + v * 8);
  else
    *reinterpret_cast<uint4*>(landing(s, b, v)) = make_uint4(0u, 0u, 0u, 0u);
}

// Flagged x: the staged rows' vectors polled into place (natural order, zeros as stage_vec),
// kPollVecs a thread in flight (task.py LINEAR_POLL_VECS: what the plan's largest flagged x needs
// for one round, 4 at most): all of a thread's loads issue together, then only the vectors whose
// words do not all carry the epoch yet are loaded again. One vector at a time paid an L2 round
// trip each, and at four a thread (batch 8's 16 KB hidden) lost to plain copies (perf-log,
// fourteenth session).
constexpr int kPollVecs = LINEAR_POLL_VECS;
static_assert(kPollVecs >= 1 && kPollVecs <= 4, "task.py POLL_VECS_MAX");
__device__ __forceinline__ void poll_stage(const Task& t, const Scratch& s, int k0, int vpr,
                                           int vfill) {
  const int total = staged_rows(t) * vfill;
  const dev::Poll poll;
  const dev::flag_word* words = reinterpret_cast<const dev::flag_word*>(t.x);
  for (int base = threadIdx.x; base < total; base += kPollVecs * NUM_THREADS) {
    // Vector j's words and landing (-1: past the staged rows), worked out once, before the
    // loop: no division in a round.
    unsigned src[kPollVecs], pending = 0u;  // bit j: vector j is real and not yet in
    int land[kPollVecs];
#pragma unroll
    for (int j = 0; j < kPollVecs; ++j) {
      const int idx = base + j * NUM_THREADS, r = idx / vfill, c = idx - r * vfill;
      src[j] = (unsigned)(r * (t.K >> 1) + ((k0 + c * 8) >> 1));
      land[j] = idx < total ? r * s.XS + c * 8 : -1;
      if (idx < total && r < t.B && c < vpr) pending |= 1u << j;
    }
    const unsigned real = pending;
    dev::flag_word w[kPollVecs][4] = {};  // a vector never loaded is never stored
    for (;;) {
#pragma unroll
      for (int j = 0; j < kPollVecs; ++j) {
        if ((pending >> j) & 1u) {
          dev::ld_flag2(words + src[j], w[j][0], w[j][1]);
          dev::ld_flag2(words + src[j] + 2, w[j][2], w[j][3]);
        }
      }
#pragma unroll
      for (int j = 0; j < kPollVecs; ++j)
        if (dev::word_epoch(w[j][0]) == t.x_ep && dev::word_epoch(w[j][1]) == t.x_ep &&
            dev::word_epoch(w[j][2]) == t.x_ep && dev::word_epoch(w[j][3]) == t.x_ep)
          pending &= ~(1u << j);
      if (pending == 0u || !poll.again()) break;
    }
#pragma unroll
    for (int j = 0; j < kPollVecs; ++j) {
      if (land[j] < 0) continue;
      *reinterpret_cast<uint4*>(s.xs + land[j]) =
          (real >> j) & 1u ? make_uint4(dev::word_pair(w[j][0]), dev::word_pair(w[j][1]),
                                        dev::word_pair(w[j][2]), dev::word_pair(w[j][3]))
                           : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Copy x[b][k0, k0+kc) of every row into place with cp.async, zeros for k in [kc, kfill) and,
// wide, for rows past B (a thread copies vector v of rows r and r + 8: two coalesced warp
// copies); a flagged x is polled into place instead. Natural order, as the walk reads it. Ends
// with a barrier.
__device__ __forceinline__ void stage_raw(const Task& t, const Scratch& s, int k0, int kc,
                                          int kfill) {
  const int tid = threadIdx.x;
  const int vpr = kc / 8, vfill = kfill / 8, total = pass_rows(t) * vfill;
  if (t.x_ep) {
    poll_stage(t, s, k0, vpr, vfill);
  } else {
    for (int idx = tid; idx < total; idx += NUM_THREADS) {
      const int r = idx / vfill, v = idx - r * vfill;
      stage_vec(t, s, r, v, k0, vpr);
      if (t.wide) stage_vec(t, s, r + kRows, v, k0, vpr);
    }
    dev::cp_async_commit();
    dev::cp_async_wait_all();
  }
  mpk::task_sync();
}

// Sum of squares of the landed (natural-order) rows' first kc elements into red[b][warp] (+= when
// `add`). Every row at once: a thread's vectors of all rows first, then one warp reduction of all
// rows (dev::rows_sum16). (Splitting the rows between the CTA's halves at batch 9-16 cost the
// all-kinds build 28 B more spills: tests/cuda/test_nvcc_build.py.)
__device__ __forceinline__ void sum_squares(const Task& t, const Scratch& s, int kc, bool add) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int vpr = kc / 8;
  float ss[kMaxB];
#pragma unroll
  for (int b = 0; b < kMaxB; ++b) ss[b] = 0.f;
  for (int v = tid; v < vpr; v += NUM_THREADS) {
#pragma unroll
    for (int b = 0; b < kMaxB; ++b) {
      if (b >= t.B) break;
      float f[8];
      dev::unpack8(*reinterpret_cast<const uint4*>(landing(s, b, v)), f);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss[b] = fmaf(f[e], f[e], ss[b]);
    }
  }
  const float sum = dev::rows_sum16(ss);
  const int b = lane >> 1;
  if ((lane & 1) == 0 && b < t.B)
    s.red[b * kWarps + warp] = add ? s.red[b * kWarps + warp] + sum : sum;
}

// Row b's inverse rms from the warps' partial sums (added in warp order: deterministic).
__device__ __forceinline__ float row_inv(const Task& t, const Scratch& s, int b) {
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += s.red[b * kWarps + w];
  return dev::rms_inv(total, t.K, t.eps);
}

// This lane's row's inverse rms (lane b < B: row b; 1 elsewhere, and for plans without the
// prologue), for the epilogue to take by shuffles. Read after the barrier that ends the last
// chunk's sums of squares.
__device__ __forceinline__ float lane_inv(const Task& t, const Scratch& s) {
  const int lane = threadIdx.x & 31;
  return t.rms && lane < t.B ? row_inv(t, s, lane) : 1.f;
}

}  // namespace detail
}  // namespace mpk::kinds::linear

#include "linear/sm90_walk.cuh"  // the MMA walk over a block's weight pages

namespace mpk::kinds::linear {
namespace detail {

// A lane's outputs j = 0..3: batch rows g (j < 2) and g + 8, stream rows 2t + (j & 1).
__device__ __forceinline__ int batch_of(int j, int g) { return (j >> 1) * 8 + g; }
__device__ __forceinline__ int row_of(int j, int tq) { return 2 * tq + (j & 1); }

// Residual words a lane (own blocks) or a thread (shared blocks) will add, loaded before the
// block's MMAs so the L2 round trip overlaps them (load_resid). Unused slots hold 0.
// Own blocks: r[2h], r[2h + 1] are the pair (batch g + 8h, stream rows 2t, 2t + 1).
__device__ __forceinline__ void prefetch_own(const Task& t, int rg, unsigned (&r)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int b = g + 8 * h, n = out_col(t, rg, 2 * tq);
    r[2 * h] = r[2 * h + 1] = 0u;
    if (t.res && b < t.B && n < t.n1) load_resid(t, b, n, r[2 * h], r[2 * h + 1]);
  }
}

// A warp's best keys (a lane's best[2h + e], row g + 8h) into s.best: per block, so none stays
// live across the next block's staging and walk (that spilled). A stale read: one atomic more.
__device__ __forceinline__ void merge_best(const Task& t, const Scratch& s,
                                           const unsigned long long (&best)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // batch row g + 8h: its keys are on the lanes t = 0..3 of g
    unsigned long long key = best[2 * h] > best[2 * h + 1] ? best[2 * h] : best[2 * h + 1];
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      const unsigned long long o = __shfl_xor_sync(0xffffffffu, key, off);
      if (o > key) key = o;
    }
    const int b = g + 8 * h;  // an atomic only for a key above the best so far (lm_head: 18 blocks)
    if (tq == 0 && b < t.B && key > *(volatile unsigned long long*)(s.best + b))
      atomicMax(s.best + b, key);
  }
}

// A block of 8 row groups: this warp owns row group `rg` (task-local); write or accumulate.
// A lane's outputs j are (batch g + 8h, stream row 2t + e) for j = 2h + e: two pairs. inv:
// lane_inv (rows' inverse rms on lanes 0-15).
__device__ __forceinline__ void finish_own(const Task& t, const Scratch& s, int rg,
                                           const float (&r)[4], const unsigned (&resid)[4],
                                           int ch, float inv) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  float v[4] = {r[0], r[1], r[2], r[3]};
  if (t.nch > 1) {  // this warp alone owns these accumulator rows
    const bool last = ch == t.nch - 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int b = batch_of(j, g);
      float* slot = s.acc + (rg * kRows + row_of(j, tq)) * t.B + min(b, t.B - 1);
      if (ch > 0 && b < t.B) v[j] += *slot;
      if (!last && b < t.B) *slot = v[j];
    }
    if (!last) return;  // uniform
  }
  if (t.rms) {  // uniform: the sums of rows g and g + 8 times their inverse rms
    const float lo = __shfl_sync(0xffffffffu, inv, g), hi = __shfl_sync(0xffffffffu, inv, g + 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] *= j < 2 ? lo : hi;
  }
  if (t.silu) {  // stream rows r < 4 are gate, r + 4 up (lane t + 2): lanes t < 2 write pairs
    float up[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) up[j] = __shfl_xor_sync(0xffffffffu, v[j], 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int b = g + 8 * h, n = t.n0 + rg * 4 + 2 * tq;
      if (tq < 2 && b < t.B && n < t.n1)
        store_out(t, b, n, silu_value(v[2 * h], up[2 * h]),
                  silu_value(v[2 * h + 1], up[2 * h + 1]));
    }
    return;
  }
  unsigned long long best[4] = {0ull, 0ull, 0ull, 0ull};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int b = g + 8 * h, n = out_col(t, rg, 2 * tq);
    if (b >= t.B || n >= t.n1) continue;
    float r0 = 0.f, r1 = 0.f;
    if (t.res) resid_values(t, b, n, resid[2 * h], resid[2 * h + 1], r0, r1);
    const float y0 = plain_value(t, v[2 * h], r0), y1 = plain_value(t, v[2 * h + 1], r1);
    store_out(t, b, n, y0, y1);
    if (t.argmax) {
      const unsigned long long k0 = rank_key(s, b, y0, n);
      const unsigned long long k1 = n + 1 < t.n1 ? rank_key(s, b, y1, n + 1) : 0ull;
      if (k0 > best[2 * h]) best[2 * h] = k0;
      if (k1 > best[2 * h + 1]) best[2 * h + 1] = k1;
    }
  }
  if (t.argmax) merge_best(t, s, best);
}

// Output pairs of a shared block, one per thread: idx = tid over (row-group-local pair p, batch
// b): rows 2p, 2p + 1 (plain: nb * 4 * B pairs; silu_mul: its 4 gate rows, nb * 2 * B).
__device__ __forceinline__ int shared_pairs(const Task& t, int nb) {
  return nb * (t.silu ? 2 : kRows / 2) * t.B;
}
static_assert(4 * (kRows / 2) * kMaxB <= NUM_THREADS,
              "a shared block (nb <= 4) has a pair a thread");

__device__ __forceinline__ void shared_pair(const Task& t, int idx, int& row, int& b) {
  b = idx % t.B, row = 2 * (idx / t.B);  // row-group-local row (even) and batch of a pair
}

__device__ __forceinline__ void prefetch_shared(const Task& t, int rg0, int nb,
                                                unsigned (&r)[2]) {
  r[0] = r[1] = 0u;
  if (!t.res || t.silu || (int)threadIdx.x >= shared_pairs(t, nb)) return;
  int row, b;
  shared_pair(t, threadIdx.x, row, b);
  const int n = out_col(t, rg0 + row / kRows, row % kRows);
  if (n < t.n1) load_resid(t, b, n, r[0], r[1]);
}

// Sum of the block's partials for (row group rgl of the block, row g, batch b), in warp order:
// the warps that met row group rgl are those w with (w - u0) mod nb == rgl (nb a power of two).
// Unrolled: the loads issue together (a loop paid a shared-memory round trip per warp).
__device__ __forceinline__ float reduce_part(const Scratch& s, int buf, int u0, int nb, int rgl,
                                             int g, int b) {
  const float* part = s.part + buf * kWarps * kPartWarp + g * kPartRow + b;
  const int first = (u0 + rgl) & (nb - 1);
  float v[kWarps];
#pragma unroll
  for (int j = 0; j < kWarps; ++j) {
    const int w = first + j * nb;
    v[j] = w < kWarps ? part[w * kPartWarp] : 0.f;
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kWarps; ++j) sum = first + j * nb < kWarps ? sum + v[j] : sum;
  return sum;
}

// A block of nb < 8 row groups: the warps' partial sums meet in part[buf], the CTA finishes them.
// inv: lane_inv (rows' inverse rms on lanes 0-15).
__device__ __forceinline__ void finish_shared(const Task& t, const Scratch& s, int rg0, int u0,
                                              int nb, const float (&part)[4], int buf,
                                              const unsigned (&resid)[2], int ch, float inv) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
  float* mine = s.part + (buf * kWarps + warp) * kPartWarp;
#pragma unroll
  for (int j = 0; j < 4; ++j) mine[row_of(j, tq) * kPartRow + batch_of(j, g)] = part[j];
  // This thread's pair, worked out before the barrier: its division by B (and the old division
  // by the rows of a row group) sat between the barrier and the sums (ncu, eighteenth session).
  int row, b;
  shared_pair(t, tid, row, b);
  const int rg_shift = t.silu ? 2 : 3;  // a row group's rows: 4 (silu: gate rows) or kRows
  const int rgl = row >> rg_shift, r = row & ((1 << rg_shift) - 1), rg = rg0 + rgl;
  const float inv_b = t.rms ? __shfl_sync(0xffffffffu, inv, b) : 1.f;  // every lane, b < 16
  mpk::task_sync();
  if (tid >= shared_pairs(t, nb)) return;
  float v[2], up[2] = {0.f, 0.f};
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    v[e] = reduce_part(s, buf, u0, nb, rgl, r + e, b);
    if (t.silu) up[e] = reduce_part(s, buf, u0, nb, rgl, r + 4 + e, b);
  }
  if (t.nch > 1) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float* slot = s.acc + (rg * kRows + r + e) * t.B + b;
      float* slot_up = slot + 4 * t.B;
      if (ch > 0) {
        v[e] += *slot;
        if (t.silu) up[e] += *slot_up;
      }
      if (ch < t.nch - 1) {
        *slot = v[e];
        if (t.silu) *slot_up = up[e];
      }
    }
    if (ch < t.nch - 1) return;
  }
  if (t.rms) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      v[e] *= inv_b;
      up[e] *= inv_b;
    }
  }
  if (t.silu) {
    const int n = t.n0 + rg * 4 + r;
    if (n < t.n1) store_out(t, b, n, silu_value(v[0], up[0]), silu_value(v[1], up[1]));
    return;
  }
  const int n = out_col(t, rg, r);
  if (n >= t.n1) return;
  float r0 = 0.f, r1 = 0.f;
  if (t.res) resid_values(t, b, n, resid[0], resid[1], r0, r1);
  const float y0 = plain_value(t, v[0], r0), y1 = plain_value(t, v[1], r1);
  store_out(t, b, n, y0, y1);
  if (t.argmax) {
    atomicMax(s.best + b, rank_key(s, b, y0, n));
    if (n + 1 < t.n1) atomicMax(s.best + b, rank_key(s, b, y1, n + 1));
  }
}

// ---- the task -----------------------------------------------------------------------------------
__device__ __forceinline__ Task task_of(const mpk::TaskArgs& a) {
  Task t;
  t.B = a.i(P_BATCH);
  t.wide = LINEAR_MAX_BATCH > kRows && t.B > kRows;  // folded away where no op has > 8 rows
  t.K = a.i(P_K);
  t.N = a.i(P_N);
  t.T = a.i(P_TASKS);
  t.xc = a.i(P_XC);
  t.nch = (t.K + t.xc - 1) / t.xc;
  t.silu = a.i(P_SILU) != 0;
  t.rms = a.i(P_RMS) != 0;
  t.res = a.i(P_HAS_RESIDUAL) != 0;
  t.f32 = a.i(P_OUT_F32) != 0;
  t.argmax = a.i(P_ARGMAX) != 0;
  t.sampling = a.i(P_SAMPLING) != 0 && a.has(O_SAMPLING) && a.has(O_POSITIONS);
  t.samp = a.operand<const int>(O_SAMPLING);
  t.pos = a.operand<const int>(O_POSITIONS);
  t.runs = a.operand<const int>(O_RUNS);
  t.step = a.step;
  t.eps = a.f(P_EPS);
  t.align = t.silu ? kRows / 2 : kRows;
  dev::split_bounds(t.N, t.T, t.align, a.point(0), t.n0, t.n1);
  t.rgs = (t.n1 - t.n0 + t.align - 1) >> (t.silu ? 2 : 3);  // / align
  t.x = a.operand<const bf16>(O_X);
  // Whole-tensor pointers: the kernel indexes outputs by their global column.
  t.out = reinterpret_cast<void*>(a.base[O_OUT]);
  t.resid = t.res ? reinterpret_cast<const void*>(a.base[O_RESIDUAL]) : nullptr;
  t.pval = a.operand<float>(O_PART_VAL);
  t.pidx = a.operand<int>(O_PART_IDX);
  t.x_ep = dev::flag_epoch<FLAGGED>(a, O_X);
  t.res_ep = dev::flag_epoch<FLAGGED>(a, O_RESIDUAL);
  t.out_ep = dev::flag_epoch<FLAGGED>(a, O_OUT);
  return t;
}

// The input of chunk ch staged in xs and, with the rmsnorm prologue, its rows' sums of squares
// added up in red (whole after the last chunk, which ends with a barrier so lane_inv can read
// them; the walk reads only xs, which stage_raw's barrier completed).
__device__ __forceinline__ void stage_chunk(const Task& t, const Scratch& s, int ch) {
  const int k0 = ch * t.xc, kc = min(t.xc, t.K - k0);
  const int kfill = (kc + kUnitK - 1) / kUnitK * kUnitK;
  stage_raw(t, s, k0, kc, kfill);
  if (!t.rms) return;
  sum_squares(t, s, kc, ch > 0);
  if (ch == t.nch - 1) mpk::task_sync();
}

__device__ __forceinline__ void write_argmax(const Task& t, const Scratch& s) {
  mpk::task_sync();
  const int tid = threadIdx.x;
  if (tid < t.B) {
    const unsigned long long key = s.best[tid];
    t.pval[(long long)tid * t.T] = dev::key_value(key);
    t.pidx[(long long)tid * t.T] = dev::key_index(key);
  }
}

// The rows' argmax keys and sampling words into the scratch's head.
__device__ __forceinline__ void init_rows(const Task& t, const Scratch& s) {
  const int tid = threadIdx.x;
  if (tid >= kMaxB) return;
  s.best[tid] = 0ull;
  s.temp[tid] = 0.f;  // greedy unless the row's sampling words say otherwise
  if (t.sampling && tid < t.B) {  // host-written IO: L2-coherent loads
    const int* words = t.samp + tid * SAMPLING_WORDS;
    s.temp[tid] = __int_as_float(dev::ld_act_i32(words + SAMPLING_TEMPERATURE));
    s.seed[tid] = dev::sampling_seed(words);
    s.spos[tid] = dev::row_position(dev::ld_act_i32(t.pos + tid),
                                    t.runs ? t.runs + tid * RUN_WORDS : nullptr, t.step);
  }
}

// The task as run() starts it: worked out here, or (kPre) read back from the prologue's copy.
__device__ __forceinline__ Task task_at_run(const mpk::TaskArgs& a) {
  if constexpr (kPre) {
    return *reinterpret_cast<const Task*>(a.smem);
  } else {
    return task_of(a);
  }
}

}  // namespace detail

// Before the waits, in plans with a wide linear (kPre; task.py prologue_operands: sampling,
// positions, runs, host-written IO): the task's parameters (task_of) go to the scratch's head
// and the rows' argmax and sampling slots are set, so run() starts at its input once the waits
// are met. At batch 16 this takes 0.7-1.1% off qwen3-0.6b's step (perf-log, twenty-ninth
// session); at batch 1 and 8 the same prologue cost 1.6% and 3.1% (its barrier and the Task's
// round trip on the path: twenty-eighth session), so narrower plans work the task out in run().
MPK_TASK_ENTRY void prologue(const mpk::TaskArgs& a) {
  using namespace detail;
  if constexpr (kPre) {
    const Task t = task_of(a);
    if (threadIdx.x == 0) *reinterpret_cast<Task*>(a.smem) = t;
    if (t.rgs > 0) init_rows(t, carve(t, a.smem));
    mpk::task_sync();
  }
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  const Task t = task_at_run(a);
  mpk::PageCursor pc = a.pages;
  if (t.rgs <= 0) {  // uniform (no outputs: no pages either)
    pc.finish();
    return;
  }
  const Scratch s = carve(t, a.smem);
  const int warp = threadIdx.x >> 5;
  // Narrower plans set the rows' slots here, after the page cursor and the carve, as before the
  // prologue existed. Set inside task_at_run instead (right after task_of), the prefill plan's
  // out-of-line lm_head read a sampling word at address 0x4 on the H100 (compute-sanitizer,
  // thirtieth session); the two orders are the same C++, the cause was not found.
  if constexpr (!kPre) init_rows(t, s);
  int u0 = 0, buf = 0;
  float inv = 1.f;
  for (int ch = 0; ch < t.nch; ++ch) {
    stage_chunk(t, s, ch);
    if (ch == t.nch - 1) inv = lane_inv(t, s);
    if (ch == 0) a.mark(0);  // profiling: the input is in
    const int kc = min(t.xc, t.K - ch * t.xc);
    const int nk = (kc + kUnitK - 1) / kUnitK;
    int rg0 = 0;
#pragma unroll 1
    for (int nb = 8; nb >= 1; nb >>= 1) {
#pragma unroll 1
      for (; t.rgs - rg0 >= nb; rg0 += nb, u0 += nb * nk) {
        float r[4];
        if (nb == kWarps) {
          const int rg = rg0 + ((warp - u0) & (kWarps - 1));
          unsigned resid[4];
          prefetch_own(t, rg, resid);
          walk(t, s, pc, u0, nb, nk, r);
          a.mark(1);  // profiling: warp 0's walk of this block is done (the last block's stays)
          finish_own(t, s, rg, r, resid, ch, inv);
        } else {
          unsigned resid[2];
          prefetch_shared(t, rg0, nb, resid);
          walk(t, s, pc, u0, nb, nk, r);
          a.mark(1);
          finish_shared(t, s, rg0, u0, nb, r, buf, resid, ch, inv);
          buf ^= 1;
        }
      }
    }
    // xs and acc are rewritten by the next chunk (after the last one the runtime's barrier ends
    // the task: a second one here only made every warp wait twice).
    if (ch + 1 < t.nch) mpk::task_sync();
  }
  pc.finish();
  if (t.argmax) write_argmax(t, s);
}

}  // namespace mpk::kinds::linear
