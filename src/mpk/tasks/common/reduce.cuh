// Warp reductions and the bf16 tensor-core MMA used by the matrix-vector kernels.
#pragma once
#include <stdint.h>

namespace mpk::dev {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// True when (va, ia) beats (vb, ib) for an argmax: larger value wins, NaN beats everything (as
// torch.max / torch.argmax propagate NaN), ties go to the lower index.
__device__ __forceinline__ bool argmax_better(float va, int ia, float vb, int ib) {
  const bool na = va != va, nb = vb != vb;
  if (na || nb) return na && (!nb || ia < ib);
  return va > vb || (va == vb && ia < ib);
}
// Warp-wide argmax: every lane ends with the winner.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, off);
    int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (argmax_better(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + C, fp32 accumulate (mma.sync, sm_80+).
// Fragment layout (g = lane / 4, t = lane % 4):
//   a0 = {A[g][2t], A[g][2t+1]}, a1 = {A[g+8][2t], ..}, a2 = {A[g][2t+8], ..}, a3 = {A[g+8][2t+8], ..}
//   b0 = {B[2t][g], B[2t+1][g]},  b1 = {B[2t+8][g], B[2t+9][g]}
//   c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1]
__device__ __forceinline__ void mma_bf16_16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Sixteen warp sums at once: lane l ends with row l / 2's sum over the warp of the lanes' values
// ss[row] (linear's rmsnorm: every staged row's sum of squares). Each exchange step halves the
// rows a lane keeps (the upper half when the lane's bit is set; 8, 4, 2, 1 rows), then one
// butterfly: 16 shuffles in 5 dependent steps, where a warp sum per row was 5 dependent
// shuffles each, row after row (~0.2 us a row at batch 16: perf-log, twelfth session). One
// width for every batch: a second instance put ss in local memory (ptxas).
template <int kHalf>
__device__ __forceinline__ void keep_half(float (&ss)[16], int lane) {
  const bool up = (lane & (2 * kHalf)) != 0;
#pragma unroll
  for (int r = 0; r < kHalf; ++r) {
    const float lo = ss[r], hi = ss[r + kHalf];  // values, not a chosen address: registers
    ss[r] = (up ? hi : lo) + __shfl_xor_sync(0xffffffffu, up ? lo : hi, 2 * kHalf);
  }
}
__device__ __forceinline__ float rows_sum16(float (&ss)[16]) {
  const int lane = threadIdx.x & 31;
  keep_half<8>(ss, lane);
  keep_half<4>(ss, lane);
  keep_half<2>(ss, lane);
  keep_half<1>(ss, lane);
  return ss[0] + __shfl_xor_sync(0xffffffffu, ss[0], 1);
}

}  // namespace mpk::dev
