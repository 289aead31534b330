// rmsnorm, sm_90a: out[r, :] = bf16(w * bf16(x[r, :] * rsqrt(mean(x[r, :]^2) + eps))).
//
// Layouts (default splits): x and out split along rows only; the operand pointers point at the
// tile's first row, rows contiguous with stride `hidden`; `rows` = rows in this tile.
// Rows are staged in shared memory with cp.async (activations, through L2), in groups that fit
// (a flagged x, common/flags.cuh: polled a vector a thread at a time; task.py flags x only
// when H % 8 == 0, so the vector path takes it);
// the sum of squares of each row is reduced per warp and then over the 8 warps in a fixed order
// (deterministic); the normalised rows are written from shared memory.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/flags.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"

namespace mpk::kinds::rmsnorm {
namespace detail {

// Vectors 0 .. n-1 of a flagged tile (vector i: words 4i .. 4i+3) into xs as bf16, one a thread
// at a time (dev::poll8). At batch 1 that is one vector a thread at H = 2,048; more in flight
// (the linear's poll_stage) cost the all-kinds and prefill builds 200-400 B of spills.
__device__ __forceinline__ void poll_rows(__nv_bfloat16* xs, const dev::flag_word* words, int n,
                                          uint32_t ep) {
  const dev::Poll poll;
  for (int idx = threadIdx.x; idx < n; idx += NUM_THREADS)
    *reinterpret_cast<uint4*>(xs + idx * 8) = dev::poll8(words + idx * 4, ep, poll);
}

}  // namespace detail

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using bf16 = __nv_bfloat16;
  constexpr int kWarps = NUM_THREADS / 32;
  const int rows = a.i(P_ROWS), H = a.i(P_HIDDEN);
  const float eps = a.f(P_EPS);
  const bf16* x = a.operand<const bf16>(O_X);
  const bf16* w = a.operand<const bf16>(O_WEIGHT);
  bf16* out = a.operand<bf16>(O_OUT);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t x_ep = dev::flag_epoch<FLAGGED>(a, O_X);
  // A flagged x always takes the vector path, the only one that polls: task.py flags x only when
  // H % 8 == 0 (its words are then 16-byte aligned), out is in the arena and a bound weight is
  // 16-byte aligned (CudaExecutor.bind).
  const bool vec = x_ep != 0u || ((H % 8 == 0) && dev::aligned16(x) && dev::aligned16(w) &&
                                  dev::aligned16(out));

  float* red = reinterpret_cast<float*>(a.smem);  // [group rows][kWarps]
  if (!vec) {
    // Scalar fallback: one row at a time from global memory.
    for (int r = 0; r < rows; ++r) {
      const bf16* xr = x + (long long)r * H;
      float ss = 0.f;
      for (int k = tid; k < H; k += NUM_THREADS) {
        const float f = dev::ld_act_bf16f(xr + k);
        ss = fmaf(f, f, ss);
      }
      ss = dev::warp_sum(ss);
      if (lane == 0) red[warp] = ss;
      mpk::task_sync();
      float t = 0.f;
      for (int i = 0; i < kWarps; ++i) t += red[i];
      const float inv = dev::rms_inv(t, H, eps);
      for (int k = tid; k < H; k += NUM_THREADS)
        out[(long long)r * H + k] =
            dev::to_bf16(dev::rmsnorm_elem(dev::ld_act_bf16f(xr + k), inv, dev::ld_weight_bf16f(w + k)));
      mpk::task_sync();
    }
    return;
  }

  const int vpr = H / 8;
  // Rows per group: staged rows (H bf16 each) plus the per-row reduction slots must fit.
  int group = (SMEM_BYTES - 64) / (H * 2 + kWarps * 4 + 4);
  group = max(1, min(group, rows));
  float* inv = red + group * kWarps;
  bf16* xs = reinterpret_cast<bf16*>(a.smem + ((group * (kWarps + 1) * 4 + 15) / 16) * 16);
  for (int r0 = 0; r0 < rows; r0 += group) {
    const int nr = min(group, rows - r0);
    if (x_ep != 0u) {
      const dev::flag_word* words = dev::flag_operand<const dev::flag_word>(a, O_X);
      detail::poll_rows(xs, words + (long long)r0 * H / 2, nr * vpr, x_ep);
    } else {
      const bf16* src = x + (long long)r0 * H;
      for (int idx = tid; idx < nr * vpr; idx += NUM_THREADS)
        dev::cp_async_act16(xs + (long long)idx * 8, src + (long long)idx * 8);
      dev::cp_async_wait_all();
    }
    mpk::task_sync();
    for (int r = 0; r < nr; ++r) {
      float ss = 0.f;
      for (int v = tid; v < vpr; v += NUM_THREADS) {
        float f[8];
        dev::unpack8(*reinterpret_cast<const uint4*>(xs + (long long)r * H + v * 8), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
      }
      ss = dev::warp_sum(ss);
      if (lane == 0) red[r * kWarps + warp] = ss;
    }
    mpk::task_sync();
    if (tid < nr) {
      float t = 0.f;
      for (int i = 0; i < kWarps; ++i) t += red[tid * kWarps + i];
      inv[tid] = dev::rms_inv(t, H, eps);
    }
    mpk::task_sync();
    for (int idx = tid; idx < nr * vpr; idx += NUM_THREADS) {
      const int r = idx / vpr, v = idx - r * vpr;
      float fx[8], fw[8], fo[8];
      dev::unpack8(*reinterpret_cast<const uint4*>(xs + (long long)idx * 8), fx);
      dev::unpack8(dev::ld_weight_v4(w + v * 8), fw);
      const float ir = inv[r];
#pragma unroll
      for (int e = 0; e < 8; ++e) fo[e] = dev::rmsnorm_elem(fx[e], ir, fw[e]);
      *reinterpret_cast<uint4*>(out + (long long)(r0 + r) * H + v * 8) = dev::pack8(fo);
    }
    mpk::task_sync();  // xs / red are reused by the next group
  }
}

}  // namespace mpk::kinds::rmsnorm
