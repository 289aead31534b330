// Counter-based Gumbel noise for sampling in a kernel epilogue (tasks/sampling.py says why; this
// computes the same bits: splitmix64 finaliser, a 24-bit uniform in (0, 1)).
#pragma once
#include <stdint.h>

namespace mpk::dev {

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
