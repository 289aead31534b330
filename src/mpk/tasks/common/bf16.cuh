// bf16 <-> fp32 conversions and the shared rounding rules (see mpk/tasks/numerics.py).
//
// All math is fp32; a value becomes bf16 (round to nearest even, as torch's .to(bfloat16)) exactly
// where the torch reference rounds. The explicit __fmul_rn/__fadd_rn forms are used where the
// reference does separate fp32 operations, so nvcc cannot contract them into an FMA.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace mpk::dev {

// Low / high bf16 of a packed pair as fp32 (exact).
__device__ __forceinline__ float bf16lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// fp32 -> bf16 bits (round to nearest even, NaN stays NaN).
__device__ __forceinline__ uint32_t f2bf_bits(float x) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(x)));
}
// Two fp32 -> packed bf16x2 (lo = a, hi = b), one cvt.rn.bf16x2.f32.
__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
// The value a bf16 store would hold, back in fp32 (numerics.bf16).
__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ __nv_bfloat16 to_bf16(float x) { return __float2bfloat16_rn(x); }

// 8 bf16 (one 16-byte vector) -> 8 fp32.
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  f[0] = bf16lo(v.x); f[1] = bf16hi(v.x);
  f[2] = bf16lo(v.y); f[3] = bf16hi(v.y);
  f[4] = bf16lo(v.z); f[5] = bf16hi(v.z);
  f[6] = bf16lo(v.w); f[7] = bf16hi(v.w);
}
// 8 fp32 -> 8 bf16 (rounded) in one 16-byte vector.
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 v;
  v.x = pack_bf16x2(f[0], f[1]);
  v.y = pack_bf16x2(f[2], f[3]);
  v.z = pack_bf16x2(f[4], f[5]);
  v.w = pack_bf16x2(f[6], f[7]);
  return v;
}

// silu(g) = g / (1 + exp(-g)) in fp32 (fast exp and divide: their error, ~1e-6 relative, is far
// below the bf16 rounding that always follows). Used by silu_mul and linear's silu_mul prologue
// so the fused and unfused paths produce identical bits.
__device__ __forceinline__ float silu_f32(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

// numerics.silu_mul on one element: bf16(bf16(silu(gate)) * up).
__device__ __forceinline__ float silu_mul_f32(float gate, float up) {
  return round_bf16(__fmul_rn(round_bf16(silu_f32(gate)), up));
}

// numerics.rmsnorm_rows on one element given the row's inverse rms:
// bf16(w * bf16(x * inv)).
__device__ __forceinline__ float rmsnorm_elem(float x, float inv, float w) {
  return round_bf16(__fmul_rn(w, round_bf16(__fmul_rn(x, inv))));
}
// inv = rsqrt(mean + eps) as torch computes it (1 / sqrt, IEEE), independent of fast-math flags.
__device__ __forceinline__ float rms_inv(float sumsq, int n, float eps) {
  float mean = __fdiv_rn(sumsq, static_cast<float>(n));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}

}  // namespace mpk::dev
