// moe_gate_up, sm_90a: for slot u (the u-th smallest distinct chosen expert) and range t of the
// expert width, out[b, j, n] = silu_mul(bf16(x[b] . gate[e, n]), bf16(x[b] . up[e, n])) for every
// (b, j) that chose e (semantics in task.py).
//
// Layouts: x [B, H], expert_ids [B, K], weight [E, 2, I, H] are whole (operand = tensor start);
// out [B, K, I] is addressed from its base: pair i = b*K + j, element n at out + i*I + n.
// Flagged out (batch 1 only, task.py flag_operands; common/flags.cuh): word (i*I + n) / 2 holds
// columns n, n + 1 (n even) of pair i and its epoch. The range's outputs of the slot's pairs
// (one, unless the row names the expert twice) are gathered in ys and stored as whole words once
// every warp is done (after all of the task's reads: compiler/flags.py's contract), so moe_down
// polls them instead of waiting on a counter.
// Shared scratch (task.py scratch_bytes): [bits: 16 u32][ids: B*K i32] [pairs: B*K i32][npairs]
// [xrow: kMaxPairs i32] ... at HEADER_BYTES: [xs: up to min(B, kMaxPairs) rows of x, H bf16]
// [ys (flagged out): the range's outputs of up to K pairs, bf16, at a 16-byte boundary].
//
// 0. At batch <= kMaxPairs every x row is staged (cp.async, L2) before anything else, in place:
//    its round trip runs under the ids' (a pair finds its row in xrow).
// 1. The ids (an activation: L2 loads; at batch 1 flagged words, polled: moe_router) go to
//    shared memory and set one bit per valid expert in a 512-bit map; every thread finds the
//    slot's expert (the u-th set bit) itself. A slot past the number of distinct experts has no
//    pairs and does nothing more.
// 2. Warp 0 lists the pairs i = b*K + j with ids[i] == expert (a ballot per 32 ids).
// 3. Pairs in groups of up to kMaxPairs: the group's x rows are staged (larger batches), then
//    warp w takes rows n = lo + w, lo + w + 8, ... of the range: each lane keeps kV 16-byte
//    vectors of the gate row and kV of the up row in flight (weights, read-only path; their
//    address depends on the router's ids, so there is no stream: issue 12), and accumulates one
//    fp32 dot per pair and matrix. Lane p stores pair p's output. Only when more than kMaxPairs
//    rows chose the expert is there a second group, which reads its rows again (from L2).
// Register use stays small (inlined into the all-kinds dispatch switch): 2 kV vectors and
// 2 kMaxPairs sums, every array indexed by compile-time constants, outer loops not unrolled.
// kV, kMaxPairs (and moe_down's kJ, kV, moe_router's kLoads) were picked among tunings of equal
// bytes in flight by the all-kinds build's spills (tests/cuda/test_nvcc_build.py says why).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/flags.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/split.cuh"

namespace mpk::kinds::moe_gate_up {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kV = 4;         // vectors of each of the gate and up rows in flight per lane
constexpr int kMaxPairs = 8;  // pairs (x rows) per pass over the expert's rows
constexpr int kAlign = 8;     // task.py ALIGN
constexpr int kHeader = 2048; // task.py HEADER_BYTES

// Rows n = lo + warp, +kWarps, ... < hi of expert `expert`, for the ng staged pairs: ng == kNp
// for kNp <= 2, else kNp / 2 < ng <= kNp. The pair loops' bound is a constant, so at kNp 1 and 2
// they have no branch at all: a bound known only at run time made every pair of every vector a
// convergence region (at batch 1, where each expert has exactly one pair, the expert gate_up
// phase took 25.3 us a layer against 16.9 with the bound fixed: perf-log, thirteenth session).
template <int kNp>
__device__ __forceinline__ void rows(const bf16* wgate, long long up_off, unsigned xs, int H,
                                     int I, int lo, int hi, int ng, const int* pairs,
                                     const int* xrow, bf16* out, bf16* ys) {
  static_assert(kNp >= 1 && kNp <= kMaxPairs, "pairs per pass");
  const int lane = threadIdx.x & 31, vpr = H / 8;
  unsigned xo[kNp];  // byte offset of pair p's staged x row
#pragma unroll
  for (int p = 0; p < kNp; ++p) xo[p] = (unsigned)((kNp <= 2 || p < ng ? xrow[p] : 0) * H) * 2u;
#pragma unroll 1
  for (int n = lo + (threadIdx.x >> 5); n < hi; n += kWarps) {
    const bf16* wg = wgate + (long long)n * H;
    float ag[kNp], au[kNp];
#pragma unroll
    for (int p = 0; p < kNp; ++p) ag[p] = au[p] = 0.f;
#pragma unroll 1
    for (int c = 0; c < vpr; c += 32 * kV) {
      uint4 g[kV], u[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const int v = c + 32 * i + lane;
        const bool ok = v < vpr;
        g[i] = ok ? dev::ld_weight_v4(wg + v * 8) : make_uint4(0u, 0u, 0u, 0u);
        u[i] = ok ? dev::ld_weight_v4(wg + up_off + v * 8) : make_uint4(0u, 0u, 0u, 0u);
      }
      // Branch-free: past the row (zero weights) or past the pairs, x is a zero vector, whose
      // products add +0 (the sums of pairs past ng are never stored).
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const int v = c + 32 * i + lane;
        float fg[8], fu[8];
        dev::unpack8(g[i], fg);
        dev::unpack8(u[i], fu);
#pragma unroll
        for (int p = 0; p < kNp; ++p) {
          const bool use = v < vpr && (kNp <= 2 || p < ng);
          float fx[8];
          dev::unpack8(use ? dev::lds_v4(xs + xo[p] + (unsigned)(v * 8) * 2u)
                           : make_uint4(0u, 0u, 0u, 0u), fx);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            ag[p] = fmaf(fx[e], fg[e], ag[p]);
            au[p] = fmaf(fx[e], fu[e], au[p]);
          }
        }
      }
    }
#pragma unroll
    for (int p = 0; p < kNp; ++p) {
      if (kNp <= 2 || p < ng) {  // ng is warp-uniform: the shuffles see every lane
        const float gs = dev::warp_sum(ag[p]), us = dev::warp_sum(au[p]);
        if (lane == p) {
          const bf16 y = dev::to_bf16(dev::silu_mul_f32(dev::round_bf16(gs), dev::round_bf16(us)));
          if (ys == nullptr) out[(long long)pairs[p] * I + n] = y;
          else ys[p * (hi - lo) + (n - lo)] = y;  // flagged (batch 1): the group's part of ys
        }
      }
    }
  }
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  const int B = a.i(P_BATCH), H = a.i(P_HIDDEN), I = a.i(P_INTER), K = a.i(P_TOP_K);
  const int E = a.i(P_NUM_EXPERTS), T = a.i(P_TILES), slot = a.point(0), tile = a.point(1);
  const int* gids = a.operand<const int>(O_EXPERT_IDS);
  const bf16* x = a.operand<const bf16>(O_X);
  const bf16* weight = a.operand<const bf16>(O_WEIGHT);
  bf16* out = reinterpret_cast<bf16*>(a.base[O_OUT]);
  const uint32_t out_ep = dev::flag_epoch<FLAGGED>(a, O_OUT);
  const uint32_t ids_ep = dev::flag_epoch<FLAGGED>(a, O_EXPERT_IDS);  // batch 1 (task.py)
  const dev::flag_word* id_words = dev::flag_operand<const dev::flag_word, 1>(a, O_EXPERT_IDS);
  // Nothing below reads `a`: its slot pointer is one of the values the all-kinds build keeps in
  // local memory, and every late read of it is a reload (ptxas spill loads).
  const int BK = B * K, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned* bits = reinterpret_cast<unsigned*>(a.smem);
  int* ids = reinterpret_cast<int*>(a.smem + 64);
  int* pairs = ids + BK;
  int* npairs = pairs + BK;
  int* xrow = npairs + 1;  // staged x row of each pair of the group
  bf16* xs = reinterpret_cast<bf16*>(a.smem + kHeader);
  bf16* ys = out_ep == 0u ? nullptr
                          : reinterpret_cast<bf16*>(a.smem + kHeader +
                                                    ((2 * min(B, kMaxPairs) * H + 15) & ~15));
  const int vpr = H / 8;
  // At most kMaxPairs rows: every row's x is staged first, in place b, so its L2 round trip
  // runs under the ids' (a pair reads row b = i / K; an expert has at most one pair a row).
  // More rows: each group of pairs stages its own rows, once the pairs are known.
  const bool direct = B <= kMaxPairs;
  if (direct) {
    for (int idx = tid; idx < B * vpr; idx += NUM_THREADS)
      dev::cp_async_act16(xs + idx * 8, x + (long long)idx * 8);  // row idx / vpr, in place
    dev::cp_async_commit();
  }

  // 1. the expert map and this slot's expert (the first id's load issued before the barrier)
  const int first_id = tid < BK ? dev::ld_i32_maybe_flagged(gids, id_words, ids_ep, tid) : -1;
  if (tid < 16) bits[tid] = 0u;
  mpk::task_sync();
  for (int i = tid; i < BK; i += NUM_THREADS) {
    const int e = i == tid ? first_id : dev::ld_i32_maybe_flagged(gids, id_words, ids_ep, i);
    ids[i] = e;
    if (0 <= e && e < E) atomicOr(bits + (e >> 5), 1u << (e & 31));  // others: ignored
  }
  mpk::task_sync();
  int expert = -1;
  {
    int left = slot;
#pragma unroll 1
    for (int w = 0; w < (E + 31) / 32; ++w) {
      unsigned m = bits[w];
      const int c = __popc(m);
      if (left < c) {
        for (; left > 0; --left) m &= m - 1u;  // drop the lowest set bits before ours
        expert = w * 32 + __ffs(m) - 1;
        break;
      }
      left -= c;
    }
  }

  // 2. the pairs that chose it (none for an unused slot: expert -1; no early return, which
  // costs a spill reload at the runtime's join in the all-kinds build)
  if (warp == 0) {
    int n = 0;
#pragma unroll 1
    for (int i0 = 0; i0 < BK; i0 += 32) {
      const int i = i0 + lane;
      const bool hit = expert >= 0 && i < BK && ids[i] == expert;
      const unsigned m = __ballot_sync(0xffffffffu, hit);
      if (hit) pairs[n + __popc(m & ((1u << lane) - 1u))] = i;
      n += __popc(m);
    }
    if (lane == 0) *npairs = n;
  }
  mpk::task_sync();
  const int np = *npairs;

  // 3. groups of pairs: stage their x rows, then the range's rows of the expert
  int lo, hi;
  dev::split_bounds(I, T, kAlign, tile, lo, hi);
  const bf16* wgate = weight + (long long)expert * 2 * I * H;
  const int group = min(B, kMaxPairs);
#pragma unroll 1
  for (int g0 = 0; g0 < np; g0 += group) {
    const int ng = min(group, np - g0);
    if (g0 > 0) mpk::task_sync();  // every warp is done with the previous group's rows
    if (!direct) {
      for (int idx = tid; idx < ng * vpr; idx += NUM_THREADS) {
        const int p = idx / vpr, v = idx - p * vpr;
        const int b = pairs[g0 + p] / K;
        dev::cp_async_act16(xs + p * H + v * 8, x + (long long)b * H + v * 8);
      }
    }
    if (tid < ng) xrow[tid] = direct ? pairs[g0 + tid] / K : tid;
    dev::cp_async_wait_all();
    mpk::task_sync();
    const unsigned xa = dev::smem_addr(xs);
    const long long up_off = (long long)I * H;
    // rows() numbers the group's pairs from 0: its outputs go after the earlier groups' (at
    // batch 1 a group is one pair, so a repeated expert's second pair is a second group)
    bf16* ysg = ys == nullptr ? nullptr : ys + g0 * (hi - lo);
    if (ng == 1)
      rows<1>(wgate, up_off, xa, H, I, lo, hi, ng, pairs + g0, xrow, out, ysg);
    else if (ng == 2)
      rows<2>(wgate, up_off, xa, H, I, lo, hi, ng, pairs + g0, xrow, out, ysg);
    else if (ng <= 4)
      rows<4>(wgate, up_off, xa, H, I, lo, hi, ng, pairs + g0, xrow, out, ysg);
    else
      rows<kMaxPairs>(wgate, up_off, xa, H, I, lo, hi, ng, pairs + g0, xrow, out, ysg);
  }
  // An unused slot (no pairs) must not return with its direct copies still landing in a.smem,
  // which the SM's next task owns.
  dev::cp_async_wait_all();
  if (out_ep != 0u) {
    mpk::task_sync();  // every warp's outputs are in ys, and every read of the task is done
    // Batch 1: the slot's np <= K pairs (one group). An id outside [0, E) leaves some words
    // unstored: moe_down's poll of them times out and the storer reports it.
    dev::flag_word* words = reinterpret_cast<dev::flag_word*>(out);
    const uint32_t* ypairs = reinterpret_cast<const uint32_t*>(ys);
    const int per = (hi - lo) / 2;  // words of a pair's range (lo, hi, I even)
    for (int c = tid; c < np * per; c += NUM_THREADS) {
      const int p = c / per;
      dev::st_flag(words + ((long long)pairs[p] * I + lo) / 2 + (c - p * per),
                   dev::make_flag_word(ypairs[c], out_ep));
    }
  }
}

}  // namespace mpk::kinds::moe_gate_up
