// The persistent megakernel: one CTA per SM walks its own list of task records with warp roles.
//
// Included by the generated megakernel.cu AFTER the generated constants (REC_*, ERR_*,
// NUM_THREADS, NUM_PAGES, PAGE_BYTES, SMEM_BYTES, ...) and AFTER mpk::dispatch(kind, args).
//
// Roles (RUNTIME_THREADS = NUM_THREADS consumers + one warpgroup of producers):
//   consumers  (warps 0 .. NUM_THREADS/32-1) run the tasks, one record at a time, in list order;
//   fetcher    (warp FETCHER_WARP) fetches record k into ring slot k % NUM_SLOTS and resolves
//              its params and operand pointers into the slot as soon as the slot is free: up to
//              NUM_SLOTS records ahead of the consumers, whatever their counters say, so the
//              loader learns of upcoming weights early;
//   controller (lane 0 of CONTROLLER_WARP) waits on the counters of each fetched record, in
//              order, and marks it ready (measured: with fetch and wait in one loop the loader
//              saw one record ahead only, and weights arrived just in time);
//   loader     (one lane of LOADER_WARP) streams every record's weight pages (record
//              STREAM_RUNS) into a ring of NUM_PAGES shared-memory pages with bulk copies, as far
//              ahead as free pages allow: across tasks, ops and layers, because weights never
//              depend on activations;
//   storer     (one lane of STORER_WARP) waits until the consumers finish a record, fences and
//              release-adds its signal counters, and frees the slot.
// Waits a record marks POLLED (compiler/flags.py) are skipped by the controller: the task polls
// the producers' flagged data itself, and the storer is its watchdog.
// Hand-offs are mbarriers (parity waits; every role walks the same records in the same order):
//   slot s:  loaded (fetcher -> controller, loader, consumers' prologue), ready (controller ->
//            consumers),
//            done (8 consumer warps -> storer), freed (storer AND loader -> fetcher: the
//            loader must be done reading a slot before it is refilled, even when the consumers
//            never waited for it, e.g. records without pages)
//   page p:  full (loader's bulk copy -> consumers, with a byte count),
//            empty (every consumer thread -> loader)
// Step protocol (see mpk/backends/base.py): for local step s in [0, num_steps), global step
// g = step_begin + s, every record of this SM's list, in order; a wait (c, count, prev) needs
// counters[c] >= (g + 1 - prev) * count. Counters are monotonic over the executor's lifetime.
//
// MEMORY-ORDERING CONTRACT FOR TASK KERNELS (sm90.cuh authors, read this):
//   * The controller's ld.acquire.gpu of the counters, then its mbarrier arrive (release.cta)
//     and the consumers' wait (acquire.cta) order every task thread after the producers' writes.
//     Activations (anything another task writes: ACTIVATION and IO tensors, KV caches, tokens)
//     MUST be read with L2-coherent loads: __ldcg / ld.global.cg, or ld.acquire / ld.relaxed.gpu.
//     Never __ldg / ld.global.nc for them: the non-coherent path can return stale data.
//   * WEIGHT tensors are immutable during a launch: __ldg and any cached path are fine; weight
//     pages are ready to read once PageCursor::at returns.
//   * Writes may be plain stores: each consumer warp's __syncwarp + arrive on `done`, then the
//     storer's __threadfence + red.release.gpu publish them. Writes through the async proxy must
//     be completed and fenced by the task itself before it returns.
//   * A kind's prologue(a) (task.py prologue_operands) runs on the consumers BEFORE the
//     record's waits are met: it may read only its prologue operands (tensors no task writes)
//     and the params, write only a.smem, touch no weight page, and end with mpk::task_sync()
//     so that run(a) sees what it staged. run(a) follows on the same threads.
//   * A task runs on exactly NUM_THREADS threads, synchronises them with mpk::task_sync() (never
//     __syncthreads), owns a.smem (SMEM_BYTES) for its duration only, and has every warp visit
//     every weight page of its record in order (its copy of a.pages, finish() before returning).
// Failures: a counter wait that exceeds the watchdog (or sees another CTA's abort) stops the
// controller; it marks the slot stopped, the consumers leave when they reach it, then the loader
// and the storer leave. A wait that can only hang through a bug in this file traps after
// INTERNAL_TIMEOUT_FACTOR watchdog periods (the host sees a launch failure, never a hang).
#pragma once
#include <stdint.h>

#include "params.cuh"
#include "ptx.cuh"
#include "task_args.cuh"

namespace mpk {

constexpr int NUM_SLOTS = 8;  // record ring (power of two)
constexpr int CONSUMER_WARPS = NUM_THREADS / 32;
constexpr int CONTROLLER_WARP = CONSUMER_WARPS;
constexpr int LOADER_WARP = CONSUMER_WARPS + 1;
constexpr int STORER_WARP = CONSUMER_WARPS + 2;
constexpr int FETCHER_WARP = CONSUMER_WARPS + 3;
constexpr int RUNTIME_THREADS = NUM_THREADS + 128;  // + one producer warpgroup
constexpr int INTERNAL_TIMEOUT_FACTOR = 8;
// Register budgets per role (setmaxnreg): 8 x 32 x 232 + 4 x 32 x 40 = 64,512 of 65,536.
constexpr uint32_t CONSUMER_REGS = 232;
constexpr uint32_t PRODUCER_REGS = 40;
// Counter values the controller has already acquired, direct-mapped by counter id: a wait whose
// target is covered needs no new acquire (the earlier one already ordered this CTA).
constexpr int SEEN = 32;
static_assert(NUM_THREADS % 128 == 0, "consumers are whole warpgroups (setmaxnreg)");
static_assert(REC_WORDS % 4 == 0 && PARAM_WORDS % 4 == 0, "records are copied as int4");
static_assert(REC_WORDS / 4 <= 32 && REC_MAX_OPERANDS < 32, "one controller lane per piece");

struct __align__(16) Slot {
  int rec[REC_WORDS];
  int params[PARAM_WORDS];
  unsigned long long base[REC_MAX_OPERANDS];  // operand tensors' base pointers (0: absent)
  unsigned long long stream;                  // this task's weight stream (0: none)
  unsigned long long t_wait, t_run;           // profiling stamps
  int step, index, stop, bad_kind;
  uint32_t page_seq;                          // ring sequence number of the record's page 0
  uint32_t gstep;                             // global step, low 32 bits (flag epochs)
  int pad[2];
  // Profiling stamps, placed last so t_wait keeps the offset scripts/probe_phases.py patches.
  unsigned long long t_ready, t_done;
  unsigned long long t_mark[2];               // the kind's INPUT and COMPUTE marks
};

// Barrier block in static shared memory: full[NUM_PAGES], empty[NUM_PAGES] (PageCursor relies
// on empty following full), then loaded, ready, done, freed [NUM_SLOTS] each.
struct Bars {
  unsigned long long full[NUM_PAGES], empty[NUM_PAGES];
  unsigned long long loaded[NUM_SLOTS], ready[NUM_SLOTS], done[NUM_SLOTS], freed[NUM_SLOTS];
};

struct Shared {
  Slot slot[NUM_SLOTS];
  Bars bars;
  int seen_ctr[SEEN];
  unsigned long long seen_val[SEEN];
  int consumers_gone;  // the consumers left after a stop
};

__device__ __forceinline__ long long join64(int lo, int hi) {
  return (long long)((unsigned long long)(unsigned)lo | ((unsigned long long)(unsigned)hi << 32));
}

__device__ __forceinline__ int pages_of(const int* rec) {
  int n = 0;
#pragma unroll
  for (int r = 0; r < REC_MAX_RUNS; ++r) n += rec[REC_STREAM_RUNS + REC_RUN_STRIDE * r];
  return n;
}

// Wait for a phase that can only fail to come through a runtime bug: trap after the limit.
__device__ __forceinline__ void wait_or_trap(uint32_t bar, uint32_t parity, long long limit_ns) {
  if (ptx::mbar_try_wait(bar, parity)) return;
  const unsigned long long t0 = ptx::globaltimer();
  while (!ptx::mbar_try_wait(bar, parity)) {
    if (ptx::globaltimer() - t0 > (unsigned long long)limit_ns) __trap();
  }
}

// Wait for a phase, or return false once the consumers have left after a stop.
__device__ __forceinline__ bool wait_unless_gone(uint32_t bar, uint32_t parity, const int* gone) {
  while (!ptx::mbar_try_wait(bar, parity)) {
    if (ptx::ld_acquire_cta(gone)) return ptx::mbar_try_wait(bar, parity);
  }
  return true;
}

// Where this CTA stopped: its EARLIEST record that did not complete (the controller may stop at
// a later wait after the storer found an earlier record's polls gave up, or the reverse), so the
// host can tell the root cause of a hang from the CTAs that were merely waiting behind it. The
// controller and the storer both record stops: a lock in shared memory orders them.
__shared__ int stop_lock;

__device__ __forceinline__ void record_stop(const Params& p, int status, int sm, int index, int s,
                                            int wait) {
  int* st = p.sm_state + sm * SMS_WORDS;
  while (atomicCAS(&stop_lock, 0, 1) != 0) {
  }
  __threadfence_block();
  const bool earlier = st[SMS_STATUS] == 0 || s < st[SMS_STEP] ||
                       (s == st[SMS_STEP] && index < st[SMS_INDEX]);
  if (earlier) {
    st[SMS_INDEX] = index;
    st[SMS_STEP] = s;
    st[SMS_WAIT] = wait;
    st[SMS_STATUS] = status;
  }
  __threadfence_block();
  atomicExch(&stop_lock, 0);
}

// Controller lane 0: satisfy every wait of `rec` for local step s. False when this CTA must stop
// (its own wait timed out, or another CTA raised the abort flag).
__device__ __forceinline__ bool wait_record(const Params& p, const int* rec, int s, int sm,
                                            int index, Shared& sh) {
  const long long g = p.step_begin + s;
  const int n = rec[REC_NUM_WAITS];
  for (int w = 0; w < n; ++w) {
    if ((rec[REC_POLLED] >> w) & 1) continue;  // the task polls the producers' data itself
    const int* wt = rec + REC_WAITS + w * REC_WAIT_STRIDE;
    const int c = wt[0];
    const unsigned long long target =
        (unsigned long long)(g + 1 - wt[2]) * (unsigned long long)(unsigned)wt[1];
    const int slot = c & (SEEN - 1);
    if (sh.seen_ctr[slot] == c && sh.seen_val[slot] >= target) continue;
    const unsigned long long* ctr = p.counters + c;
    unsigned long long v = ptx::ld_acquire_u64(ctr);
    if (v < target) {
      const unsigned long long t0 = ptx::globaltimer();
      for (;;) {
        v = ptx::ld_acquire_u64(ctr);
        if (v >= target) break;
        if (ptx::ld_relaxed_s32(p.abort_flag)) {
          record_stop(p, SMS_STATUS_WAITING, sm, index, s, w);
          return false;
        }
        if (ptx::globaltimer() - t0 > (unsigned long long)p.timeout_ns) {
          record_stop(p, SMS_STATUS_WAITING, sm, index, s, w);
          report_failure(p.error, p.abort_flag, ERR_CODE_TIMEOUT, sm, rec, index, c, v, target,
                         g);
          return false;
        }
      }
    }
    sh.seen_ctr[slot] = c;
    sh.seen_val[slot] = v;
  }
  return true;
}

// ---- controller ---------------------------------------------------------------------------------
__device__ __forceinline__ void fill_slot(const Params& p, Slot& slot, const int* src, int lane) {
  if (lane < REC_WORDS / 4)
    reinterpret_cast<int4*>(slot.rec)[lane] = __ldg(reinterpret_cast<const int4*>(src) + lane);
  __syncwarp();
  const int* row = p.op_params + (long long)slot.rec[REC_OP] * PARAM_WORDS;
  if (lane < PARAM_WORDS / 4)
    reinterpret_cast<int4*>(slot.params)[lane] = __ldg(reinterpret_cast<const int4*>(row) + lane);
  const unsigned long long* table = reinterpret_cast<const unsigned long long*>(p.tensors);
  if (lane < REC_MAX_OPERANDS) {
    const int id = slot.rec[REC_OPERANDS + REC_OPERAND_STRIDE * lane];
    slot.base[lane] = id >= 0 ? __ldg(table + id) : 0ull;
  } else if (lane == REC_MAX_OPERANDS) {
    const int id = slot.rec[REC_STREAM];
    slot.stream = id >= 0 ? __ldg(table + id) + (unsigned long long)join64(
                                slot.rec[REC_STREAM_OFFSET], slot.rec[REC_STREAM_OFFSET + 1])
                          : 0ull;
  }
  __syncwarp();
}

__device__ __forceinline__ void fetcher(const Params& p, Shared& sh, const int* list, int len,
                                        int total) {
  const int lane = threadIdx.x & 31;
  int i = 0, s = 0;
  uint32_t seq = 0;  // ring sequence number of the next record's page 0 (the loader counts alike)
  for (int k = 0; k < total; ++k) {
    const int sl = (int)(k & (NUM_SLOTS - 1));
    const uint32_t round = (uint32_t)(k / NUM_SLOTS);
    Slot& slot = sh.slot[sl];
    int go = 1;
    if (lane == 0)  // the storer and the loader are done with record k - NUM_SLOTS
      go = wait_unless_gone(ptx::smem_u32(&sh.bars.freed[sl]), (round & 1u) ^ 1u,
                            &sh.consumers_gone);
    if (!__shfl_sync(0xffffffffu, go, 0)) return;
    __syncwarp();
    fill_slot(p, slot, list + (long long)i * REC_WORDS, lane);
    if (lane == 0) {
      slot.step = s;
      slot.gstep = (uint32_t)(p.step_begin + s);
      slot.index = i;
      slot.stop = 0;
      const int kind = slot.rec[REC_KIND];
      slot.bad_kind = kind < 0 || kind >= MPK_NUM_KINDS;
      if (slot.bad_kind) slot.stream = 0ull;  // a corrupt record: the loader copies nothing
      slot.page_seq = seq;
      if (slot.stream != 0ull) seq += (uint32_t)pages_of(slot.rec);
      ptx::mbar_arrive(ptx::smem_u32(&sh.bars.loaded[sl]));
    }
    if (++i == len) {
      i = 0;
      ++s;
    }
  }
}

__device__ __forceinline__ void controller(const Params& p, Shared& sh, int total, int sm) {
  const long long limit = p.timeout_ns * INTERNAL_TIMEOUT_FACTOR;
  for (int k = 0; k < total; ++k) {
    const int sl = (int)(k & (NUM_SLOTS - 1));
    const uint32_t round = (uint32_t)(k / NUM_SLOTS);
    Slot& slot = sh.slot[sl];
    wait_or_trap(ptx::smem_u32(&sh.bars.loaded[sl]), round & 1u, limit);
    bool ok;
    if (slot.bad_kind) {
      record_stop(p, SMS_STATUS_BAD_KIND, sm, slot.index, slot.step, -1);
      report_failure(p.error, p.abort_flag, ERR_CODE_BAD_KIND, sm, slot.rec, slot.index, -1, 0,
                     0, p.step_begin + slot.step);
      ok = false;
    } else {
      ok = wait_record(p, slot.rec, slot.step, sm, slot.index, sh);
    }
    if (!ok) slot.stop = 1;  // the consumers leave when they reach this slot
#ifdef MPK_PROFILE
    slot.t_ready = ptx::globaltimer();
#endif
    ptx::mbar_arrive(ptx::smem_u32(&sh.bars.ready[sl]));
    if (!ok) return;
  }
}

// ---- loader ---------------------------------------------------------------------------------------
// After a stop: let the copies already issued land before the CTA exits (no bulk copy may
// still write this CTA's shared memory then). Nothing is issued after the stop, so the last
// NUM_PAGES pages' phases cannot move on.
__device__ __forceinline__ void drain(Shared& sh, uint32_t seq, long long limit) {
  for (uint32_t s = seq > NUM_PAGES ? seq - NUM_PAGES : 0; s < seq; ++s)
    wait_or_trap(ptx::smem_u32(&sh.bars.full[s % NUM_PAGES]), (s / NUM_PAGES) & 1u, limit);
}

// The loader keeps at most this many pages in flight: page seq is issued once page
// seq - LOADER_PAGES_IN_FLIGHT has landed (landing needs nothing of the consumers: no deadlock).
// A whole free ring requested at once (up to NUM_PAGES x 16 KB a SM after a phase that streams
// nothing) queues every L2 round trip of the SM's consumers behind it: with every SM streaming,
// stage_bench's depth table gives a phase that reads nothing 2.3 / 3.5 / 6.6 / 8.5 us at 1 / 2 /
// 3 / 4 pages in flight, the stream 2.64 / 2.87 / 3.04 / 3.06 TB/s (H100); a cap of 2 beat the
// uncapped ring by 2-7% at b1 there (thirty-fourth session). On the H200 (more bandwidth, the
// same latency: a deeper stream pays) 3 against 2 gave qwen3-8b b1 -6.2%, llama-3.2-1b b1
// -2.9%, qwen3-0.6b b1 -0.6% and b16 -0.3%, qwen3-30b-a3b b1 0%; 4 lost to 3 on llama-3.2-1b
// (+1.6%) and the MoE step (+1.2%) and tied on the rest (perf-log, thirty-sixth session). On
// the H100, 3 had been worse than 2 at b16 (+2%) and on the MoE step (+1.8%).
inline constexpr uint32_t LOADER_PAGES_IN_FLIGHT = 3;

__device__ __forceinline__ void loader(const Params& p, Shared& sh, uint32_t ring,
                                       int total) {
  const uint64_t policy = ptx::l2_evict_first_policy();
  uint32_t seq = 0;  // ring sequence number of the next page
  for (int k = 0; k < total; ++k) {
    const int sl = (int)(k & (NUM_SLOTS - 1));
    const uint32_t round = (uint32_t)(k / NUM_SLOTS);
    if (!wait_unless_gone(ptx::smem_u32(&sh.bars.loaded[sl]), round & 1u, &sh.consumers_gone))
      return drain(sh, seq, p.timeout_ns);
    const Slot& slot = sh.slot[sl];
    const char* src = reinterpret_cast<const char*>(slot.stream);
    int counts[REC_MAX_RUNS];
    uint32_t sizes[REC_MAX_RUNS];
#pragma unroll
    for (int r = 0; r < REC_MAX_RUNS; ++r) {
      counts[r] = src ? slot.rec[REC_STREAM_RUNS + REC_RUN_STRIDE * r] : 0;
      sizes[r] = (uint32_t)slot.rec[REC_STREAM_RUNS + REC_RUN_STRIDE * r + 1];
    }
    ptx::mbar_arrive(ptx::smem_u32(&sh.bars.freed[sl]));  // done reading the slot
#pragma unroll
    for (int r = 0; r < REC_MAX_RUNS; ++r) {
      for (int c = 0; c < counts[r]; ++c, ++seq) {
        const uint32_t ps = seq % NUM_PAGES, pround = seq / NUM_PAGES;
        if (LOADER_PAGES_IN_FLIGHT < NUM_PAGES && seq >= LOADER_PAGES_IN_FLIGHT) {
          // back's slot is next used by page back + NUM_PAGES > seq, which only this loop
          // issues: its full barrier cannot be past back's phase yet.
          const uint32_t back = seq - LOADER_PAGES_IN_FLIGHT;
          if (!wait_unless_gone(ptx::smem_u32(&sh.bars.full[back % NUM_PAGES]),
                                (back / NUM_PAGES) & 1u, &sh.consumers_gone))
            return drain(sh, seq, p.timeout_ns);
        }
        if (!wait_unless_gone(ptx::smem_u32(&sh.bars.empty[ps]), (pround & 1u) ^ 1u,
                              &sh.consumers_gone))
          return drain(sh, seq, p.timeout_ns);
        const uint32_t full = ptx::smem_u32(&sh.bars.full[ps]);
        ptx::mbar_arrive_expect_tx(full, sizes[r]);
        ptx::bulk_copy_g2s(ring + ps * (uint32_t)PAGE_BYTES, src, sizes[r], full, policy);
        src += sizes[r];
      }
    }
  }
}

// ---- storer ---------------------------------------------------------------------------------------
#ifdef MPK_PROFILE
__device__ __forceinline__ void profile_record(const Params& p, const Slot& slot, int sm) {
  if (p.profile == nullptr) return;
  unsigned long long* row =
      p.profile +
      (((long long)slot.step * gridDim.x + sm) * p.max_len + slot.index) * PROF_STAMPS;
  row[PROF_WAIT] = slot.t_wait;
  row[PROF_RUN] = slot.t_run;
  row[PROF_READY] = slot.t_ready;
  row[PROF_INPUT] = slot.t_mark[0];
  row[PROF_COMPUTE] = slot.t_mark[1];
  row[PROF_DONE] = slot.t_done;
  row[PROF_END] = ptx::globaltimer();
}
#endif

// A record whose consumers poll flagged data (record POLLED waits) stopped there: they ran past
// the watchdog after its counted waits were met, or gave up when the launch stopped. The CTA's
// stop is this record's first polled wait, whose producers never delivered what it polled
// (diagnose.py follows that counter's producers); `report` also raises the failure (a no-op when
// another CTA's came first).
__device__ __forceinline__ void stop_polled(const Params& p, const Slot& slot, int sm, bool report) {
  int w = 0;  // -1: the record skips no wait (its polls read data its counted waits cover)
  while (w < REC_MAX_WAITS && !((slot.rec[REC_POLLED] >> w) & 1)) ++w;
  if (w == REC_MAX_WAITS) w = -1;
  record_stop(p, SMS_STATUS_POLL, sm, slot.index, slot.step, w);
  if (!report) return;
  const int* wt = slot.rec + REC_WAITS + (w < 0 ? 0 : w) * REC_WAIT_STRIDE;
  const long long g = p.step_begin + slot.step;
  const unsigned long long target =
      w < 0 ? 0ull : (unsigned long long)(g + 1 - wt[2]) * (unsigned long long)(unsigned)wt[1];
  report_failure(p.error, p.abort_flag, ERR_CODE_POLL_TIMEOUT, sm, slot.rec, slot.index,
                 w < 0 ? -1 : wt[0], w < 0 ? 0ull : ptx::ld_relaxed_u64(p.counters + wt[0]),
                 target, g);
}

// The storer's wait for the consumers of a record that polls flagged data: that record has no
// counter wait the controller could time out on for those producers, so the watchdog is here.
// 0: done; 1: the consumers left after a stop; 2: timeout_ns passed (in 1.024 us units: one
// 32-bit register for the start, the producers' register budget is small).
__device__ __forceinline__ int wait_polled(uint32_t done, uint32_t parity, const int* gone,
                                           long long timeout_ns) {
  const uint32_t t0 = (uint32_t)(ptx::globaltimer() >> 10);
  while (!ptx::mbar_try_wait(done, parity)) {
    if (ptx::ld_acquire_cta(gone)) return ptx::mbar_try_wait(done, parity) ? 0 : 1;
    if ((uint32_t)(ptx::globaltimer() >> 10) - t0 > (uint32_t)min(timeout_ns >> 10, 0xffffffffll))
      return 2;
  }
  return 0;
}

// Wait until the consumers finish record k (slot sl); false once they have left after a stop.
// The record is read only after its `ready` (the fetcher may still be refilling the slot when
// the storer gets there: the loader frees it too). A polling record gets timeout_ns once it is
// ready, else it is reported as stuck and the launch stops (its polls give up, it finishes).
__device__ __forceinline__ bool wait_done(const Params& p, Shared& sh, const Slot& slot, int sl,
                                          uint32_t parity, int sm, bool& aborted) {
  const uint32_t done = ptx::smem_u32(&sh.bars.done[sl]);
  if (!wait_unless_gone(ptx::smem_u32(&sh.bars.ready[sl]), parity, &sh.consumers_gone))
    return false;
  if (slot.rec[REC_POLLED] != 0 && !aborted) {
    const int r = wait_polled(done, parity, &sh.consumers_gone, p.timeout_ns);
    if (r != 2) return r == 0;
    stop_polled(p, slot, sm, true);
    aborted = true;
  }
  return wait_unless_gone(done, parity, &sh.consumers_gone);
}

__device__ __forceinline__ void storer(const Params& p, Shared& sh, int total, int sm) {
  bool aborted = false;  // nothing is signalled after this CTA stopped
  for (int k = 0; k < total; ++k) {
    const int sl = (int)(k & (NUM_SLOTS - 1));
    const uint32_t round = (uint32_t)(k / NUM_SLOTS);
    const Slot& slot = sh.slot[sl];
    if (!wait_done(p, sh, slot, sl, round & 1u, sm, aborted)) return;
    if (!aborted && gave_up_record == k) {  // its outputs are not to be trusted
      stop_polled(p, slot, sm, false);
      aborted = true;
    }
#ifdef MPK_TASK_PARAMS
    // A task that waits on its own (the tensor-parallel all-reduce waits for its peers) may have
    // stopped the launch: its consumers must not be signalled for data it never wrote. The
    // slots keep being freed, so the controller reaches a wait, sees the abort and stops.
    if (!aborted && ptx::ld_relaxed_s32(p.abort_flag)) {
      record_stop(p, SMS_STATUS_PEER, sm, slot.index, slot.step, -1);
      aborted = true;
    }
#endif
    // The consumers' arrives ordered their stores before this thread (causality through the
    // mbarrier); one release fence then makes them visible GPU-wide before any of the strong
    // adds that follow can be seen (PTX release pattern: fence.acq_rel + strong write; release
    // is cumulative). One fence per record: red.release would fence before every add, and
    // __threadfence is a sequentially consistent fence (MEMBAR.SC), stronger than needed.
    const int n = aborted ? 0 : slot.rec[REC_NUM_SIGNALS];
    if (n > 0) ptx::fence_acq_rel_gpu();
    for (int j = 0; j < n; ++j)
      ptx::red_relaxed_add_u64(p.counters + slot.rec[REC_SIGNALS + j], 1ull);
#ifdef MPK_PROFILE
    profile_record(p, slot, sm);
#endif
    ptx::mbar_arrive(ptx::smem_u32(&sh.bars.freed[sl]));
  }
}

// ---- consumers ------------------------------------------------------------------------------------
__device__ __forceinline__ TaskArgs task_args(const Params& p, Shared& sh, Slot& slot,
                                              uint32_t ring, char* scratch,
                                              const Params* task_params) {
  const int npages = slot.stream != 0ull ? pages_of(slot.rec) : 0;
  const PageCursor pages{ring, ptx::smem_u32(&sh.bars.full[0]), slot.page_seq, npages, -1,
                         p.timeout_ns};
#ifdef MPK_PROFILE
  return TaskArgs{slot.rec, slot.params, slot.base, slot.step, slot.gstep, scratch, task_params,
                  pages, slot.t_mark};
#else
  return TaskArgs{slot.rec, slot.params, slot.base, slot.step, slot.gstep, scratch, task_params,
                  pages};
#endif
}

// Little state is live across a task (the loop index; the page sequence comes with the slot), so
// the tasks' registers never push it to local memory.
__device__ __forceinline__ void consumers(const Params& p, Shared& sh, uint32_t ring, char* scratch,
                                          int total, const Params* task_params) {
  const int tid = threadIdx.x;
  for (int k = 0; k < total; ++k) {
    const int sl = (int)(k & (NUM_SLOTS - 1));
    const uint32_t round = (uint32_t)(k / NUM_SLOTS);
#ifdef MPK_PROFILE
    const unsigned long long t_wait = ptx::globaltimer();  // the consumers are free
#endif
    const long long limit = p.timeout_ns * INTERNAL_TIMEOUT_FACTOR * REC_MAX_WAITS;
    // The slot is resolved (fetcher) long before its counters are met (controller): a kind's
    // prologue reads what no task writes into the scratch now, so those loads overlap the wait.
    wait_or_trap(ptx::smem_u32(&sh.bars.loaded[sl]), round & 1u, limit);
    Slot& slot = sh.slot[sl];
    // The arguments are rebuilt from the slot after the wait: nothing of them stays live across
    // it (the loop's registers are the tasks' registers).
    if (!slot.bad_kind)
      dispatch_prologue(slot.rec[REC_KIND], task_args(p, sh, slot, ring, scratch, task_params));
    wait_or_trap(ptx::smem_u32(&sh.bars.ready[sl]), round & 1u, limit);
    if (slot.stop) {  // uniform: every consumer thread reads the same slot
      if (tid == 0) ptx::st_release_cta(&sh.consumers_gone, 1);
      return;
    }
#ifdef MPK_PROFILE
    if (tid == 0) {  // the storer reads both after this record's done
      slot.t_wait = t_wait;
      slot.t_run = ptx::globaltimer();
      slot.t_mark[0] = slot.t_mark[1] = 0ull;  // a kind that marks overwrites them
    }
#endif
    running_record = k;  // every thread: each reads back its own write
    const TaskArgs a = task_args(p, sh, slot, ring, scratch, task_params);
    if (!dispatch(slot.rec[REC_KIND], a)) __trap();  // the controller checked the kind id
    // Every warp is out of this task before any warp starts the next one: a task owns the
    // scratch for its whole duration (a fast warp would otherwise overwrite what a slow one
    // still reads, e.g. an argmax result read after the task's last barrier).
    task_sync();
#ifdef MPK_PROFILE
    if (tid == 0) slot.t_done = ptx::globaltimer();
#endif
    if ((tid & 31) == 0) ptx::mbar_arrive(ptx::smem_u32(&sh.bars.done[sl]));
  }
}

__device__ __forceinline__ void init_barriers(Shared& sh) {
  for (int i = 0; i < NUM_PAGES; ++i) {
    ptx::mbar_init(ptx::smem_u32(&sh.bars.full[i]), 1);
    ptx::mbar_init(ptx::smem_u32(&sh.bars.empty[i]), NUM_THREADS);  // PageCursor
  }
  for (int i = 0; i < NUM_SLOTS; ++i) {
    ptx::mbar_init(ptx::smem_u32(&sh.bars.loaded[i]), 1);
    ptx::mbar_init(ptx::smem_u32(&sh.bars.ready[i]), 1);
    ptx::mbar_init(ptx::smem_u32(&sh.bars.done[i]), CONSUMER_WARPS);
    ptx::mbar_init(ptx::smem_u32(&sh.bars.freed[i]), 2);  // the storer and the loader
  }
  for (int i = 0; i < SEEN; ++i) sh.seen_ctr[i] = -1;
  sh.consumers_gone = 0;
  gave_up_record = -1;
  stop_lock = 0;
  ptx::mbar_init_fence();
}

}  // namespace mpk

#ifdef MPK_TASK_PARAMS
// A kind of this plan reads the launch's Params (TaskArgs::p): __grid_constant__ lets it take
// &p without the kernel copying Params to local memory.
#define MPK_PARAMS_DECL const __grid_constant__ mpk::Params p
#define MPK_PARAMS_PTR (&p)
#else
#define MPK_PARAMS_DECL const mpk::Params p
#define MPK_PARAMS_PTR nullptr
#endif

extern "C" __global__ void __launch_bounds__(mpk::RUNTIME_THREADS, 1)
    mpk_megakernel(MPK_PARAMS_DECL) {
  using namespace mpk;
  extern __shared__ __align__(1024) char dyn_smem[];
  __shared__ Shared sh;

  if (p.lengths[blockIdx.x] == 0) return;  // uniform: the whole CTA leaves
  // Everything a role needs is recomputed after its setmaxnreg: values live across the role
  // branch would be spilled around the register reallocation. The thread index is read with
  // an opaque move, so the tasks' own threadIdx.x is not merged with (and kept alive from) it.
  const int tid0 = ptx::thread_index();
  // A launch queued behind one the watchdog stopped (the host starts launches ahead) does
  // nothing: its stops would overwrite that launch's report and its signals move counters.
  __shared__ int stopped_before;
  if (tid0 == 0) {
    stopped_before = ptx::ld_relaxed_s32(p.abort_flag);
    init_barriers(sh);
    launch_abort = p.abort_flag;
    launch_counters = p.counters;
  }
  __syncthreads();
  if (stopped_before) return;  // uniform: the whole CTA leaves
  const int warp = tid0 >> 5;
  // The consumers' branch first: with the producers' branch first, ptxas (CUDA 13.0) kept the
  // consumers' code within the kernel's 168 registers and spilled there, whatever their
  // setmaxnreg said (seventeenth session: SASS: R165 at most; in this order it uses up to 232).
  if (warp < CONSUMER_WARPS) {
    ptx::setmaxnreg_inc<CONSUMER_REGS>();
    const int total = p.lengths[blockIdx.x] * p.num_steps;
    consumers(p, sh, ptx::smem_u32(dyn_smem), dyn_smem + NUM_PAGES * PAGE_BYTES, total,
              MPK_PARAMS_PTR);
  } else {
    ptx::setmaxnreg_dec<PRODUCER_REGS>();
    const int sm = blockIdx.x, lane = threadIdx.x & 31;
    const int total = p.lengths[sm] * p.num_steps;  // < 2^31: the executor checks
    if (warp == FETCHER_WARP) {
      fetcher(p, sh, p.instrs + (long long)sm * p.max_len * REC_WORDS, p.lengths[sm], total);
    } else if (warp == CONTROLLER_WARP) {
      if (lane == 0) controller(p, sh, total, sm);
    } else if (warp == LOADER_WARP) {
      if (lane == 0) loader(p, sh, ptx::smem_u32(dyn_smem), total);
    } else if (warp == STORER_WARP) {
      if (lane == 0) storer(p, sh, total, sm);
    }
  }
}
