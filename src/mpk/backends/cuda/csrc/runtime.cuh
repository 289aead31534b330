// The persistent megakernel: one CTA per SM walks its own list of task records.
//
// Included by the generated megakernel.cu AFTER the generated constants (REC_*, ERR_*,
// NUM_THREADS, SMEM_BYTES, PARAM_WORDS) and AFTER mpk::dispatch(kind, args) is defined.
//
// Protocol (see mpk/backends/base.py for the step/counter semantics):
//   for local step s in [0, num_steps), global step g = step_begin + s,
//     for each record of this SM's list, in order:
//       thread 0: L2-prefetch the NEXT record's weight ranges (weights never depend on this
//                 step's activations, so they may stream while we wait), then wait until
//                 counters[c] >= (g + 1 - prev) * count for each (c, count, prev) of the record
//                 (ld.acquire.gpu, bounded by the watchdog);
//       __syncthreads; all threads run the task; __syncthreads;
//       thread 0: __threadfence, then red.release.gpu add 1 to each signal counter.
//   Counters are never reset: they are monotonic over the executor's lifetime.
//   Profiling builds (MPK_PROFILE) also stamp %globaltimer per record into Params::profile:
//   WAIT before the prefetch and the waits, RUN after the barrier that follows them, END after
//   the signals (mpk/profile/timeline.py reads them).
//
// MEMORY-ORDERING CONTRACT FOR TASK KERNELS (sm90.cuh authors, read this):
//   * Only thread 0 performs the acquire; the CTA-wide __syncthreads that follows orders the
//     other threads after it. Activations (anything another task writes: ACTIVATION and IO
//     tensors, KV caches, tokens) MUST be read with L2-coherent loads: __ldcg / ld.global.cg,
//     or ld.acquire / ld.relaxed.gpu. Never use __ldg / ld.global.nc / const __restrict__ reads
//     for them: the non-coherent path and stale L1 lines can return the previous step's data.
//   * WEIGHT tensors are immutable during a launch: __ldg, TMA and any cached path are fine.
//   * Writes may be plain stores; the runtime's __syncthreads + __threadfence + release add
//     publishes them. Writes through the async proxy (TMA stores, cp.async.bulk to global)
//     must be completed and fenced by the task itself (cp.async.bulk.wait_group 0 and
//     fence.proxy.async) before it returns.
//   * A task must be written for exactly NUM_THREADS threads, may call __syncthreads, and owns
//     the whole dynamic shared memory (a.smem, SMEM_BYTES) for its duration only.
#pragma once
#include <stdint.h>

#include "params.cuh"
#include "ptx.cuh"
#include "task_args.cuh"

namespace mpk {

// Record ring in static shared memory. Four slots: while record k runs, warp 1 fills slot k+2
// and thread 0 reads slot k+1's prefetch ranges; after the task, thread 0 still reads record
// k's signals while warp 1 may already fill slot k+3. No slot is ever shared.
constexpr int RING = 4;
// Bulk L2 prefetches are issued in chunks of this many bytes (a multiple of 16).
constexpr uint32_t PREFETCH_CHUNK = 32u * 1024u;
// Counter values thread 0 has already acquired, direct-mapped by counter id. Counters only
// grow, so a wait whose target is already covered needs no new acquire: the earlier acquire
// load already ordered this CTA after the producers (saves an L2 round trip per task when
// several tasks of one op run on the same SM).
constexpr int SEEN = 32;
static_assert(REC_WORDS % 4 == 0, "records are copied as int4");
static_assert(REC_MAX_PREFETCH <= REC_WORDS / 4, "prefetch ranges are resolved by copy lanes");

struct __align__(16) Slot {  // 16-byte aligned: records are copied as int4
  int rec[REC_WORDS];
  // Prefetch ranges resolved to 16-byte aligned addresses (bytes == 0: none), so thread 0 does
  // not load the tensor table on its critical path.
  unsigned long long pf_addr[REC_MAX_PREFETCH];
  unsigned pf_bytes[REC_MAX_PREFETCH];
};

static_assert(sizeof(Slot) % 16 == 0, "ring slots must stay 16-byte aligned");

__device__ __forceinline__ long long join64(int lo, int hi) {
  return (long long)((unsigned long long)(unsigned)lo | ((unsigned long long)(unsigned)hi << 32));
}

// Fill a ring slot from record `src` with REC_WORDS/4 lanes (lane = 0 .. REC_WORDS/4 - 1).
// Records and the tensor table are immutable during a launch, so the read-only path is fine.
__device__ __forceinline__ void fetch_slot(Slot& dst, const int* src, void* const* tensors,
                                           int lane) {
  reinterpret_cast<int4*>(dst.rec)[lane] = __ldg(reinterpret_cast<const int4*>(src) + lane);
  if (lane < REC_MAX_PREFETCH) {
    const int* f = src + REC_PREFETCH + lane * REC_PREFETCH_STRIDE;
    const int id = __ldg(f);
    const unsigned bytes = (unsigned)__ldg(f + 3);
    unsigned long long lo = 0, hi = 0;
    if (id >= 0 && bytes != 0) {
      // Widened to 16-byte boundaries (allocations are >= 256-byte aligned, so this stays
      // inside the allocation).
      const unsigned long long base =
          __ldg(reinterpret_cast<const unsigned long long*>(tensors) + id);
      const unsigned long long start = base + join64(__ldg(f + 1), __ldg(f + 2));
      lo = start & ~15ull;
      hi = (start + bytes + 15) & ~15ull;
    }
    dst.pf_addr[lane] = lo;
    dst.pf_bytes[lane] = (unsigned)(hi - lo);
  }
}

// Thread 0: start streaming a slot's weight ranges into L2 (asynchronous; returns at once).
__device__ __forceinline__ void prefetch_slot(const Slot& slot) {
#pragma unroll
  for (int j = 0; j < REC_MAX_PREFETCH; ++j) {
    const unsigned long long end = slot.pf_addr[j] + slot.pf_bytes[j];
    for (unsigned long long a = slot.pf_addr[j]; a < end; a += PREFETCH_CHUNK) {
      const unsigned long long n = end - a < PREFETCH_CHUNK ? end - a : PREFETCH_CHUNK;
      ptx::prefetch_l2_bulk(reinterpret_cast<const void*>(a), (uint32_t)n);
    }
  }
}

// Thread 0: note where this CTA stopped, so the host can tell the root cause of a hang from the
// CTAs that were merely waiting behind it.
__device__ __forceinline__ void record_stop(const Params& p, int status, int sm, int index, int s,
                                            int wait) {
  int* st = p.sm_state + sm * SMS_WORDS;
  st[SMS_INDEX] = index;
  st[SMS_STEP] = s;
  st[SMS_WAIT] = wait;
  st[SMS_STATUS] = status;
}

#ifdef MPK_PROFILE
// Thread 0 of a profiling build: store the three stamps of record `index` in local step s.
// Called once, after the task: the WAIT and RUN stamps wait in shared memory meanwhile, so no
// stamp and no address is live in registers across a task (the kernel already uses all 255
// registers, so anything live across a task body would spill).
__device__ __forceinline__ void profile_record(const Params& p, int s, int sm, int index,
                                               unsigned long long t_wait,
                                               unsigned long long t_run,
                                               unsigned long long t_end) {
  if (p.profile == nullptr) return;
  unsigned long long* row =
      p.profile + (((long long)s * gridDim.x + sm) * p.max_len + index) * PROF_STAMPS;
  row[PROF_WAIT] = t_wait;
  row[PROF_RUN] = t_run;
  row[PROF_END] = t_end;
}
#endif

// Thread 0: satisfy every wait of `rec` for local step s. False when this CTA must stop (its
// own wait timed out, or another CTA raised the abort flag).
__device__ __forceinline__ bool wait_record(const Params& p, const int* rec, int s, int sm,
                                            int index, int* seen_ctr,
                                            unsigned long long* seen_val) {
  const long long g = p.step_begin + s;
  const int n = rec[REC_NUM_WAITS];
  for (int w = 0; w < n; ++w) {
    const int* wt = rec + REC_WAITS + w * REC_WAIT_STRIDE;
    const int c = wt[0];
    const unsigned long long target =
        (unsigned long long)(g + 1 - wt[2]) * (unsigned long long)(unsigned)wt[1];
    const int slot = c & (SEEN - 1);
    if (seen_ctr[slot] == c && seen_val[slot] >= target) continue;
    const unsigned long long* ctr = p.counters + c;
    unsigned long long v = ptx::ld_acquire_u64(ctr);
    if (v >= target) {
      seen_ctr[slot] = c;
      seen_val[slot] = v;
      continue;
    }
    // Slow path: spin. The timer and the abort flag are read on every spin; both loads overlap
    // the counter load, and a spin is an L2 round trip anyway.
    const unsigned long long t0 = ptx::globaltimer();
    for (;;) {
      v = ptx::ld_acquire_u64(ctr);
      if (v >= target) {
        seen_ctr[slot] = c;
        seen_val[slot] = v;
        break;
      }
      if (ptx::ld_relaxed_s32(p.abort_flag)) {
        record_stop(p, SMS_STATUS_WAITING, sm, index, s, w);
        return false;
      }
      if (ptx::globaltimer() - t0 > (unsigned long long)p.timeout_ns) {
        record_stop(p, SMS_STATUS_WAITING, sm, index, s, w);
        report_failure(p.error, p.abort_flag, ERR_CODE_TIMEOUT, sm, rec, index, c, v, target, g);
        return false;
      }
    }
  }
  return true;
}

}  // namespace mpk

#ifdef MPK_TASK_PARAMS
// A kind of this plan reads the launch's Params (TaskArgs::p): __grid_constant__ lets it take
// &p without the kernel copying Params to local memory. Plans without such a kind keep the
// plain parameter, whose code is the one measured on the H200 (the qualifier alone changes
// the generated code).
#define MPK_PARAMS_DECL const __grid_constant__ mpk::Params p
#define MPK_PARAMS_PTR (&p)
#else
#define MPK_PARAMS_DECL const mpk::Params p
#define MPK_PARAMS_PTR nullptr
#endif

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1) mpk_megakernel(MPK_PARAMS_DECL) {
  using namespace mpk;
  extern __shared__ __align__(1024) char dyn_smem[];
  __shared__ __align__(16) Slot ring[RING];
  __shared__ int seen_ctr[SEEN];
  __shared__ unsigned long long seen_val[SEEN];
  __shared__ int s_stop;
#ifdef MPK_PROFILE
  __shared__ unsigned long long s_stamp[2];  // WAIT and RUN stamps of the running record
#endif

  const int tid = threadIdx.x;
  const int sm = blockIdx.x;
  const int len = p.lengths[sm];
  const long long total = (long long)len * p.num_steps;  // records this CTA runs in this launch
  if (total == 0) return;
  const int* list = p.instrs + (long long)sm * p.max_len * REC_WORDS;
  constexpr int kCopyLanes = REC_WORDS / 4;

  // Prologue: records 0 and 1 of the launch, and the first record's weights (every later
  // record's weights are prefetched while its predecessor waits).
  if (tid < kCopyLanes) {
    fetch_slot(ring[0], list, p.tensors, tid);
    if (total > 1) fetch_slot(ring[1], list + (1 % len) * REC_WORDS, p.tensors, tid);
  }
  if (tid < SEEN) seen_ctr[tid] = -1;
  __syncthreads();
  if (tid == 0) prefetch_slot(ring[0]);

  int i = 0;       // index in this SM's list
  int s = 0;       // local step
  for (long long k = 0; k < total; ++k) {
    const int* rec = ring[k & (RING - 1)].rec;
    // Warp 1 fetches record k+2 into the ring; it is consumed one iteration later, after at
    // least two __syncthreads, so no extra barrier is needed.
    if (tid >= 32 && tid < 32 + kCopyLanes && k + 2 < total) {
      fetch_slot(ring[(k + 2) & (RING - 1)], list + ((i + 2) % len) * REC_WORDS, p.tensors,
                 tid - 32);
    }
    if (tid == 0) {
#ifdef MPK_PROFILE
      // Before the waits: from the previous record's END to here is loop overhead only.
      s_stamp[0] = ptx::globaltimer();
#endif
      if (k + 1 < total) prefetch_slot(ring[(k + 1) & (RING - 1)]);
      s_stop = wait_record(p, rec, s, sm, i, seen_ctr, seen_val) ? 0 : 1;
    }
    __syncthreads();
    if (s_stop) return;
#ifdef MPK_PROFILE
    // After the barrier that releases the CTA: the task starts now. (Stamping inside thread 0's
    // wait block instead made ptxas spill: the kernel sits at 255 registers.)
    if (tid == 0) s_stamp[1] = ptx::globaltimer();
#endif

    const TaskArgs a{rec, p.op_params + (long long)rec[REC_OP] * PARAM_WORDS, p.tensors, s,
                     dyn_smem, MPK_PARAMS_PTR};
    if (!dispatch(rec[REC_KIND], a)) {  // uniform across the CTA: every thread returns
      if (tid == 0) {
        record_stop(p, SMS_STATUS_BAD_KIND, sm, i, s, -1);
        report_failure(p.error, p.abort_flag, ERR_CODE_BAD_KIND, sm, rec, i, -1, 0, 0,
                       p.step_begin + s);
      }
      return;
    }
    __syncthreads();
#ifdef MPK_TASK_PARAMS
    // A task that waits on its own (the tensor-parallel all-reduce waits for its peers) may
    // have stopped the launch: its consumers must not be signalled for data it never wrote.
    if (tid == 0 && ptx::ld_relaxed_s32(p.abort_flag)) {
      record_stop(p, SMS_STATUS_PEER, sm, i, s, -1);
      s_stop = 1;
    }
    __syncthreads();
    if (s_stop) return;
#endif
    if (tid == 0) {
      // The barrier orders every thread's stores before thread 0; the fence plus the release
      // make them visible GPU-wide before any consumer's acquire can see the new count.
      __threadfence();
      const int n = rec[REC_NUM_SIGNALS];
      for (int j = 0; j < n; ++j) ptx::red_release_add_u64(p.counters + rec[REC_SIGNALS + j], 1ull);
#ifdef MPK_PROFILE
      profile_record(p, s, sm, i, s_stamp[0], s_stamp[1], ptx::globaltimer());
#endif
    }
    if (++i == len) {
      i = 0;
      ++s;
    }
  }
}
