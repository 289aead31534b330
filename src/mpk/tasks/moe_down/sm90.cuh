// moe_down, sm_90a: for range t of the hidden size, out[b, n] = bf16(residual[b, n] +
// bf16(sum_j bf16(bf16(x[b, j] . W[e_bj, n]) * w_bj))) with the sum in fp32 in slot order
// (semantics in task.py).
//
// Layouts: x [B, K, I], expert_ids and expert_weights [B, K], weight [E, H, I] are whole
// (operand = tensor start); residual and out [B, H] are addressed from their bases (element
// (b, n) at + b*H + n). out may be the residual tensor itself: each element is read and then
// written by the same lane, and only this task's range is touched.
// Shared scratch (task.py): [ids: B*K i32][weights: B*K f32] ... at kBars: [each warp's
// kMaxDepth mbarriers] ... at HEADER_BYTES: [xs: K x I bf16, batch row b's expert activations]
// ... at a 128-byte boundary: [each warp's ring: depth slots of one chunk (kChunk elements) of a
// weight row], depth = what SMEM_BYTES leaves (task.py reserves 2).
//
// Per batch row b: its K activation rows are staged (cp.async, L2; row 0's before the ids are
// read), then warp w takes outputs n = lo + w, lo + w + 8, ... Each warp streams the rows it
// needs, W[e_bj, n] for its outputs and the row's slots j in order, through its own ring of
// shared-memory slots filled by bulk copies (common/warp_ring.cuh), started as soon as the ids
// are in shared memory and running ahead across outputs and batch rows (the address depends on
// this step's ids, so the runtime's loader cannot stream them: issue 12). One fp32 dot per slot;
// at an output's end its slots are rounded, weighted, rounded and added to the running fp32 sum
// in slot order, so the sum is the reference's. An id outside [0, E) adds nothing (its unit
// copies no bytes).
// Register use stays small (inlined into the all-kinds dispatch switch): kJ sums, indexed by
// compile-time constants; outer loops not unrolled.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/split.cuh"
#include "../common/warp_ring.cuh"

namespace mpk::kinds::moe_down {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kJ = 8;          // task.py MAX_TOP_K: slots a row may have (sums kept)
constexpr int kAlign = 8;      // task.py ALIGN
constexpr int kHeader = 2048;  // task.py HEADER_BYTES
constexpr int kBars = 1536;    // the warps' ring barriers (ids and weights end below: B*K <= 128)
constexpr int kMaxDepth = 8;   // moe_gate_up task.py MAX_DEPTH: slots a warp's ring may have
constexpr int kChunk = 1024;   // moe_gate_up task.py CHUNK: elements of a weight row in a slot
constexpr int kVecs = kChunk / 8 / 32;  // 16-byte vectors of a full chunk per lane
static_assert(kBars + kWarps * kMaxDepth * 8 <= kHeader, "ring barriers fit the header");

// Where a warp's units come from: unit k is chunk c of W[e_bj, n] for batch row b = k / total,
// the warp's i-th output n = n0 + 8i and slot j: k = b * total + (i * K + j) * nc + c.
struct Units {
  const bf16* w;   // weight [E, H, I]
  const int* ids;  // smem: every row's K ids
  int E, H, I, K, n0, nc, total;  // first output, chunks a row, units of one batch row
  __device__ __forceinline__ const bf16* src(int k, uint32_t& bytes) const {
    const int b = k / total, kk = k - b * total, per_out = K * nc, i = kk / per_out;
    const int r = kk - i * per_out, j = r / nc, c = r - j * nc;
    const int e = ids[b * K + j];
    bytes = 0 <= e && e < E ? (uint32_t)min(kChunk, I - c * kChunk) * 2u : 0u;
    return w + ((long long)e * H + n0 + kWarps * i) * I + c * kChunk;
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

// sum_j bf16(bf16(x[b, j] . W[e_j, n]) * w_j) in fp32, slot order (every lane returns it), from
// the ring's units k0, k0 + 1, ... (row b's slots j in order, their chunks in order).
__device__ __forceinline__ float output(const dev::WarpRing& ring, const Units& u, int k0,
                                        int kend, const int* ids, const float* ws, unsigned xs,
                                        int lane) {
  float acc[kJ];
#pragma unroll
  for (int jj = 0; jj < kJ; ++jj) {
    acc[jj] = 0.f;
    if (jj < u.K) {  // warp-uniform
      const bool valid = 0 <= ids[jj] && ids[jj] < u.E;
#pragma unroll 1
      for (int c = 0; c < u.nc; ++c) {
        const int k = k0 + jj * u.nc + c, nv = min(kChunk, u.I - c * kChunk) / 8;
        const unsigned sw = ring.wait(k);
        // Branch-free: past the chunk, or for an id outside [0, E) (its slot holds stale
        // bytes), both vectors are zero and add +0 to a sum that starts at +0.
#pragma unroll 1
        for (int q = 0; q < kVecs; ++q) {
          const int v = 32 * q + lane;
          const bool ok = valid && v < nv;
          const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
          float fx[8], fw[8];
          dev::unpack8(ok ? dev::lds_v4(sw + 16u * v) : zero, fw);
          dev::unpack8(ok ? dev::lds_v4(xs + (unsigned)(jj * u.I + c * kChunk + v * 8) * 2u)
                          : zero, fx);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[jj] = fmaf(fx[e], fw[e], acc[jj]);
        }
        __syncwarp();  // every lane has read the slot: it may be refilled
        if (lane == 0) fill(ring, u, k + ring.depth, kend);
      }
    }
  }
  float total = 0.f;
#pragma unroll
  for (int jj = 0; jj < kJ; ++jj) {
    if (jj < u.K && 0 <= ids[jj] && ids[jj] < u.E) {  // warp-uniform
      const float down = dev::round_bf16(dev::warp_sum(acc[jj]));
      total = __fadd_rn(total, dev::round_bf16(__fmul_rn(down, ws[jj])));
    }
  }
  return total;
}

// Batch row b's K activation rows into xs (cp.async, not waited for).
__device__ __forceinline__ void stage_row(bf16* xs, const bf16* x, int b, int kvpr) {
  for (int v = threadIdx.x; v < kvpr; v += NUM_THREADS)
    dev::cp_async_act16(xs + v * 8, x + (long long)b * kvpr * 8 + v * 8);
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using namespace detail;
  const int B = a.i(P_BATCH), H = a.i(P_HIDDEN), I = a.i(P_INTER), K = a.i(P_TOP_K);
  const int E = a.i(P_NUM_EXPERTS);
  int lo, hi;
  dev::split_bounds(H, a.i(P_TASKS), kAlign, a.point(0), lo, hi);
  const int* gids = a.operand<const int>(O_EXPERT_IDS);
  const bf16* gws = a.operand<const bf16>(O_EXPERT_WEIGHTS);
  const bf16* x = a.operand<const bf16>(O_X);
  const bf16* weight = a.operand<const bf16>(O_WEIGHT);
  const bf16* res = reinterpret_cast<const bf16*>(a.base[O_RESIDUAL]);
  bf16* out = reinterpret_cast<bf16*>(a.base[O_OUT]);
  // Nothing below reads `a`: its slot pointer is one of the values the all-kinds build keeps in
  // local memory, and every late read of it is a reload (ptxas spill loads).
  const int BK = B * K, tid = threadIdx.x, lane = tid & 31;
  int* ids = reinterpret_cast<int*>(a.smem);
  const unsigned smem = dev::smem_addr(a.smem);
  float* ws = reinterpret_cast<float*>(ids + BK);
  bf16* xs = reinterpret_cast<bf16*>(a.smem + kHeader);
  const int kvpr = K * I / 8;  // 16-byte vectors of one row's K activations
  // Row 0's activations are asked for before the ids and routing weights: a thread's store of
  // an id waits for its load, which would hold its copies back by one L2 round trip.
  stage_row(xs, x, 0, kvpr);
  for (int i = tid; i < BK; i += NUM_THREADS) {  // activations: L2 loads
    ids[i] = dev::ld_act_i32(gids + i);
    ws[i] = dev::ld_act_bf16f(gws + i);
  }
  // The warp index through volatile asm (moe_gate_up says why).
  const int warp = ptx::thread_index() >> 5, n0 = lo + warp, nc = (I + kChunk - 1) / kChunk;
  const int my_outs = n0 < hi ? (hi - n0 + kWarps - 1) / kWarps : 0;
  const Units u{weight, ids, E, H, I, K, n0, nc, my_outs * K * nc};
  const int kend = B * u.total, per_out = K * nc;
  const uint32_t slot_bytes = (uint32_t)(min(kChunk, I) * 2 + 127) & ~127u;
  const uint32_t ring_off = (uint32_t)(kHeader + K * I * 2 + 127) & ~127u;  // after xs
  const int depth = min(kMaxDepth, (int)((SMEM_BYTES - ring_off) / (kWarps * slot_bytes)));
  dev::WarpRing ring{smem + kBars + 8u * kMaxDepth * warp,
                     smem + ring_off + slot_bytes * depth * warp, slot_bytes,
                     depth};
  const unsigned xa = dev::smem_addr(xs);
#pragma unroll 1
  for (int b = 0; b < B; ++b) {
    if (b > 0) {
      mpk::task_sync();  // every warp is done with row b-1's activations
      stage_row(xs, x, b, kvpr);
    }
    dev::cp_async_wait_all();
    mpk::task_sync();  // also publishes ids / ws (first row)
    if (b == 0 && u.total > 0) {  // the ring starts once the ids are in shared memory
      ring.init(lane);
      if (lane == 0)
        for (int k = 0; k < depth; ++k) fill(ring, u, k, kend);
    }
#pragma unroll 1
    for (int i = 0; i < my_outs; ++i) {
      const float total = output(ring, u, b * u.total + i * per_out, kend, ids + b * K,
                                 ws + b * K, xa, lane);
      if (lane == 0) {
        const long long off = (long long)b * H + n0 + kWarps * i;
        const float resid = dev::ld_act_bf16f(res + off);
        out[off] = dev::to_bf16(__fadd_rn(resid, dev::round_bf16(total)));
      }
    }
  }
  if (u.total > 0) ring.finish(lane);
}

}  // namespace mpk::kinds::moe_down
