// mpk::Params (the launch parameters) and the failure report, shared by the runtime and by the
// tasks that wait on something themselves (the tensor-parallel all-reduce waits on its peers).
// Included before the task kinds, so that TaskArgs can hand a task the whole Params.
#pragma once
#include <stdint.h>

namespace mpk {

// Launch parameters; mirrored by mpk/backends/cuda/loader.py (Params), checked by size.
struct Params {
  const int* instrs;             // [num_sms, max_len, REC_WORDS]
  const int* lengths;            // [num_sms]
  const int* op_params;          // [num_ops, PARAM_WORDS]
  void* const* tensors;          // [num_tensors] device base pointers, index = tensor id
  unsigned long long* counters;  // [num_counters], monotonic
  int* error;                    // [ERR_WORDS], ERR_CODE == 0 while all is well
  int* abort_flag;               // set to 1 by the first CTA that fails; all CTAs then exit
  int* sm_state;                 // [num_sms, SMS_WORDS]: where each CTA stopped (diagnosis)
  long long step_begin;          // global step of local step 0
  int num_steps;
  int max_len;                   // row stride of instrs, in records
  long long timeout_ns;          // watchdog: the longest one wait may spin
  // [num_steps, num_sms, max_len, PROF_STAMPS] %globaltimer ns, written only by MPK_PROFILE
  // builds (null otherwise; the default build compiles every stamp out).
  unsigned long long* profile;
  // Tensor parallelism (ranks == 1: peer_arenas is null). Every rank's activation arena, as
  // mapped into this process (peer memory; rank order), and where the cross-GPU flags sit in
  // each arena: flags[task * ranks + source rank], u64, monotonic (the source's step + 1).
  const unsigned long long* peer_arenas;  // [ranks]
  long long xflags_offset;                // bytes from an arena's base to its flags
  int rank;
  int ranks;
};

// Record a failure (first one wins) and tell every CTA to stop. Out of line: it is cold, and
// taking pointers by value (not `const Params&`) keeps the kernel free of a local-memory copy.
__device__ __noinline__ void report_failure(int* error, int* abort_flag, int code, int sm,
                                            const int* rec, int index, int counter,
                                            unsigned long long value, unsigned long long target,
                                            long long g) {
  if (atomicCAS(error + ERR_CODE, 0, code) == 0) {
    error[ERR_SM] = sm;
    error[ERR_TASK] = rec[REC_TASK];
    error[ERR_KIND] = rec[REC_KIND];
    error[ERR_INDEX] = index;
    error[ERR_COUNTER] = counter;
    error[ERR_VALUE_LO] = (int)(value & 0xffffffffull);
    error[ERR_VALUE_HI] = (int)(value >> 32);
    error[ERR_TARGET_LO] = (int)(target & 0xffffffffull);
    error[ERR_TARGET_HI] = (int)(target >> 32);
    error[ERR_STEP_LO] = (int)((unsigned long long)g & 0xffffffffull);
    error[ERR_STEP_HI] = (int)((unsigned long long)g >> 32);
    __threadfence();
  }
  atomicExch(abort_flag, 1);
}

}  // namespace mpk
