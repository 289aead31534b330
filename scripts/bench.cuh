// What standalone benches share (stage_bench.cu, expert_bench.cu), on top of the runtime's
// ptx.cuh: a blocking mbarrier wait, a bulk copy with no L2 hint, and the grid phases' counter
// (every CTA waits for the others' previous phase, then signals its own, as the megakernel's
// tasks do).
#pragma once
#include <stdint.h>

#include "../src/mpk/backends/cuda/csrc/ptx.cuh"

namespace probe {

// Spin until the mbarrier phase of `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mpk::ptx::mbar_try_wait(bar, parity)) {
  }
}

// A bulk global -> shared copy completing on `bar`, with no L2 cache hint (ptx.cuh's
// bulk_copy_g2s evicts first, as the runtime's loader).
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Phase p may start once every CTA signalled phase p - 1 (one thread waits; a CTA barrier
// follows in the caller).
__device__ __forceinline__ void wait_phase(const unsigned long long* ctr, int p) {
  const unsigned long long target = (unsigned long long)p * gridDim.x;
  while (mpk::ptx::ld_acquire_u64(ctr) < target) {
  }
}
// This CTA's phase is done (one thread, after a CTA barrier): release its writes, count it.
__device__ __forceinline__ void signal_phase(unsigned long long* ctr) {
  mpk::ptx::fence_acq_rel_gpu();
  mpk::ptx::red_relaxed_add_u64(ctr, 1);
}

}  // namespace probe
