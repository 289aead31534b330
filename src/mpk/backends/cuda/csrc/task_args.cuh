// TaskArgs: what a task kind's device function sees of its task.
//
// rec     : the task's instruction record (layout constants REC_* are generated from
//           mpk/compiler/record.py into the megakernel source before this header is included).
// params  : the op's parameter row (PARAM_WORDS int32; floats are stored as their IEEE bits).
//           Each kind's param indices are generated as constants P_<NAME> in its namespace.
// tensors : the tensor table: device base pointer of every tensor of the Plan.
// step    : the LOCAL decode step inside this launch (0 .. num_steps-1).
// smem    : this CTA's dynamic shared memory (SMEM_BYTES, generated).
// p       : the launch's Params (the global step, the watchdog, the tensor-parallel peers),
//           only for kinds that declare reads_launch_params in task.py (nullptr otherwise).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "params.cuh"
#include "ptx.cuh"

// How a kind declares its entry point: `MPK_TASK_ENTRY void run(const mpk::TaskArgs& a)`.
// Force-inlined into the dispatch switch: as an out-of-line (__noinline__) ABI call, every task
// pays callee-saved register saves, and with all nine kinds the megakernel spilled 508 B / 708 B
// with a 368 B stack frame; inlined, the same code compiled to 255 registers and 0 spills.
// (-DMPK_TASK_ENTRY='__device__ __noinline__' builds the other way, e.g. to read per-kind
// ptxas numbers.)
#ifndef MPK_TASK_ENTRY
#define MPK_TASK_ENTRY __device__ __forceinline__
#endif

namespace mpk {

// Barrier among the task's NUM_THREADS threads. Tasks should use this rather than a raw
// __syncthreads(): a later runtime may run a controller warp beside the task threads (waits,
// prefetch and signals off the task's critical path), and then this becomes a named barrier
// over the task threads only.
__device__ __forceinline__ void task_sync() { __syncthreads(); }

struct TaskArgs {
  const int* rec;
  const int* params;
  void* const* tensors;
  int step;
  char* smem;
  const Params* p;

  // Pointer to the first element of operand `slot`'s TILE (tile offset already applied), or
  // nullptr when the optional operand is absent. Slots are generated per kind as O_<NAME>.
  template <class T>
  __device__ __forceinline__ T* operand(int slot) const {
    const int* o = rec + REC_OPERANDS + REC_OPERAND_STRIDE * slot;
    if (o[0] < 0) return nullptr;
    long long off = (long long)(unsigned)o[1] | ((long long)(unsigned)o[2] << 32);
    return reinterpret_cast<T*>(tensors[o[0]]) + off;
  }
  // Base pointer of the WHOLE tensor behind operand `slot` (for data-dependent access such as
  // paged KV caches or embedding rows, where the tile offset is only the split's start).
  template <class T>
  __device__ __forceinline__ T* base(int slot) const {
    const int* o = rec + REC_OPERANDS + REC_OPERAND_STRIDE * slot;
    return o[0] < 0 ? nullptr : reinterpret_cast<T*>(tensors[o[0]]);
  }
  __device__ __forceinline__ bool has(int slot) const {
    return rec[REC_OPERANDS + REC_OPERAND_STRIDE * slot] >= 0;
  }
  __device__ __forceinline__ int i(int p) const { return params[p]; }
  __device__ __forceinline__ float f(int p) const { return __int_as_float(params[p]); }
  // Grid coordinate of this task along axis 0, 1 or 2.
  __device__ __forceinline__ int point(int axis) const { return rec[REC_POINT + axis]; }
};

}  // namespace mpk
