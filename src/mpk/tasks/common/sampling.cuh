// Counter-based Gumbel noise for sampling in a kernel epilogue (tasks/sampling.py says why; this
// computes the same bits: splitmix64 finaliser, a 24-bit uniform in (0, 1)), and the ordered keys
// the argmax and the top-k / top-p selection rank values by. The SAMPLING row layout
// (SAMPLING_WORDS, SAMPLING_<FIELD>) is generated from tasks/sampling.py.
#pragma once
#include <stdint.h>

#include "memory.cuh"

namespace mpk::dev {

// uint32 keys in the order of the float values: -0 as +0, NaN above everything
// (tasks/sampling.py ordered_keys).
__device__ __forceinline__ uint32_t ordered_key(float v) {
  if (v == 0.f) v = 0.f;
  const uint32_t bits = __float_as_uint(v);
  if (v != v) return 0xffffffffu;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
__device__ __forceinline__ float ordered_value(uint32_t key) {
  if (key == 0xffffffffu) return __int_as_float(0x7fc00000);
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Argmax keys: larger key = better (value order, NaN highest; -0 ties with +0 as torch compares
// values, so the lower index wins; then the lower index).
__device__ __forceinline__ unsigned long long argmax_key(float v, int idx) {
  return ((unsigned long long)ordered_key(v) << 32) | (uint32_t)(~idx);
}
__device__ __forceinline__ float key_value(unsigned long long key) {
  return ordered_value((uint32_t)(key >> 32));
}
__device__ __forceinline__ int key_index(unsigned long long key) { return (int)~(uint32_t)key; }

// A row's 64-bit seed from its SAMPLING words (host-written IO: L2-coherent loads).
__device__ __forceinline__ unsigned long long sampling_seed(const int* words) {
  return (unsigned long long)(unsigned)ld_act_i32(words + SAMPLING_SEED_LO) |
         ((unsigned long long)(unsigned)ld_act_i32(words + SAMPLING_SEED_HI) << 32);
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// -log(-log(u)), u = U(seed, position, index).
__device__ __forceinline__ float gumbel(unsigned long long seed, long long position, int index) {
  const unsigned long long h1 = mix64(seed ^ mix64((unsigned long long)position +
                                                  0x9E3779B97F4A7C15ull));
  const unsigned long long h = mix64(h1 + (unsigned long long)(unsigned)index *
                                              0xD1B54A32D192ED03ull);
  const float u = ((float)(h >> 41) * 2.0f + 1.0f) * 5.9604644775390625e-08f;  // 2^-24
  return -logf(-logf(u));
}

}  // namespace mpk::dev
