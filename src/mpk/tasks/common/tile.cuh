// Tensor-core tile helpers for the kinds that multiply many rows at once (gemm,
// attention_prefill): ldmatrix fragment loads from padded shared-memory tiles and zero-filling
// asynchronous copies of activation rows.
#pragma once
#include <stdint.h>

namespace mpk::dev {

// Four 8x8 bf16 matrices from shared memory: lane l gives the address of row l % 8 of matrix
// l / 8; register i receives matrix i in the mma fragment layout (reduce.cuh: lane (g, t) holds
// row g, elements 2t and 2t + 1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                            uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
// The same, each matrix transposed (lane (g, t) holds column g, rows 2t and 2t + 1).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                                  uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// 16 bytes of an ACTIVATION (through L2, like ld_act_*) into shared memory, or zeros when
// `valid` is false (nothing is read). Completion: cp_async_commit / cp_async_wait_group.
__device__ __forceinline__ void cp_async_act16_or_zero(uint32_t smem_dst, const void* gmem_src,
                                                       bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_dst), "l"(gmem_src),
               "r"(valid ? 16 : 0)
               : "memory");
}

}  // namespace mpk::dev
