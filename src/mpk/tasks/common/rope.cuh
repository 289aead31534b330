// One head vector's RMSNorm and rotate-half RoPE, the rounding of tasks/attention/task.py
// (fp32, rounded to bf16 once), for a warp that holds the vector with lane l owning elements
// e = l + 32i (i < N, e < D). Shared by the decode attention's prepare and rope_append.
#pragma once
#include <cuda_bf16.h>

#include "bf16.cuh"
#include "reduce.cuh"

namespace mpk::dev {

// v: the vector's elements (in), cs / sn: the table's cos and sin for each element's column
// (e < D/2: column e, else e - D/2), w: the norm weight of each element (with `norm`), buf: this
// warp's D floats of shared memory (the RoPE partners cross lanes through it); store(e, value)
// takes each bf16 result. Every lane of the warp calls it; it ends with a __syncwarp (buf may be
// rewritten next).
template <int N, class Store>
__device__ __forceinline__ void norm_rope(float (&v)[N], const float (&cs)[N], const float (&sn)[N],
                                          const float (&w)[N], bool norm, int D, float eps,
                                          float* buf, Store store) {
  const int lane = threadIdx.x & 31, half = D / 2;
  if (norm) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) ss = fmaf(v[i], v[i], ss);
    const float inv = rms_inv(warp_sum(ss), D, eps);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = rmsnorm_elem(v[i], inv, w[i]);
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (lane + 32 * i < D) buf[lane + 32 * i] = v[i];
  __syncwarp();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = lane + 32 * i;
    if (e >= D) continue;
    const float o = e < half  // x1 * cos - x2 * sin | x2 * cos + x1 * sin
                        ? __fsub_rn(__fmul_rn(v[i], cs[i]), __fmul_rn(buf[e + half], sn[i]))
                        : __fadd_rn(__fmul_rn(v[i], cs[i]), __fmul_rn(buf[e - half], sn[i]));
    store(e, to_bf16(o));
  }
  __syncwarp();
}

}  // namespace mpk::dev
