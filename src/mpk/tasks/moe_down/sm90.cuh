// moe_down, sm_90a: for range t of the hidden size, out[b, n] = bf16(residual[b, n] +
// bf16(sum_j bf16(bf16(x[b, j] . W[e_bj, n]) * w_bj))) with the sum in fp32 in slot order
// (semantics in task.py).
//
// Layouts: x [B, K, I], expert_ids and expert_weights [B, K], weight [E, H, I] are whole
// (operand = tensor start); residual and out [B, H] are addressed from their bases (element
// (b, n) at + b*H + n). out may be the residual tensor itself: each element is read and then
// written by the same warp (its value reaches the writing lane by a shuffle), and only this
// task's range is touched. Flagged residual / out (common/flags.cuh): word (b*H + n) / 2 holds
// columns n, n + 1 (n even) and its epoch. The residual's words are polled (long since written
// by o_proj); a flagged out is gathered in ys and stored as whole words once every row's range
// is done (the warps that compute a word's two columns differ; the stores follow all the task's
// reads, as compiler/flags.py's contract asks). A flagged x (batch 1: moe_gate_up's gathered
// words) is polled into xs under the ids' loads: the task starts when its SM is free, not when
// the last gate_up task has signalled (the compiler lets that counted wait go).
// Shared scratch (task.py scratch_bytes): [ids: B*K i32] [weights: B*K f32] ... at HEADER_BYTES:
// [xs: K x I bf16, batch row b's expert activations] [ys: B x (hi - lo) outputs, bf16, at a
// 16-byte boundary].
//
// Per batch row b: its K activation rows are staged (cp.async, L2; row 0's before the ids are
// read), then warp w takes outputs n = lo + w, lo + w + 8, ... For one output the slots are
// visited in groups of kJ: each lane keeps kJ x kV 16-byte vectors of the chosen experts' rows
// W[e, n] in flight (weights, read-only path; no stream because the address depends on this
// step's ids: issue 12), and one fp32 dot per slot; after a group, its slots' warp sums are
// taken at once, rounded, weighted, rounded and added to the running fp32 sum in slot order, so
// the sum is the reference's. An id outside [0, E) adds nothing.
// Register use stays small (inlined into the all-kinds dispatch switch): kJ x kV vectors and kJ
// sums, indexed by compile-time constants; outer loops not unrolled.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/flags.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/split.cuh"

namespace mpk::kinds::moe_down {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int kWarps = NUM_THREADS / 32;
constexpr int kJ = 8;          // slots per group
constexpr int kV = 3;          // vectors per slot row in flight per lane
constexpr int kAlign = 8;      // task.py ALIGN
constexpr int kHeader = 2048;  // task.py HEADER_BYTES
constexpr int kPollVecs = 3;   // a flagged x's vectors in flight a thread (qwen3-30b-a3b: 768)

struct Row {  // batch row b, as this task sees it
  const bf16* w;   // weight [E, H, I]
  const int* ids;  // smem: row b's K ids
  const float* ws; // smem: row b's K routing weights
  unsigned xs;     // smem address of row b's K staged activations
  int H, I, E, K;
};

// Slot j's weight row W[e_j, n], or nullptr past the row's slots or for an id outside [0, E).
// Recomputed from the staged id where it is needed: kJ pointers kept live would cost 2 kJ
// registers across the loop.
__device__ __forceinline__ const bf16* slot_row(const Row& r, int j, int n) {
  const int e = j < r.K ? r.ids[j] : -1;
  return 0 <= e && e < r.E ? r.w + ((long long)e * r.H + n) * r.I : nullptr;
}

// Slot j's weights of output n: lane `lane`'s kV vectors (zeros past the slots or the row, or
// for an id outside [0, E)).
__device__ __forceinline__ void load_slot(const Row& r, int j, int c, int n, int lane,
                                          uint4 (&w)[kV]) {
  const int vpr = r.I / 8;
  const bf16* row = slot_row(r, j, n);
#pragma unroll
  for (int i = 0; i < kV; ++i) {
    const int v = c + 32 * i + lane;
    w[i] = row != nullptr && v < vpr ? dev::ld_weight_v4(row + v * 8) : make_uint4(0u, 0u, 0u, 0u);
  }
}
// One slot group's weights of output n, all issued before any is used.
__device__ __forceinline__ void load_group(const Row& r, int j0, int c, int n, int lane,
                                           uint4 (&w)[kJ][kV]) {
#pragma unroll
  for (int jj = 0; jj < kJ; ++jj) load_slot(r, j0 + jj, c, n, lane, w[jj]);
}

// The lane's part of slot j's dot product: acc += x[b, j] . w over its vectors. Branch-free: a
// vector past the slots or the row is a zero x (and a zero weight) whose products add +0 to a
// sum that starts at +0 (a skipped block per vector made each one a convergence region, as
// moe_gate_up's pair loop had: perf-log, thirteenth session).
__device__ __forceinline__ void dot_slot(const Row& r, int j, int c, int lane, const uint4 (&w)[kV],
                                         float& acc) {
  const int vpr = r.I / 8;
#pragma unroll
  for (int i = 0; i < kV; ++i) {
    const int v = c + 32 * i + lane;
    const bool ok = j < r.K && v < vpr;
    const uint4 xv = ok ? dev::lds_v4(r.xs + (unsigned)(j * r.I + v * 8) * 2u)
                        : make_uint4(0u, 0u, 0u, 0u);
    float fx[8], fw[8];
    dev::unpack8(xv, fx);
    dev::unpack8(w[i], fw);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(fx[e], fw[e], acc);
  }
}
__device__ __forceinline__ void dot_group(const Row& r, int j0, int c, int lane,
                                          const uint4 (&w)[kJ][kV], float (&acc)[kJ]) {
#pragma unroll
  for (int jj = 0; jj < kJ; ++jj) dot_slot(r, j0 + jj, c, lane, w[jj], acc[jj]);
}

// total += sum over the group's slots of bf16(bf16(dot) * w_j), in slot order. The kJ warp sums
// first, with no branch between them, so their shuffles interleave (one warp sum after another,
// each behind its slot's warp-uniform branch, was a chain of 5 dependent shuffles per slot);
// then the slots fold in order. Each warp sum adds in the same order as before: same bits.
__device__ __forceinline__ void add_group(const Row& r, int j0, int n, const float (&acc)[kJ],
                                          float& total) {
  float dot[kJ];
#pragma unroll
  for (int jj = 0; jj < kJ; ++jj) dot[jj] = acc[jj];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
#pragma unroll
    for (int jj = 0; jj < kJ; ++jj) dot[jj] += __shfl_xor_sync(0xffffffffu, dot[jj], off);
#pragma unroll
  for (int jj = 0; jj < kJ; ++jj) {
    if (slot_row(r, j0 + jj, n) != nullptr) {  // warp-uniform
      const float down = dev::round_bf16(dot[jj]);
      total = __fadd_rn(total, dev::round_bf16(__fmul_rn(down, r.ws[j0 + jj])));
    }
  }
}

// sum_j bf16(bf16(x[b, j] . W[e_j, n]) * w_j) in fp32, slot order (every lane returns it), in
// groups of kJ slots and rounds of 32 kV vectors a row.
__device__ __forceinline__ float output(const Row& r, int n, int lane) {
  const int vpr = r.I / 8;
  float total = 0.f;
#pragma unroll 1
  for (int j0 = 0; j0 < r.K; j0 += kJ) {
    float acc[kJ];
#pragma unroll
    for (int jj = 0; jj < kJ; ++jj) acc[jj] = 0.f;
#pragma unroll 1
    for (int c = 0; c < vpr; c += 32 * kV) {
      uint4 w[kJ][kV];
      load_group(r, j0, c, n, lane, w);
      dot_group(r, j0, c, lane, w, acc);
    }
    add_group(r, j0, n, acc, total);
  }
  return total;
}

// residual and out, plain (ep 0) or flagged (common/flags.cuh), addressed from their bases.
struct Hidden {
  const bf16* res;
  bf16* out;
  uint32_t res_ep, out_ep;
};

// The residual's element `at` (b*H + n), polled from its word when flagged.
__device__ __forceinline__ float residual_at(const Hidden& h, long long at) {
  if (h.res_ep == 0u) return dev::ld_act_bf16f(h.res + at);
  const dev::flag_word* w = reinterpret_cast<const dev::flag_word*>(h.res) + at / 2;
  const uint32_t pair = dev::poll_word(w, dev::ld_flag(w), h.res_ep, dev::Poll{});
  return (at & 1) ? dev::bf16hi(pair) : dev::bf16lo(pair);
}

// This warp's outputs n = n0, n0 + kWarps, ... < hi of batch row b (into ys at n - lo when out
// is flagged: ys is row b's part). The residuals of its first 32 outputs are loaded first (lane
// i: output i), so their L2 round trips run under the weight loads instead of after each
// output's sum. (Also keeping the next output's weights in flight under a sum, 96 registers
// across the loop, spilled 436 B in the qwen3-30b-a3b build.)
__device__ __forceinline__ void outputs(const Row& r, const Hidden& h, bf16* ys, int b, int n0,
                                        int lo, int hi, int lane) {
  const long long row = (long long)b * r.H;
  const int own = n0 + kWarps * lane;
  const float resid_mine = own < hi ? residual_at(h, row + own) : 0.f;
  int i = 0;
#pragma unroll 1
  for (int n = n0; n < hi; n += kWarps, ++i) {
    const float total = output(r, n, lane);
    const float resid = i < 32 ? __shfl_sync(0xffffffffu, resid_mine, i)
                               : residual_at(h, row + n);
    if (lane == 0) {
      const bf16 y = dev::to_bf16(__fadd_rn(resid, dev::round_bf16(total)));
      if (h.out_ep == 0u) h.out[row + n] = y;
      else ys[n - lo] = y;
    }
  }
}

// A flagged out: every row's range [lo, hi) from ys as whole words (H, lo, hi even), once every
// warp's outputs are in (the caller's barrier).
__device__ __forceinline__ void store_words(const Hidden& h, const bf16* ys, int B, int H, int lo,
                                            int hi) {
  const int per = (hi - lo) / 2;  // words a row
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(ys);
  dev::flag_word* words = reinterpret_cast<dev::flag_word*>(h.out);
  for (int t = threadIdx.x; t < B * per; t += NUM_THREADS) {
    const int b = t / per, c = t - b * per;
    dev::st_flag(words + ((long long)b * H + lo) / 2 + c,
                 dev::make_flag_word(pairs[t], h.out_ep));
  }
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
  const Hidden hid{reinterpret_cast<const bf16*>(a.base[O_RESIDUAL]),
                   reinterpret_cast<bf16*>(a.base[O_OUT]), dev::flag_epoch<FLAGGED>(a, O_RESIDUAL),
                   dev::flag_epoch<FLAGGED>(a, O_OUT)};
  const uint32_t x_ep = dev::flag_epoch<FLAGGED>(a, O_X);  // batch 1 only (task.py)
  const dev::flag_word* xwords = dev::flag_operand<const dev::flag_word>(a, O_X);
  const uint32_t ids_ep = dev::flag_epoch<FLAGGED>(a, O_EXPERT_IDS);  // batch 1 (task.py)
  const dev::flag_word* id_words = dev::flag_operand<const dev::flag_word, 1>(a, O_EXPERT_IDS);
  // Nothing below reads `a`: its slot pointer is one of the values the all-kinds build keeps in
  // local memory, and every late read of it is a reload (ptxas spill loads).
  const int BK = B * K, tid = threadIdx.x, lane = tid & 31;
  int* ids = reinterpret_cast<int*>(a.smem);
  float* ws = reinterpret_cast<float*>(ids + BK);
  bf16* xs = reinterpret_cast<bf16*>(a.smem + kHeader);
  const int kvpr = K * I / 8;  // 16-byte vectors of one row's K activations
  bf16* ys = reinterpret_cast<bf16*>(a.smem + kHeader + ((K * I * 2 + 15) & ~15));
  // Row 0's activations are asked for before the ids and routing weights: a thread's store of
  // an id waits for its load, which would hold its copies back by one L2 round trip.
  // A flagged x is polled with the first ids' loads in flight (their stores, and the polls of
  // flagged ids, come after it).
  if (x_ep == 0u) stage_row(xs, x, 0, kvpr);
  const dev::flag_word first_word =
      tid < BK ? dev::ld_i32_word(gids, id_words, ids_ep, tid) : 0ull;
  const float first_w = tid < BK ? dev::ld_act_bf16f(gws + tid) : 0.f;
  if (x_ep != 0u)
    dev::poll_vectors<kPollVecs>(reinterpret_cast<uint4*>(xs), xwords, x_ep, kvpr, dev::Poll{});
  for (int i = tid; i < BK; i += NUM_THREADS) {  // activations: L2 loads
    ids[i] = i == tid ? dev::i32_of(id_words, first_word, ids_ep, i)
                      : dev::ld_i32_maybe_flagged(gids, id_words, ids_ep, i);
    ws[i] = i == tid ? first_w : dev::ld_act_bf16f(gws + i);
  }
  Row r{weight, ids, ws, dev::smem_addr(xs), H, I, E, K};
#pragma unroll 1
  for (int b = 0; b < B; ++b) {
    if (b > 0) {
      mpk::task_sync();  // every warp is done with row b-1's activations
      stage_row(xs, x, b, kvpr);
    }
    dev::cp_async_wait_all();
    mpk::task_sync();  // also publishes ids / ws (first row) and a polled x
    r.ids = ids + b * K;
    r.ws = ws + b * K;
    outputs(r, hid, ys + b * (hi - lo), b, lo + (tid >> 5), lo, hi, lane);
  }
  if (hid.out_ep != 0u) {
    mpk::task_sync();  // every warp's outputs of every row are in ys
    store_words(hid, ys, B, H, lo, hi);
  }
}

}  // namespace mpk::kinds::moe_down
