// Global-memory access helpers shared by the sm90 task kernels.
//
// Two load paths, never mixed up:
//  * ld_act_*    : ACTIVATIONS (anything another task may have written during this launch:
//                  x, residual, qkv, KV cache, logits, partials, tokens, positions, page tables).
//                  ld.global.cg: cached in L2 only, so a value written by another SM (and released
//                  by the runtime's signal) is seen; never the non-coherent / texture path.
//  * ld_weight_* : WEIGHTS (operands flagged weight=True; immutable for the whole launch).
//                  ld.global.nc.L1::no_allocate with a 256-byte L2 prefetch hint: read-only path,
//                  no L1 pollution, streaming.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace mpk::dev {

// ---- activations (L2-coherent) ----------------------------------------------------------------
__device__ __forceinline__ uint4 ld_act_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_act_v2(const void* p) {
  uint2 v;
  asm volatile("ld.global.cg.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_act_u32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 ld_act_f4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ float ld_act_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int ld_act_i32(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// ld_act_i32 where `pred` holds, else `otherwise`, as one predicated load (no branch: a load
// under a branch is issued where the branch lands, after what the compiler placed before it).
__device__ __forceinline__ int ld_act_i32_if(const int* p, bool pred, int otherwise) {
  int v = otherwise;
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.cg.s32 %0, [%1];\n}"
               : "+r"(v) : "l"(p), "r"((int)pred));
  return v;
}
// Straight into a 32-bit register (PTX zero-extends): no conversion instruction follows the
// load, so a caller that keeps the bits unused until later does not wait for them.
__device__ __forceinline__ uint32_t ld_act_u16(const void* p) {
  uint32_t v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// One bf16 activation as float.
__device__ __forceinline__ float ld_act_bf16f(const __nv_bfloat16* p) {
  return __uint_as_float(ld_act_u16(p) << 16);
}

// Asynchronous 16-byte copy of an ACTIVATION from global to shared memory through L2
// (cp.async.cg bypasses L1, so it is coherent like ld.global.cg). Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async_act16(void* smem_dst, const void* gmem_src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem_src) : "memory");
}
// Same for a WEIGHT (immutable): 16 bytes, or zeros when `valid` is false (src-size 0: nothing is
// read). Completion is tracked per thread with commit/wait groups.
__device__ __forceinline__ void cp_async_weight16(unsigned smem_dst, const void* gmem_src,
                                                  bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(smem_dst),
               "l"(gmem_src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Wait until at most `n` of this thread's most recent commit groups are pending (n in 0..7).
__device__ __forceinline__ void cp_async_wait_group(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}
// Wait until all of this thread's cp.async copies have landed (follow with a barrier).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// ---- weights (read-only, streaming) --------------------------------------------------------------
// Not volatile: the compiler may schedule these freely (weights never change during a launch).
__device__ __forceinline__ uint4 ld_weight_v4(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_weight_u16(const void* p) {
  unsigned short v;
  asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float ld_weight_bf16f(const __nv_bfloat16* p) {
  return __uint_as_float(ld_weight_u16(p) << 16);
}

// ---- shared memory through an explicit shared-window address (a.smem is a generic pointer) ------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint4 lds_v4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t lds_u32(unsigned addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace mpk::dev
