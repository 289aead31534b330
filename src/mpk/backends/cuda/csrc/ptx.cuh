// Small PTX wrappers used by the runtime (and usable by task kernels).
//
// Every asm that orders memory carries a "memory" clobber: without it the compiler may move
// ordinary loads/stores across the acquire/release (a pitfall of the original runtime, which
// relied on surrounding __syncthreads to paper over it).
#pragma once
#include <stdint.h>

namespace mpk::ptx {

// Acquire load at GPU scope: later reads by this thread (and, after a __syncthreads, by the
// whole CTA) see every write that happened before the matching release.
__device__ __forceinline__ unsigned long long ld_acquire_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Relaxed GPU-scope load: for flags that need freshness (bypasses a stale L1 line) but no ordering.
__device__ __forceinline__ int ld_relaxed_s32(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release add at GPU scope, no return value (a fire-and-forget reduction in L2).
__device__ __forceinline__ void red_release_add_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// System-scope acquire load: for flags that a PEER GPU releases (tensor parallelism).
__device__ __forceinline__ unsigned long long ld_acquire_sys_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// System-scope release store (possibly into a peer GPU's memory): every write this thread has
// observed (its own, and those it acquired) is visible to a peer that acquires the value.
__device__ __forceinline__ void st_release_sys_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Nanosecond wall clock shared by all SMs (the watchdog, and the stamps of profiling builds).
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Asynchronous L2 prefetch of [p, p + bytes): p 16-byte aligned, bytes a multiple of 16
// (sm_90+). A hint only: it never faults the kernel's progress and completes on its own.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

}  // namespace mpk::ptx
