// TaskArgs: what a task kind's device function sees of its task.
//
// A task runs on the CONSUMER warps only: NUM_THREADS threads (threadIdx.x 0 .. NUM_THREADS-1).
// It synchronises them with mpk::task_sync() (a named barrier), never __syncthreads (the
// runtime's controller, loader and storer warps do not take part).
//
// rec     : the task's instruction record, in shared memory (layout constants REC_* are generated
//           from mpk/compiler/record.py into the megakernel source before this header).
// params  : the op's parameter row (PARAM_WORDS int32, floats as their IEEE bits), in shared
//           memory. Each kind's param indices are generated as constants P_<NAME>.
// base    : the device base pointer of every operand slot's tensor (0 when absent), resolved
//           by the controller before the task starts, in shared memory.
// step    : the LOCAL decode step inside this launch (0 .. num_steps-1).
// gstep   : the global step (low 32 bits): the epoch of flagged accesses (common/flags.cuh).
// smem    : this task's shared-memory scratch (SMEM_BYTES, generated from the plan).
// p       : the launch's Params, for kinds that declare reads_launch_params (else nullptr).
// pages   : the task's weight pages (kinds with a TaskKind.stream_layout): page i holds the
//           bytes of run-by-run cut i of the task's stream (record STREAM_RUNS). A kind with a
//           stream copies this cursor, visits its pages, and MUST call finish() on its copy
//           before returning (on every path).
// mark(i) : profiling builds stamp the task's INPUT (0) and COMPUTE (1) points; a no-op otherwise.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "params.cuh"
#include "ptx.cuh"

// How a kind declares its entry point: `MPK_TASK_ENTRY void run(const mpk::TaskArgs& a)`.
// Force-inlined into the dispatch switch: an out-of-line (__noinline__) ABI call makes every
// task pay callee-saved register saves (measured with the first runtime: spills and a 368 B
// stack frame, against none inlined).
#ifndef MPK_TASK_ENTRY
#define MPK_TASK_ENTRY __device__ __forceinline__
#endif

namespace mpk {

// For kinds that poll flagged data (common/flags.cuh Poll), in shared memory so that a task keeps
// no register for them: the launch's stop flag; the position (in this launch's walk of the list,
// steps included) of the record the consumers run; and that of the first record whose poll gave
// up because the launch was stopping (-1 before: the storer records it as where this CTA stopped).
__shared__ const int* launch_abort;
__shared__ int running_record;
__shared__ int gave_up_record;
// The launch's counters (Params::counters), for kinds with arrival counters (TaskKind.arrivals):
// read from here, a kind needs no TaskArgs::p (which costs one-split plans registers).
__shared__ unsigned long long* launch_counters;

// Barrier among the task's NUM_THREADS consumer threads (named barrier 1).
__device__ __forceinline__ void task_sync() { ptx::named_sync(1, NUM_THREADS); }
// task_sync that tells every consumer thread whether any of them passed `pred` true.
__device__ __forceinline__ bool task_sync_or(bool pred) {
  return ptx::named_sync_or(1, NUM_THREADS, pred);
}

// One consumer warp's view of its task's weight pages. Pages are visited in order: at(i)
// waits until page i has landed (releasing the pages before it); finish() releases the rest.
// Every consumer warp must wait for and release EVERY page of the task exactly once, in order,
// because a page's "empty" barrier counts one arrival per consumer thread per use. A warp that
// holds page i at a task_sync() must not make another warp need page i + NUM_PAGES before that
// barrier (its page slot cannot be refilled until the first warp releases it): keep barriers
// within a few pages of each other's reach (linear: at most 2 pages, NUM_PAGES >= 4). (The cursor is
// a value the kind owns: held in registers, not behind a pointer the compiler must keep in
// local memory.)
struct PageCursor {
  uint32_t ring;   // smem address of page slot 0 (slots are PAGE_BYTES apart)
  uint32_t full;   // smem address of full[0] (NUM_PAGES u64 barriers), empty[] right after
  uint32_t seq;    // ring sequence number of the task's page 0
  int count;       // pages of this task
  int cur;         // page this warp holds (waited for, not yet released); -1 before the first
  long long limit_ns;  // a page that has not landed after this long means a runtime bug: trap
  // Ring slot of page `cur` with its full-barrier parity in bit 31 (set by the first at()).
  // Kept as it moves instead of derived from seq: NUM_PAGES is rarely a power of two, and a
  // division per page per warp sat on the walk's critical path (ncu source counters,
  // perf-log). One register: every live value of the walk costs the big builds spills.
  uint32_t held = 0;

  // Shared-memory address of page i (cur <= i < count: pages are visited in order, and the
  // ones before cur are released), after waiting for it to land.
  __device__ __forceinline__ uint32_t at(int i) {
    while (cur < i) {
      if (cur >= 0) release_held();
      next();
      wait_for(held);
    }
    return ring + slot() * (uint32_t)PAGE_BYTES;
  }
  // Whether page cur + 1 has landed (cur >= 0), without blocking: a walk passes the answer to
  // peek(), which waits only when it is false (ncu, an older walk: the wait on a blocking check's
  // result, and the branches of at(), were half the walk).
  // Sound a page ahead: the slot's previous page (cur + 1 - NUM_PAGES <= cur) has landed, so
  // the phase tested is the next page's.
  __device__ __forceinline__ bool next_landed() const {
    const uint32_t h = after(held);
    return ptx::mbar_test_wait(full + 8u * (h & 0x7fffffffu), h >> 31);
  }
  // Page cur + 1's address once it has landed (`landed`: next_landed() said so), page cur still
  // held: a walk loads page cur + 1's fragments before its MMAs on page cur's, then steps.
  // Two pages held at once is sound for any ring of two pages or more (page cur + 1's slot held
  // page cur + 1 - NUM_PAGES < cur, released).
  __device__ __forceinline__ uint32_t peek(bool landed) const {
    const uint32_t h = after(held);
    if (!landed) wait_for(h);
    return ring + (h & 0x7fffffffu) * (uint32_t)PAGE_BYTES;
  }
  // From page cur (held) to page cur + 1, which a peek() saw land: release, advance.
  // Straight-line: the common step of a walk.
  __device__ __forceinline__ void step() {
    release_held();
    held = after(held);
    ++cur;
  }
  __device__ __forceinline__ void finish() {
    if (count == 0 || cur >= count) return;
    at(count - 1);
    release_held();
    cur = count;
  }

 private:
  __device__ __forceinline__ uint32_t slot() const { return held & 0x7fffffffu; }
  // The held word of the page after the one `h` describes.
  __device__ __forceinline__ static uint32_t after(uint32_t h) {
    return (h & 0x7fffffffu) + 1 == (uint32_t)NUM_PAGES ? (h & 0x80000000u) ^ 0x80000000u  // slot 0, next phase
                                                         : h + 1;
  }
  __device__ __forceinline__ void next() {  // cur -> cur + 1
    held = cur < 0 ? seq % NUM_PAGES | ((seq / NUM_PAGES) & 1u) << 31 : after(held);
    ++cur;
  }
  // Wait for the page the held word h describes to land; a page that never lands means a
  // runtime bug: trap.
  __device__ __forceinline__ void wait_for(uint32_t h) const {
    const uint32_t bar = full + 8u * (h & 0x7fffffffu), parity = h >> 31;
    if (!ptx::mbar_try_wait(bar, parity)) {
      const unsigned long long t0 = ptx::globaltimer();
      while (!ptx::mbar_try_wait(bar, parity))
        if (ptx::globaltimer() - t0 > (unsigned long long)limit_ns) __trap();
    }
  }
  // This thread is done reading page `cur`: every consumer thread arrives itself (the barrier
  // counts NUM_THREADS), so its reads are ordered before its own arrive with no warp sync and no
  // lane-0 branch on the walk.
  __device__ __forceinline__ void release_held() const {
    ptx::mbar_arrive(full + 8u * (NUM_PAGES + slot()));
  }
};

struct TaskArgs {
  const int* rec;
  const int* params;
  const unsigned long long* base;
  int step;
  uint32_t gstep;
  char* smem;
  const Params* p;
  PageCursor pages;
#ifdef MPK_PROFILE
  unsigned long long* marks;  // the record's INPUT and COMPUTE stamps (profiling builds only)
#endif

  // Profiling builds: stamp mark i (0: INPUT, 1: COMPUTE; codegen.PROFILE_STAMPS) now. Call it
  // from thread 0 after a task_sync() (or from every thread: thread 0's stamp is kept).
  __device__ __forceinline__ void mark(int i) const {
#ifdef MPK_PROFILE
    if (threadIdx.x == 0) marks[i] = ptx::globaltimer();
#endif
  }

  // Pointer to the first element of operand `slot`'s TILE (tile offset already applied), or
  // nullptr when the optional operand is absent. Slots are generated per kind as O_<NAME>.
  template <class T>
  __device__ __forceinline__ T* operand(int slot) const {
    if (base[slot] == 0ull) return nullptr;
    const int* o = rec + REC_OPERANDS + REC_OPERAND_STRIDE * slot;
    const long long off = (long long)(unsigned)o[1] | ((long long)(unsigned)o[2] << 32);
    return reinterpret_cast<T*>(base[slot]) + off;
  }
  __device__ __forceinline__ bool has(int slot) const { return base[slot] != 0ull; }
  __device__ __forceinline__ int i(int p) const { return params[p]; }
  __device__ __forceinline__ float f(int p) const { return __int_as_float(params[p]); }
  // Grid coordinate of this task along axis 0, 1 or 2.
  __device__ __forceinline__ int point(int axis) const { return rec[REC_POINT + axis]; }
};

}  // namespace mpk
