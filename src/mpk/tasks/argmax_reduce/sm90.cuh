// argmax_reduce, sm_90a: one task per row (grid (B,)); the operand pointers are at the row.
//
// Greedy and plain-temperature rows: token = part_idx[argmax_t part_val[t]] (first maximum; NaN
// wins as in torch.argmax), found by warp 0.
// A row whose SAMPLING words ask for top-k or top-p (with the logits operand) ignores the
// partials and draws from its logits (tasks/sampling.py defines the same token):
//   1. top = the largest ordered key;
//   2. top-k: lo = the k-th largest key (radix selection: 4 passes of 8 bits, bin counts);
//   3. top-p: Z = the integer mass (floor(exp(l / T - top / T) * 2^32)) of the keys >= lo, then
//      lo = the largest key whose keys >= it hold floor(Z * P / 2^24) of it (radix selection on
//      bin masses);
//   4. the token: the Gumbel-max of l / T over the keys >= lo (lm_head's noise, lowest index on
//      ties).
// Bins hold 64-bit integers (counts, masses): atomics in any order give the same sums, so the
// draw is deterministic. The row's logits are read ~11 times (from L2: lm_head wrote them this
// step); only filtering rows pay that.
#pragma once
#include <stdint.h>

#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/runs.cuh"
#include "../common/sampling.cuh"

namespace mpk::kinds::argmax_reduce {
namespace detail {

constexpr int kWarps = NUM_THREADS / 32;
constexpr int kBins = 256;

struct Scratch {
  unsigned long long* hist;  // [kBins]
  unsigned long long* warp;  // [kWarps] per-warp partial reductions
  unsigned long long* pick;  // [2]: the selected bin, the weight above it
};

__device__ __forceinline__ Scratch carve(char* smem) {
  Scratch s;
  s.hist = reinterpret_cast<unsigned long long*>(smem);
  s.warp = s.hist + kBins;
  s.pick = s.warp + kWarps;
  return s;
}

// A filtering row: its logits and sampling parameters.
struct Filter {
  const float* logits;
  int V, top_k;
  unsigned int p_fixed;  // P = floor(top_p * 2^24); 0 = no nucleus
  float T, m;            // temperature; m = top / T
  unsigned long long seed;
  long long pos;
};

__device__ __forceinline__ float logit(const Filter& f, int i) {
  return dev::ld_act_f32(f.logits + i);
}

// floor(exp(l / T - m) * 2^32): the rounding steps of tasks/sampling.py masses() (exact scaling
// by a power of two; conversion truncates).
__device__ __forceinline__ unsigned long long mass(const Filter& f, float l) {
  const float e = expf(__fsub_rn(__fdiv_rn(l, f.T), f.m));
  return (unsigned long long)(e * 4294967296.0f);
}

// ---- block reductions over the task's NUM_THREADS (consumer barrier) ---------------------------
__device__ __forceinline__ unsigned long long block_sum(const Scratch& s, unsigned long long v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) s.warp[threadIdx.x >> 5] = v;
  mpk::task_sync();
  unsigned long long total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += s.warp[w];
  mpk::task_sync();  // s.warp is rewritten by the next reduction
  return total;
}

__device__ __forceinline__ unsigned long long block_max(const Scratch& s, unsigned long long v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long o = __shfl_xor_sync(0xffffffffu, v, off);
    if (o > v) v = o;
  }
  if ((threadIdx.x & 31) == 0) s.warp[threadIdx.x >> 5] = v;
  mpk::task_sync();
  unsigned long long best = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) best = s.warp[w] > best ? s.warp[w] : best;
  mpk::task_sync();
  return best;
}

// ---- radix selection -------------------------------------------------------------------------
// Warp 0: the bin (scanning from 255 down) where the weight of the keys above, `above` plus
// the bins passed, first reaches `want`; writes the bin and the weight of the bins above it.
__device__ __forceinline__ void pick_bin(const Scratch& s, unsigned long long above,
                                         unsigned long long want) {
  const int lane = threadIdx.x & 31;
  unsigned long long own = 0;  // lane l holds bins 255 - 8l .. 248 - 8l
#pragma unroll
  for (int j = 0; j < 8; ++j) own += s.hist[255 - 8 * lane - j];
  unsigned long long incl = own;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long o = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += o;
  }
  const unsigned long long excl = incl - own;
  const unsigned long long total = __shfl_sync(0xffffffffu, incl, 31);
  const bool mine = above + excl < want && want <= above + incl;
  if (__ballot_sync(0xffffffffu, mine) == 0u) {  // want exceeds the total (not reached):
    if (lane == 0) {                             // keep everything left
      s.pick[0] = 0;
      s.pick[1] = above + total - s.hist[0];
    }
    return;
  }
  if (mine) {
    unsigned long long acc = above + excl;
    int bin = 255 - 8 * lane - 7;
    for (int j = 0; j < 8; ++j) {
      const unsigned long long h = s.hist[255 - 8 * lane - j];
      if (acc + h >= want) {
        bin = 255 - 8 * lane - j;
        break;
      }
      acc += h;
    }
    s.pick[0] = (unsigned long long)bin;
    s.pick[1] = acc;
  }
}

// The largest key v among keys >= floor such that the keys in [v, top] weigh >= want (weight 1
// per token, or its mass).
template <bool kMass>
__device__ unsigned int radix_select(const Filter& f, const Scratch& s, unsigned int floor,
                                     unsigned long long want) {
  unsigned int prefix = 0u, mask = 0u;
  unsigned long long above = 0;
#pragma unroll 1
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kBins; b += NUM_THREADS) s.hist[b] = 0ull;
    mpk::task_sync();
    for (int i = threadIdx.x; i < f.V; i += NUM_THREADS) {
      const float l = logit(f, i);
      const unsigned int k = dev::ordered_key(l);
      if (k >= floor && (k & mask) == prefix)
        atomicAdd(s.hist + ((k >> shift) & 255u), kMass ? mass(f, l) : 1ull);
    }
    mpk::task_sync();
    if (threadIdx.x < 32) pick_bin(s, above, want);
    mpk::task_sync();
    prefix |= (unsigned int)s.pick[0] << shift;
    mask |= 255u << shift;
    above = s.pick[1];
    mpk::task_sync();  // every thread has read pick before warp 0 rewrites it
  }
  return prefix;
}

// floor(Z * P / 2^24) without overflow (Z < 2^52), at least 1.
__device__ __forceinline__ unsigned long long nucleus_target(unsigned long long z,
                                                             unsigned int p) {
  const unsigned long long t = (z >> 24) * p + (((z & 0xffffffull) * p) >> 24);
  return t > 0 ? t : 1ull;
}

__device__ int draw_filtered(Filter& f, const Scratch& s) {
  unsigned long long top = 0;
  for (int i = threadIdx.x; i < f.V; i += NUM_THREADS) {
    const unsigned long long k = dev::ordered_key(logit(f, i));
    top = k > top ? k : top;
  }
  top = block_max(s, top);
  f.m = __fdiv_rn(dev::ordered_value((unsigned int)top), f.T);
  unsigned int lo = 0u;
  if (f.top_k > 0 && f.top_k < f.V) lo = radix_select<false>(f, s, 0u, (unsigned)f.top_k);
  if (f.p_fixed != 0u) {
    unsigned long long z = 0;
    for (int i = threadIdx.x; i < f.V; i += NUM_THREADS) {
      const float l = logit(f, i);
      if (dev::ordered_key(l) >= lo) z += mass(f, l);
    }
    z = block_sum(s, z);
    // z = 0 only when top / T is not finite (NaN or infinite logits, l / T overflowing at a
    // tiny T): no mass to measure, the top-k set stays (pick_bin's fallback would keep every
    // key, top-k's rejects included).
    if (z != 0ull) lo = radix_select<true>(f, s, lo, nucleus_target(z, f.p_fixed));
  }
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < f.V; i += NUM_THREADS) {
    const float l = logit(f, i);
    if (dev::ordered_key(l) < lo) continue;
    const float y = __fadd_rn(__fdiv_rn(l, f.T), dev::gumbel(f.seed, f.pos, i));
    const unsigned long long key = dev::argmax_key(y, i);
    best = key > best ? key : best;
  }
  best = block_max(s, best);
  return best != 0ull ? dev::key_index(best) : 0;
}

// Whether this row filters (temperature > 0 and top-k or top-p), with its parameters.
__device__ __forceinline__ bool filter_of(const mpk::TaskArgs& a, int V, Filter& f) {
  const int* words = a.operand<const int>(O_SAMPLING);
  f.T = __int_as_float(dev::ld_act_i32(words + SAMPLING_TEMPERATURE));
  f.top_k = dev::ld_act_i32(words + SAMPLING_TOP_K);
  const int p = dev::ld_act_i32(words + SAMPLING_TOP_P);
  f.p_fixed = p > 0 && p < SAMPLING_P_ONE ? (unsigned int)p : 0u;
  if (!(f.T > 0.f) || (f.top_k <= 0 && f.p_fixed == 0u)) return false;
  f.logits = a.operand<const float>(O_LOGITS);
  f.V = V;
  f.seed = dev::sampling_seed(words);
  f.pos = dev::row_position(dev::ld_act_i32(a.operand<const int>(O_POSITIONS)),
                            a.operand<const int>(O_RUNS), a.step);
  return true;
}

// Warp 0: the partials' winner (every lane returns it).
__device__ __forceinline__ int partial_winner(const mpk::TaskArgs& a, int T) {
  const float* pval = a.operand<const float>(O_PART_VAL);
  const int* pidx = a.operand<const int>(O_PART_IDX);
  const int lane = threadIdx.x & 31;
  float best = -__int_as_float(0x7f800000);
  int bt = 0x7fffffff;
  for (int t = lane; t < T; t += 32) {
    const float v = dev::ld_act_f32(pval + t);
    if (dev::argmax_better(v, t, best, bt)) {
      best = v;
      bt = t;
    }
  }
  dev::warp_argmax(best, bt);
  return bt < T ? dev::ld_act_i32(pidx + bt) : 0;
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  const int B = a.i(P_BATCH), T = a.i(P_NUM_TILES), steps = a.i(P_OUT_STEPS), V = a.i(P_VOCAB);
  Filter f;
  int tok;
  if (V > 0 && filter_of(a, V, f)) {  // the same words for every thread: a uniform branch
    tok = draw_filtered(f, carve(a.smem));
  } else {
    if (threadIdx.x >= 32) return;
    tok = partial_winner(a, T);
  }
  if (threadIdx.x == 0) {
    *a.operand<int>(O_TOKENS) = tok;
    int* tokens_out = a.operand<int>(O_TOKENS_OUT);
    if (tokens_out != nullptr && a.step < steps) tokens_out[(long long)a.step * B] = tok;
  }
}

}  // namespace mpk::kinds::argmax_reduce
