// moe_gate_up, sm_90a: for slot u (the u-th smallest distinct chosen expert) and range t of the
// expert width, out[b, j, n] = silu_mul(bf16(x[b] . gate[e, n]), bf16(x[b] . up[e, n])) for every
// (b, j) that chose e (semantics in task.py).
//
// Layouts: x [B, H], expert_ids [B, K], weight [E, 2, I, H] are whole (operand = tensor start);
// out [B, K, I] is addressed from its base: pair i = b*K + j, element n at out + i*I + n.
// Shared scratch (task.py): [bits: 16 u32][ids: B*K i32][pairs: B*K i32][npairs][xrow: kMaxPairs
// i32] ... at kBars: [each warp's kMaxDepth mbarriers] ... at HEADER_BYTES: [xs: min(B,
// kMaxPairs) rows of x, H bf16] ... at a 128-byte boundary: [each warp's ring: depth slots of one
// chunk (kChunk elements) of a weight row], depth = what SMEM_BYTES leaves (task.py reserves 2).
//
// 0. At batch <= kMaxPairs every x row is staged (cp.async, L2) before anything else, in place:
//    its round trip runs under the ids' (a pair finds its row in xrow).
// 1. The ids (an activation: L2 loads) go to shared memory and set one bit per valid expert in a
//    512-bit map; every thread finds the slot's expert (the u-th set bit) itself. A slot past the
//    number of distinct experts has no pairs and does nothing more.
// 2. As soon as the expert is known, each warp's lane 0 starts its ring (common/warp_ring.cuh):
//    bulk copies of the chunks of its rows n = lo + warp, lo + warp + 8, ... (gate chunk c, then
//    up chunk c), depth of them in flight; their address depends on the router's ids, so the
//    runtime's loader cannot stream them (issue 12).
// 3. Warp 0 lists the pairs i = b*K + j with ids[i] == expert (a ballot per 32 ids).
// 4. Pairs in groups of up to kMaxPairs: the group's x rows are staged (larger batches), then
//    each warp walks its rows' chunks from the ring (one fp32 dot per pair and matrix), refilling
//    each slot as it is read; lane p stores pair p's output at the row's end. Only when more than
//    kMaxPairs rows chose the expert is there a second group, which walks the rows again.
// Register use stays small (inlined into the all-kinds dispatch switch): kMaxPairs sums per
// matrix, every array indexed by compile-time constants, outer loops not unrolled.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/split.cuh"
#include "../common/warp_ring.cuh"

namespace mpk::kinds::moe_gate_up {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kMaxPairs = 8;   // pairs (x rows) per pass over the expert's rows
constexpr int kAlign = 8;      // task.py ALIGN
constexpr int kHeader = 2048;  // task.py HEADER_BYTES
constexpr int kBars = 1536;    // the warps' ring barriers (ids and pairs end below: B*K <= 128)
constexpr int kMaxDepth = 8;   // task.py MAX_DEPTH: slots a warp's ring may have
constexpr int kChunk = 1024;   // task.py CHUNK: elements of a weight row in one ring slot
constexpr int kVecs = kChunk / 8 / 32;  // 16-byte vectors of a full chunk per lane
static_assert(kBars + kWarps * kMaxDepth * 8 <= kHeader, "ring barriers fit the header");

// Where a warp's units come from: unit k (k >= 0, modulo one walk of the rows) is chunk c of
// matrix m (0 gate, 1 up) of the warp's i-th row, k = i * 2nc + 2c + m.
struct Units {
  const bf16* wgate;  // the expert's gate rows; its up rows follow at up_off
  long long up_off;
  int H, n0, nc, total;  // first row, chunks a row, units of one walk of the rows
  __device__ __forceinline__ const bf16* src(int k, uint32_t& bytes) const {
    const int kk = k % total, per_row = 2 * nc, i = kk / per_row, r = kk - i * per_row;
    const int c = r >> 1, len = min(kChunk, H - c * kChunk);
    bytes = (uint32_t)len * 2u;
    return wgate + (r & 1) * up_off + (long long)(n0 + kWarps * i) * H + c * kChunk;
  }
};

// Lane 0: unit k into the ring, if the task has one.
__device__ __forceinline__ void fill(const dev::WarpRing& ring, const Units& u, int k, int kend) {
  if (k < kend) {
    uint32_t bytes;
    const bf16* src = u.src(k, bytes);
    ring.fill(k, src, bytes);
  }
}

// The warp's rows n = n0, n0 + kWarps, ... for the ng staged pairs, from the ring's units kbase,
// kbase + 1, ...: ng == kNp for kNp <= 2, else kNp / 2 < ng <= kNp. The pair loops' bound is a
// constant, so at kNp 1 and 2 they have no branch at all: a bound known only at run time made
// every pair of every vector a convergence region (at batch 1, where each expert has exactly
// one pair, the expert gate_up phase took 25.3 us a layer against 16.9 with the bound fixed:
// perf-log, thirteenth session).
template <int kNp>
__device__ __forceinline__ void rows(const dev::WarpRing& ring, const Units& u, int kbase,
                                     int kend, unsigned xs, int I, int ng, const int* pairs,
                                     const int* xrow, bf16* out) {
  static_assert(kNp >= 1 && kNp <= kMaxPairs, "pairs per pass");
  const int lane = threadIdx.x & 31, H = u.H, per_row = 2 * u.nc;
  unsigned xo[kNp];  // byte offset of pair p's staged x row
#pragma unroll
  for (int p = 0; p < kNp; ++p) xo[p] = (unsigned)((kNp <= 2 || p < ng ? xrow[p] : 0) * H) * 2u;
#pragma unroll 1
  for (int i = 0, k = kbase; k < kbase + u.total; ++i, k += per_row) {
    float ag[kNp], au[kNp];
#pragma unroll
    for (int p = 0; p < kNp; ++p) ag[p] = au[p] = 0.f;
#pragma unroll 1
    for (int c = 0; c < u.nc; ++c) {
      const int kg = k + 2 * c, nv = min(kChunk, H - c * kChunk) / 8;
      const unsigned sg = ring.wait(kg), su = ring.wait(kg + 1);
      // Branch-free: past the chunk (zero weights) or past the pairs, x is a zero vector, whose
      // products add +0 (the sums of pairs past ng are never stored).
#pragma unroll 1
      for (int q = 0; q < kVecs; ++q) {
        const int v = 32 * q + lane;
        const bool ok = v < nv;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        float fg[8], fu[8];
        dev::unpack8(ok ? dev::lds_v4(sg + 16u * v) : zero, fg);
        dev::unpack8(ok ? dev::lds_v4(su + 16u * v) : zero, fu);
#pragma unroll
        for (int p = 0; p < kNp; ++p) {
          const bool use = ok && (kNp <= 2 || p < ng);
          float fx[8];
          dev::unpack8(use ? dev::lds_v4(xs + xo[p] + (unsigned)(c * kChunk + v * 8) * 2u) : zero,
                       fx);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            ag[p] = fmaf(fx[e], fg[e], ag[p]);
            au[p] = fmaf(fx[e], fu[e], au[p]);
          }
        }
      }
      __syncwarp();  // every lane has read both slots: they may be refilled
      if (lane == 0) {
        fill(ring, u, kg + ring.depth, kend);
        fill(ring, u, kg + 1 + ring.depth, kend);
      }
    }
    const int n = u.n0 + kWarps * i;
#pragma unroll
    for (int p = 0; p < kNp; ++p) {
      if (kNp <= 2 || p < ng) {  // ng is warp-uniform: the shuffles see every lane
        const float gs = dev::warp_sum(ag[p]), us = dev::warp_sum(au[p]);
        if (lane == p)
          out[(long long)pairs[p] * I + n] =
              dev::to_bf16(dev::silu_mul_f32(dev::round_bf16(gs), dev::round_bf16(us)));
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
  // Nothing below reads `a`: its slot pointer is one of the values the all-kinds build keeps in
  // local memory, and every late read of it is a reload (ptxas spill loads).
  const int BK = B * K, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned* bits = reinterpret_cast<unsigned*>(a.smem);
  const unsigned smem = dev::smem_addr(a.smem);
  int* ids = reinterpret_cast<int*>(a.smem + 64);
  int* pairs = ids + BK;
  int* npairs = pairs + BK;
  int* xrow = npairs + 1;  // staged x row of each pair of the group
  bf16* xs = reinterpret_cast<bf16*>(a.smem + kHeader);
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
  const int first_id = tid < BK ? dev::ld_act_i32(gids + tid) : -1;
  if (tid < 16) bits[tid] = 0u;
  mpk::task_sync();
  for (int i = tid; i < BK; i += NUM_THREADS) {
    const int e = i == tid ? first_id : dev::ld_act_i32(gids + i);
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

  // 2. the warp's ring starts streaming its rows of the expert at once
  int lo, hi;
  dev::split_bounds(I, T, kAlign, tile, lo, hi);
  // The warp index through volatile asm: values derived from threadIdx.x alone are otherwise
  // hoisted out of the runtime's task loop and held in registers across every kind (spills in
  // attention's set-up, tests/cuda/test_nvcc_build.py).
  const int rwarp = ptx::thread_index() >> 5;
  const int n0 = lo + rwarp, nc = (H + kChunk - 1) / kChunk;
  const int my_rows = expert >= 0 && n0 < hi ? (hi - n0 + kWarps - 1) / kWarps : 0;
  const Units u{weight + (long long)max(expert, 0) * 2 * I * H, (long long)I * H, H, n0, nc,
                my_rows * 2 * nc};
  const uint32_t slot_bytes = (uint32_t)(min(kChunk, H) * 2 + 127) & ~127u;
  const uint32_t ring_off =
      (uint32_t)(kHeader + min(B, kMaxPairs) * H * 2 + 127) & ~127u;  // after the x rows
  const int depth = min(kMaxDepth, (int)((SMEM_BYTES - ring_off) / (kWarps * slot_bytes)));
  dev::WarpRing ring{smem + kBars + 8u * kMaxDepth * rwarp,
                     smem + ring_off + slot_bytes * depth * rwarp, slot_bytes,
                     depth};
  if (u.total > 0) {
    ring.init(lane);
    if (lane == 0)
      for (int k = 0; k < depth; ++k) fill(ring, u, k, u.total);
  }

  // 3. the pairs that chose it (none for an unused slot: expert -1; no early return, which
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

  // 4. groups of pairs: stage their x rows, then walk the rows of the expert from the ring
  const int group = min(B, kMaxPairs);
  const int kend = (np + group - 1) / group * u.total;  // every group walks the rows once
  // The first fills stopped at one walk; a ring deeper than that with more groups to walk
  // takes the next walk's first units now (its refills start depth units on).
  if (u.total > 0 && lane == 0)
    for (int k = u.total; k < min(depth, kend); ++k) fill(ring, u, k, kend);
#pragma unroll 1
  for (int g0 = 0, kbase = 0; g0 < np; g0 += group, kbase += u.total) {
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
    if (ng == 1)
      rows<1>(ring, u, kbase, kend, xa, I, ng, pairs + g0, xrow, out);
    else if (ng == 2)
      rows<2>(ring, u, kbase, kend, xa, I, ng, pairs + g0, xrow, out);
    else if (ng <= 4)
      rows<4>(ring, u, kbase, kend, xa, I, ng, pairs + g0, xrow, out);
    else
      rows<kMaxPairs>(ring, u, kbase, kend, xa, I, ng, pairs + g0, xrow, out);
  }
  if (u.total > 0) ring.finish(lane);
  // An unused slot (no pairs) must not return with its direct copies still landing in a.smem,
  // which the SM's next task owns.
  dev::cp_async_wait_all();
}

}  // namespace mpk::kinds::moe_gate_up
