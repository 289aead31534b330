// gemm, sm_90a: out = epilogue(x @ W^T) for one task's output range and row block (task.py).
//
// Layouts (whole tensors through a.base; the task's place from split_bounds and its grid
// point): x [M_all, K], weight [N, K] (silu_mul: [2, N, K], gate then up), out / residual
// [M_all, N]; this task's rows are [r0, r1) (split_bounds(M_all, row_blocks, 8, point(1))), its
// outputs [lo, hi) (split_bounds(N, tasks, 8, point(0))).
//
// Tiles of BM = 128 rows x BN weight rows (silu_mul: BN / 2 gate rows then the same BN / 2 up
// rows, so BN / 2 outputs a tile), K in steps of BK = 64 through a STAGES-deep cp.async ring (both
// operands through L2: x is an activation, the weight is read once per row block) into
// 128-byte-swizzled stages (common/wgmma.cuh). The two consumer warpgroups each multiply 64
// rows by the BN weight rows with wgmma m64nBNk16 (bf16 in, fp32 accumulate) straight from
// shared memory: the mma.sync tile this replaced reached ~195 TFLOP/s in the megakernel, bound
// by ldmatrix traffic (perf-log, sixth session). A k tile's MMAs are issued before the copies of
// the tile AHEAD further on, so those copies are issued while the tensor cores run.
// BN is 256 for a task whose range is wider than 128 outputs (64 with silu_mul), else 128: the
// 256-wide tile brings 4/3 the FLOPs per staged byte (scripts/wgmma_gemm_probe.cu: 413 against
// 318 TFLOP/s on one wave of qwen3-8b's down), and a narrow task would pay for columns it does
// not have. models/prefill.py sizes the ranges for it.
// Epilogue straight from the accumulators (store_tile), its stores draining while the task's
// next tile's first k tiles land (tiles). Staged through shared memory before, the stages stayed
// busy until the stores were issued and the residual came 16 bytes a thread, one round trip
// after another (perf-log, thirty-fifth session: -1.1% on qwen3-8b's 2,048-token prefill).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/split.cuh"
#include "../common/tile.cuh"
#include "../common/wgmma.cuh"

namespace mpk::kinds::gemm {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int BM = 128, BK = 64, STAGES = 3;  // task.py BM, BK, STAGES
constexpr int BN_WIDE = 256, BN_NARROW = 128;   // task.py BN_WIDE, BN_NARROW
// The copies run AHEAD k tiles ahead of the MMAs, which are waited for within their tile: one
// tile's MMAs left in flight past it measured 1-2% faster in the probe (seventh session), not
// worth a fourth stage of shared memory, and no faster in the megakernel with a second barrier
// a k tile instead (twenty-sixth session: qwen3-8b's prefill 90.9 ms either way).
constexpr int AHEAD = STAGES - 1;
static_assert(BK * 2 == dev::SW128_ROW_BYTES, "a staged row is one 128-byte swizzle row");
constexpr int A_BYTES = BM * BK * 2;
// Both operands' k tile (task.py stage_bytes).
template <int BN>
__host__ __device__ constexpr int stage_bytes() { return (BM + BN) * BK * 2; }
static_assert(NUM_THREADS == 256, "two consumer warpgroups of 64 rows each");

struct Gemm {
  int rows, K, N, lo, hi;
  bool silu, res;
  const bf16* x;     // the task's first row
  const bf16* w;     // the whole weight
  bf16* out;         // the task's first row, column 0
  const bf16* resid;
};

// One thread's share of a tile's copies: chunk c = tid % 8 (16 bytes of a staged row) of rows
// tid / 8 + 32 j, the same for every k tile, so the k loop keeps two pointers and two masks
// (the general loop's per-copy addresses, hoisted, spilled the 256-wide tile's accumulators).
struct TileCopies {
  const bf16* a;   // x's row m0 + tid / 8, chunk c of k tile 0
  const bf16* b;   // the weight's first row of this thread, chunk c of k tile 0
  long long up;    // elements from a silu_mul gate row to its up row (N * K)
  uint32_t a_ok;   // bit j: A row tid / 8 + 32 j exists
  uint32_t b_ok;   // bit j: B row j's output exists
  uint32_t dst;    // offset of row tid / 8, chunk c in a swizzled stage (+ 32 rows: + 4096)
};

// B's row group j (32 rows) as an output offset: with silu_mul the second half of the tile
// holds the up rows of the first half's outputs.
template <int BN>
__device__ __forceinline__ int gate_row_group(const Gemm& t, int j) {
  return t.silu && j >= BN / 64 ? j - BN / 64 : j;
}

template <int BN>
__device__ __forceinline__ TileCopies tile_copies(const Gemm& t, int m0, int n0) {
  const int row = threadIdx.x / 8, c = threadIdx.x % 8;
  TileCopies p;
  p.a = t.x + (long long)(m0 + row) * t.K + 8 * c;
  p.b = t.w + (long long)(n0 + row) * t.K + 8 * c;
  p.up = (long long)t.N * t.K;
  p.a_ok = p.b_ok = 0;
#pragma unroll
  for (int j = 0; j < BM / 32; ++j) p.a_ok |= (m0 + row + 32 * j < t.rows) << j;
#pragma unroll
  for (int j = 0; j < BN / 32; ++j)
    p.b_ok |= (n0 + row + 32 * gate_row_group<BN>(t, j) < t.hi) << j;
  p.dst = dev::sw128_offset(row, c);
  return p;
}

// Stage `slot` <- k tile kt of the tile (rows past the block, outputs past the range and k
// past K read as zeros). Rows j of B are weight rows n0 + tid / 8 + 32 j; with silu_mul the
// second half are the up rows of the first half's gate rows.
template <int BN>
__device__ __forceinline__ void load_stage(const Gemm& t, const TileCopies& p, uint32_t smem,
                                           int slot, int kt) {
  const uint32_t sa = smem + slot * stage_bytes<BN>() + p.dst, sb = sa + A_BYTES;
  const int k0 = kt * BK;
  const bool k_ok = k0 + 8 * (threadIdx.x % 8) < t.K;
  const long long rows32 = 32LL * t.K;
#pragma unroll
  for (int j = 0; j < BM / 32; ++j) {
    const bool ok = k_ok && (p.a_ok >> j & 1);
    dev::cp_async_act16_or_zero(sa + j * 32 * dev::SW128_ROW_BYTES,
                                ok ? p.a + j * rows32 + k0 : t.x, ok);
  }
#pragma unroll
  for (int j = 0; j < BN / 32; ++j) {
    const bool ok = k_ok && (p.b_ok >> j & 1);
    const bool up = t.silu && j >= BN / 64;
    const long long at = gate_row_group<BN>(t, j) * rows32 + (up ? p.up : 0) + k0;
    dev::cp_async_weight16(sb + j * 32 * dev::SW128_ROW_BYTES, ok ? p.b + at : t.w, ok);
  }
}

// acc += this warpgroup's 64 rows x the BN weight rows over one staged k tile (issued, not
// waited for: wgmma_wait_all).
template <int BN>
__device__ __forceinline__ void mma_stage(uint32_t smem, int slot, float (&acc)[BN / 2]) {
  const uint32_t sa = smem + slot * stage_bytes<BN>() + (threadIdx.x / 128) * 64 * BK * 2;
  const uint32_t sb = smem + slot * stage_bytes<BN>() + A_BYTES;
  dev::wgmma_fence();
#pragma unroll
  for (int k16 = 0; k16 < BK / 16; ++k16)  // 16 k = 32 bytes further along each swizzled row
    dev::wgmma_m64k16_bf16<BN>(acc, dev::sw128_desc(sa + 32 * k16),
                               dev::sw128_desc(sb + 32 * k16));
  dev::wgmma_commit();
}

// The tile's outputs [n0, n0 + BN) ([n0, n0 + BN / 2) with silu_mul) of rows m0 .. m0 + 127,
// straight from the accumulators (fragment layout: common/wgmma.cuh): each thread writes the
// pairs of columns it holds, rounded to bf16 where the reference rounds (tasks/linear project),
// with the silu_mul or residual step (out may be the residual itself: each element is read,
// then written, by one thread). A thread's residual words of a row are all loaded before any is
// used, so the tile waits for one round trip a row, not one a 16-byte chunk; and the stages are
// free for the next tile's first copies while these stores drain (tiles).
template <int BN>
__device__ __forceinline__ void store_tile(const Gemm& t, const float (&acc)[BN / 2], int m0,
                                           int n0) {
  const int lane = threadIdx.x & 31, q = lane & 3;
  const int row0 = m0 + (threadIdx.x / 128) * 64 + ((threadIdx.x / 32) % 4) * 16 + (lane >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows g, then g + 8 of the warp's 16
    const int row = row0 + 8 * h;
    if (row >= t.rows) continue;
    bf16* out = t.out + (long long)row * t.N + n0 + 2 * q;
    if (t.silu) {
      // Column c's gate is accumulator group i, its up row the same column BN / 2 further on.
#pragma unroll
      for (int i = 0; i < BN / 16; ++i) {
        if (n0 + 8 * i >= t.hi) continue;
        const float* g = acc + 4 * i + 2 * h;
        const float* u = acc + 4 * (i + BN / 16) + 2 * h;
        const float lo = dev::silu_mul_f32(dev::round_bf16(g[0]), dev::round_bf16(u[0]));
        const float hi = dev::silu_mul_f32(dev::round_bf16(g[1]), dev::round_bf16(u[1]));
        *reinterpret_cast<uint32_t*>(out + 8 * i) = dev::pack_bf16x2(lo, hi);
      }
    } else if (t.res) {
      const bf16* resid = t.resid + (long long)row * t.N + n0 + 2 * q;
      uint32_t res[BN / 8];
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        res[i] = n0 + 8 * i < t.hi ? dev::ld_act_u32(resid + 8 * i) : 0u;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        if (n0 + 8 * i >= t.hi) continue;
        const float* a = acc + 4 * i + 2 * h;
        const float lo = __fadd_rn(dev::round_bf16(a[0]), dev::bf16lo(res[i]));
        const float hi = __fadd_rn(dev::round_bf16(a[1]), dev::bf16hi(res[i]));
        *reinterpret_cast<uint32_t*>(out + 8 * i) = dev::pack_bf16x2(lo, hi);
      }
    } else {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        if (n0 + 8 * i >= t.hi) continue;
        const float* a = acc + 4 * i + 2 * h;
        *reinterpret_cast<uint32_t*>(out + 8 * i) = dev::pack_bf16x2(a[0], a[1]);
      }
    }
  }
}

// Stages 0 .. AHEAD - 1 <- the tile's first k tiles (one commit group each).
template <int BN>
__device__ __forceinline__ void first_stages(const Gemm& t, const TileCopies& p, uint32_t smem,
                                             int nk) {
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < nk) load_stage<BN>(t, p, smem, s, s);
    dev::cp_async_commit();
  }
}

// acc = the tile's k loop, its first stages already issued (first_stages); returns with every
// copy landed and both warpgroups done with the stages.
template <int BN>
__device__ __forceinline__ void k_loop(const Gemm& t, const TileCopies& copies, uint32_t smem,
                                       int nk, float (&acc)[BN / 2]) {
#pragma unroll
  for (int e = 0; e < BN / 2; ++e) acc[e] = 0.f;
  for (int kt = 0; kt < nk; ++kt) {
    dev::cp_async_wait_group(AHEAD - 1);  // k tile kt has landed (this thread's copies)
    dev::fence_proxy_async_shared();      // ... and is visible to wgmma's reads
    // Everyone's copies of tile kt landed; both warpgroups' MMAs of tile kt - 1 are done (waited
    // below), so its slot, (kt + AHEAD) % STAGES, may be overwritten.
    mpk::task_sync();
    mma_stage<BN>(smem, kt % STAGES, acc);
    const int next = kt + AHEAD;
    if (next < nk) load_stage<BN>(t, copies, smem, next % STAGES, next);
    dev::cp_async_commit();
    dev::wgmma_wait_all();
  }
  dev::cp_async_wait_all();
  mpk::task_sync();  // both warpgroups' last MMAs are done: the stages may be refilled
}

// Every tile of the task: its outputs BN (silu_mul: BN / 2) at a time, each over its row block.
// The next tile's first k tiles are issued before this tile's stores, so their copies land
// while the stores drain instead of after.
template <int BN>
__device__ __forceinline__ void tiles(const Gemm& t, uint32_t smem) {
  const int width = t.silu ? BN / 2 : BN;
  const int nk = (t.K + BK - 1) / BK;
  if (t.lo >= t.hi || t.rows <= 0) return;
  int m0 = 0, n0 = t.lo;
  TileCopies copies = tile_copies<BN>(t, m0, n0);
  first_stages<BN>(t, copies, smem, nk);
  while (true) {
    float acc[BN / 2];
    k_loop<BN>(t, copies, smem, nk, acc);
    int next_m0 = m0 + BM, next_n0 = n0;
    if (next_m0 >= t.rows) next_m0 = 0, next_n0 += width;
    const bool more = next_n0 < t.hi;
    if (more) {
      copies = tile_copies<BN>(t, next_m0, next_n0);
      first_stages<BN>(t, copies, smem, nk);
    }
    store_tile<BN>(t, acc, m0, n0);
    if (!more) return;
    m0 = next_m0, n0 = next_n0;
  }
}

}  // namespace detail

// Inlined into the dispatch (task.py wgmma_pipeline): out of line, ptxas serialized every wgmma
// (each waited for before the next was issued: its pipeline crosses a function call, warning
// C7510), and capped the function at the kernel's 168 registers, where the 256-wide tile's 128
// accumulators a thread spilled. Inlined, it gets the consumers' 232 registers; ptxas still
// keeps a few values of the wide tile's k loop in local memory (tests/cuda: 184 B stored).
__device__ __forceinline__ void run_task(const mpk::TaskArgs& a) {
  using detail::bf16;
  detail::Gemm t;
  int r0, r1;
  dev::split_bounds(a.i(P_ROWS), a.i(P_ROW_BLOCKS), 8, a.point(1), r0, r1);
  t.rows = r1 - r0;
  t.K = a.i(P_K);
  t.N = a.i(P_N);
  t.silu = a.i(P_SILU) != 0;
  t.res = a.i(P_HAS_RESIDUAL) != 0;
  dev::split_bounds(t.N, a.i(P_TASKS), 8, a.point(0), t.lo, t.hi);
  t.x = reinterpret_cast<const bf16*>(a.base[O_X]) + (long long)r0 * t.K;
  t.w = reinterpret_cast<const bf16*>(a.base[O_WEIGHT]);
  t.out = reinterpret_cast<bf16*>(a.base[O_OUT]) + (long long)r0 * t.N;
  t.resid = t.res ? reinterpret_cast<const bf16*>(a.base[O_RESIDUAL]) + (long long)r0 * t.N
                  : nullptr;
  // The swizzle pattern repeats every 1024 bytes, and the stages must start on one (task.py
  // scratch_bytes leaves the slack).
  const uint32_t smem = (dev::smem_addr(a.smem) + 1023u) & ~1023u;
  if (t.hi - t.lo > (t.silu ? detail::BN_NARROW / 2 : detail::BN_NARROW))
    detail::tiles<detail::BN_WIDE>(t, smem);
  else
    detail::tiles<detail::BN_NARROW>(t, smem);
}

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) { run_task(a); }


}  // namespace mpk::kinds::gemm
