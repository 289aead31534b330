// gemm, sm_90a: out = epilogue(x @ W^T) for one task's output range and row block (task.py).
//
// Layouts (whole tensors through a.base; the task's place from split_bounds and its grid
// point): x [M_all, K], weight [N, K] (silu_mul: [2, N, K], gate then up), out / residual
// [M_all, N]; this task's rows are [r0, r1) (split_bounds(M_all, row_blocks, 8, point(1))), its
// outputs [lo, hi) (split_bounds(N, tasks, 8, point(0))).
//
// Tiles of BM = 128 rows x BN = 128 weight rows (silu_mul: 64 gate rows then the same 64 up
// rows, so 64 outputs a tile), K in steps of BK = 64 through a STAGES-deep cp.async ring (both
// operands through L2: x is an activation, the weight is read once per row block). Rows are
// padded by 16 bytes, so ldmatrix's eight 16-byte rows fall in distinct banks. 8 warps as 2 (rows)
// x 4 (weight rows), a warp tile of 64 x 32 (6 ldmatrix per 16 mma: a 32 x 32 warp tile, 4 per
// 8, was bound by shared-memory bandwidth at ~135 TFLOP/s on qwen3-8b, perf-log): mma.sync
// m16n8k16, bf16 in, fp32 accumulate.
// Epilogue through shared memory: the tile is rounded to bf16 where the reference rounds
// (tasks/linear project), then rows are written 16 bytes at a time with the silu_mul or
// residual step (out may be the residual itself: each element is read, then written, by one
// thread).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"
#include "../common/split.cuh"
#include "../common/tile.cuh"

namespace mpk::kinds::gemm {
namespace detail {

using bf16 = __nv_bfloat16;
constexpr int BM = 128, BN = 128, BK = 64, STAGES = 3;  // task.py BM, BN, BK, STAGES
constexpr int ROW = BK + 8;                            // task.py SMEM_ROW
constexpr int A_BYTES = BM * ROW * 2, STAGE_BYTES = (BM + BN) * ROW * 2;
constexpr int CROW = BN + 8;  // the epilogue tile's row, bf16 elements
static_assert(NUM_THREADS == 256, "the warp tiling assumes 8 consumer warps");

struct Gemm {
  int rows, K, N, lo, hi;
  bool silu, res;
  const bf16* x;     // the task's first row
  const bf16* w;     // the whole weight
  bf16* out;         // the task's first row, column 0
  const bf16* resid;
};

// Stage `slot` <- k tile kt of the tile at (m0, n0); out-of-range rows and k read as zeros.
__device__ __forceinline__ void load_stage(const Gemm& t, uint32_t smem, int slot, int kt,
                                           int m0, int n0) {
  const uint32_t sa = smem + slot * STAGE_BYTES, sb = sa + A_BYTES;
  const int k0 = kt * BK;
  for (int i = threadIdx.x; i < BM * (BK / 8); i += NUM_THREADS) {
    const int r = i / (BK / 8), k = k0 + (i % (BK / 8)) * 8;
    const bool ok = m0 + r < t.rows && k < t.K;
    const bf16* src = ok ? t.x + (long long)(m0 + r) * t.K + k : t.x;
    dev::cp_async_act16_or_zero(sa + (r * ROW + k - k0) * 2, src, ok);
  }
  for (int i = threadIdx.x; i < BN * (BK / 8); i += NUM_THREADS) {
    const int r = i / (BK / 8), k = k0 + (i % (BK / 8)) * 8;
    const int col = t.silu ? n0 + r % (BN / 2) : n0 + r;
    const long long wrow = t.silu && r >= BN / 2 ? (long long)t.N + col : col;
    const bool ok = col < t.hi && k < t.K;
    const bf16* src = ok ? t.w + wrow * t.K + k : t.w;
    dev::cp_async_weight16(sb + (r * ROW + k - k0) * 2, src, ok);
  }
}

// acc[mi][ni] += the warp's 64 x 32 block over one staged k tile.
__device__ __forceinline__ void mma_stage(uint32_t smem, int slot, float (&acc)[4][4][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t sa = smem + slot * STAGE_BYTES, sb = sa + A_BYTES;
  const int arow = (warp & 1) * 64 + (lane & 15), acol = (lane >> 4) * 8;
  const int brow = (warp >> 1) * 32 + (lane & 7) + ((lane >> 4) << 3), bcol = ((lane >> 3) & 1) * 8;
#pragma unroll 1
  for (int kk = 0; kk < BK; kk += 16) {
    uint32_t af[4][4], bfr[4][2];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
      dev::ldmatrix_x4(sa + ((arow + mi * 16) * ROW + kk + acol) * 2, af[mi][0], af[mi][1],
                       af[mi][2], af[mi][3]);
#pragma unroll
    for (int nj = 0; nj < 2; ++nj)
      dev::ldmatrix_x4(sb + ((brow + nj * 16) * ROW + kk + bcol) * 2, bfr[2 * nj][0],
                       bfr[2 * nj][1], bfr[2 * nj + 1][0], bfr[2 * nj + 1][1]);
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
        dev::mma_bf16_16816(acc[mi][ni], af[mi][0], af[mi][1], af[mi][2], af[mi][3],
                            bfr[ni][0], bfr[ni][1]);
  }
}

// The warp's accumulators, rounded to bf16, into the [BM][CROW] tile at smem.
__device__ __forceinline__ void stage_tile(uint32_t smem, const float (&acc)[4][4][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int row = (warp & 1) * 64 + mi * 16 + g, col = (warp >> 1) * 32 + ni * 8 + 2 * t;
      const uint32_t lo = dev::pack_bf16x2(acc[mi][ni][0], acc[mi][ni][1]);
      const uint32_t hi = dev::pack_bf16x2(acc[mi][ni][2], acc[mi][ni][3]);
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(smem + (row * CROW + col) * 2), "r"(lo));
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(smem + ((row + 8) * CROW + col) * 2), "r"(hi));
    }
}

// The staged tile's outputs [n0, n0 + 128) ([n0, n0 + 64) with silu_mul) of rows m0 .. m0+127.
__device__ __forceinline__ void store_tile(const Gemm& t, uint32_t smem, int m0, int n0) {
  const int width = t.silu ? BN / 2 : BN;
  for (int i = threadIdx.x; i < BM * (width / 8); i += NUM_THREADS) {
    const int r = i / (width / 8), c = (i % (width / 8)) * 8;
    if (m0 + r >= t.rows || n0 + c >= t.hi) continue;
    float f[8];
    dev::unpack8(dev::lds_v4(smem + (r * CROW + c) * 2), f);
    if (t.silu) {
      float up[8];
      dev::unpack8(dev::lds_v4(smem + (r * CROW + BN / 2 + c) * 2), up);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = dev::silu_mul_f32(f[e], up[e]);
    }
    const long long at = (long long)(m0 + r) * t.N + n0 + c;
    if (t.res) {
      float res[8];
      dev::unpack8(dev::ld_act_v4(t.resid + at), res);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = __fadd_rn(f[e], res[e]);
    }
    *reinterpret_cast<uint4*>(t.out + at) = dev::pack8(f);
  }
}

__device__ __forceinline__ void tile(const Gemm& t, uint32_t smem, int m0, int n0) {
  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
  const int nk = (t.K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(t, smem, s, s, m0, n0);
    dev::cp_async_commit();
  }
  for (int kt = 0; kt < nk; ++kt) {
    dev::cp_async_wait_group(STAGES - 2);  // k tile kt has landed (this thread's copies)
    mpk::task_sync();                      // ... everyone's; and slot (kt - 1) % STAGES is free
    const int next = kt + STAGES - 1;
    if (next < nk) load_stage(t, smem, next % STAGES, next, m0, n0);
    dev::cp_async_commit();
    mma_stage(smem, kt % STAGES, acc);
  }
  dev::cp_async_wait_all();
  mpk::task_sync();  // every warp is done with the stages: the tile reuses them
  stage_tile(smem, acc);
  mpk::task_sync();
  store_tile(t, smem, m0, n0);
  mpk::task_sync();  // the next tile's copies overwrite the staged tile
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
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
  const uint32_t smem = dev::smem_addr(a.smem);
  const int width = t.silu ? detail::BN / 2 : detail::BN;
  for (int n0 = t.lo; n0 < t.hi; n0 += width)
    for (int m0 = 0; m0 < t.rows; m0 += detail::BM) detail::tile(t, smem, m0, n0);
}


}  // namespace mpk::kinds::gemm
