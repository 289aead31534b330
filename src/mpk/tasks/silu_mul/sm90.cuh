// silu_mul, sm_90a: out[b, i] = bf16(bf16(silu(x[b, 0, i])) * x[b, 1, i]) for one tile of I.
//
// Layouts (default splits): x [B, 2, I] split along dim 2, out [B, I] split along dim 1, so the
// operand pointers point at column i0 of row 0 with full-tensor strides (gate row b at
// x + b*2*I, up row at x + b*2*I + I, out row b at out + b*I). Same element function as linear's
// silu_mul prologue (common/bf16.cuh), so the fused and unfused paths give identical bits.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"

namespace mpk::kinds::silu_mul {

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using bf16 = __nv_bfloat16;
  const int B = a.i(P_BATCH), I = a.i(P_INTER), TI = a.i(P_TILE_I);
  const bf16* x = a.operand<const bf16>(O_X);
  bf16* out = a.operand<bf16>(O_OUT);
  const bool vec = (TI % 8 == 0) && (I % 8 == 0) && dev::aligned16(x) && dev::aligned16(out);
  if (vec) {
    const int vpr = TI / 8;
    for (int idx = threadIdx.x; idx < B * vpr; idx += NUM_THREADS) {
      const int b = idx / vpr, v = idx - b * vpr;
      const bf16* row = x + (long long)b * 2 * I + v * 8;
      const uint4 gv = dev::ld_act_v4(row), uv = dev::ld_act_v4(row + I);
      float g[8], u[8], o[8];
      dev::unpack8(gv, g);
      dev::unpack8(uv, u);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = dev::silu_mul_f32(g[e], u[e]);
      *reinterpret_cast<uint4*>(out + (long long)b * I + v * 8) = dev::pack8(o);
    }
  } else {
    for (int idx = threadIdx.x; idx < B * TI; idx += NUM_THREADS) {
      const int b = idx / TI, i = idx - b * TI;
      const bf16* row = x + (long long)b * 2 * I + i;
      const float o = dev::silu_mul_f32(dev::ld_act_bf16f(row), dev::ld_act_bf16f(row + I));
      out[(long long)b * I + i] = dev::to_bf16(o);
    }
  }
}

}  // namespace mpk::kinds::silu_mul
