// Flagged activations (mpk/compiler/flags.py has the why and the rules): a flagged bf16 tensor
// [..., N] is stored as u64 words [..., N/2], each a bf16 pair (columns n, n + 1; n even) in the
// low 32 bits and the epoch of the write that stored it in the high 32. Writers store whole
// words; readers load whole words and keep loading until each carries the epoch they expect, so
// the data is its own readiness signal (no fence, counter or controller poll between a producer
// and a consumer that polls). Words are single 64-bit accesses (single-copy atomic), relaxed at
// GPU scope: another SM's store is seen, never half of it.
// Included by kinds, after task_args.cuh (TaskArgs, mpk::ptx), like every kind header.
#pragma once
#include <stdint.h>

#include "memory.cuh"

namespace mpk::dev {

using flag_word = unsigned long long;

// The epoch of operand `slot`'s flagged access in this task's step (the compiler's flag entry,
// compiler/flags.encode_entry / epoch), or 0 when the operand is plain. kFlagged: the kind's
// FLAGGED (codegen): false when no op of the kind has a flagged operand in the plan, so the
// epochs are constant zeros and every flagged path folds away (the lookups and the branches
// they guard cost batch 8's linears ~0.3 us a phase: perf-log, sixteenth session).
template <bool kFlagged>
__device__ __forceinline__ uint32_t flag_epoch(const mpk::TaskArgs& a, int slot) {
  if constexpr (kFlagged) {
#pragma unroll
    for (int e = 0; e < REC_FLAG_ENTRIES; ++e) {
      const uint32_t word = static_cast<uint32_t>(a.params[REC_FLAG_PARAMS + e]);
      if ((word & 0xffu) == static_cast<uint32_t>(slot) + 1u) {
        const uint32_t writes = (word >> 8) & 0xfffu, index = word >> 20;
        return ((a.gstep * writes + index) & 0x7fffffffu) + 1u;  // mod 2^31 + 1
      }
    }
  }
  return 0u;
}

// A flagged operand's tile as words: the record's tile offset counts elements, kPerWord a word
// (bf16: two, and the offsets of flagged tiles are even; int32: one), where TaskArgs::operand
// would count it in T.
template <class W, int kPerWord = 2>
__device__ __forceinline__ W* flag_operand(const mpk::TaskArgs& a, int slot) {
  if (!a.has(slot)) return nullptr;
  const long long off = a.operand<const char>(slot) - reinterpret_cast<const char*>(a.base[slot]);
  return reinterpret_cast<W*>(a.base[slot]) + off / kPerWord;
}

__device__ __forceinline__ flag_word make_flag_word(uint32_t pair, uint32_t epoch) {
  return static_cast<flag_word>(pair) | (static_cast<flag_word>(epoch) << 32);
}
__device__ __forceinline__ uint32_t word_epoch(flag_word w) { return static_cast<uint32_t>(w >> 32); }
__device__ __forceinline__ uint32_t word_pair(flag_word w) { return static_cast<uint32_t>(w); }

__device__ __forceinline__ void st_flag(flag_word* p, flag_word w) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ void st_flag2(flag_word* p, flag_word a, flag_word b) {
  asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b)
               : "memory");
}
__device__ __forceinline__ flag_word ld_flag(const flag_word* p) {
  flag_word w;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}
// Two consecutive words (16-byte aligned): two single-copy-atomic 64-bit reads.
__device__ __forceinline__ void ld_flag2(const flag_word* p, flag_word& a, flag_word& b) {
  asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p)
               : "memory");
}

// A poll gives up only when the launch is stopping (another CTA's watchdog fired, or this CTA's
// storer found the task stuck: runtime.cuh); the first record that gave up is marked in
// gave_up_record, so the storer records it as where this CTA stopped and signals nothing from it
// on (later records' give-ups follow it in list order), and the data stays whatever was read.
struct Poll {
  __device__ __forceinline__ bool again() const {
    if (!mpk::ptx::ld_relaxed_s32(mpk::launch_abort)) return true;
    if (mpk::gave_up_record < 0) mpk::gave_up_record = mpk::running_record;
    return false;
  }
};

// Eight bf16 (four words at p, 16-byte aligned) carrying `epoch`, as one 16-byte vector in
// natural order: loaded until all four do.
__device__ __forceinline__ uint4 poll8(const flag_word* p, uint32_t epoch, const Poll& poll) {
  flag_word w0, w1, w2, w3;
  for (;;) {
    ld_flag2(p, w0, w1);
    ld_flag2(p + 2, w2, w3);
    const bool ready = word_epoch(w0) == epoch && word_epoch(w1) == epoch &&
                       word_epoch(w2) == epoch && word_epoch(w3) == epoch;
    if (ready || !poll.again()) break;
  }
  return make_uint4(word_pair(w0), word_pair(w1), word_pair(w2), word_pair(w3));
}

// Vectors 0 .. n-1 of a flagged tensor (vector v: the four words at words + 4v, eight bf16) into
// dst (16-byte aligned, natural order), each thread's kN vectors of a round loaded together and
// only those whose words do not all carry `epoch` yet loaded again (one vector at a time pays an
// L2 round trip each: perf-log, fourteenth session).
template <int kN>
__device__ __forceinline__ void poll_vectors(uint4* dst, const flag_word* words, uint32_t epoch,
                                             int n, const Poll& poll) {
  for (int base = threadIdx.x; base < n; base += kN * NUM_THREADS) {
    unsigned pending = 0u;  // bit j: vector base + j * NUM_THREADS is real and not yet in
#pragma unroll
    for (int j = 0; j < kN; ++j)
      if (base + j * NUM_THREADS < n) pending |= 1u << j;
    const unsigned real = pending;
    flag_word w[kN][4] = {};
    for (;;) {
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        if ((pending >> j) & 1u) {
          const flag_word* p = words + 4ll * (base + j * NUM_THREADS);
          ld_flag2(p, w[j][0], w[j][1]);
          ld_flag2(p + 2, w[j][2], w[j][3]);
        }
      }
#pragma unroll
      for (int j = 0; j < kN; ++j)
        if (word_epoch(w[j][0]) == epoch && word_epoch(w[j][1]) == epoch &&
            word_epoch(w[j][2]) == epoch && word_epoch(w[j][3]) == epoch)
          pending &= ~(1u << j);
      if (pending == 0u || !poll.again()) break;
    }
#pragma unroll
    for (int j = 0; j < kN; ++j)
      if ((real >> j) & 1u)
        dst[base + j * NUM_THREADS] = make_uint4(word_pair(w[j][0]), word_pair(w[j][1]),
                                                 word_pair(w[j][2]), word_pair(w[j][3]));
  }
}

// One word expected to carry `epoch` (already loaded into w: reloaded until it does).
__device__ __forceinline__ uint32_t poll_word(const flag_word* p, flag_word w, uint32_t epoch,
                                              const Poll& poll) {
  while (word_epoch(w) != epoch && poll.again()) w = ld_flag(p);
  return word_pair(w);
}

// Element i of an int32 activation that is flagged when epoch != 0 (words: one value each) and
// plain otherwise (an L2-coherent load), in two halves so that other loads can go out between
// them: ld_i32_word issues the load (a plain value comes as a word of epoch 0), i32_of waits for
// it, polling a flagged word until it carries `epoch`.
__device__ __forceinline__ flag_word ld_i32_word(const int* plain, const flag_word* words,
                                                 uint32_t epoch, int i) {
  if (epoch == 0u) return make_flag_word(static_cast<uint32_t>(ld_act_i32(plain + i)), 0u);
  return ld_flag(words + i);
}
__device__ __forceinline__ int i32_of(const flag_word* words, flag_word w, uint32_t epoch, int i) {
  return static_cast<int>(poll_word(words + i, w, epoch, Poll{}));  // epoch 0: w is the value
}
__device__ __forceinline__ int ld_i32_maybe_flagged(const int* plain, const flag_word* words,
                                                    uint32_t epoch, int i) {
  return i32_of(words, ld_i32_word(plain, words, epoch, i), epoch, i);
}

}  // namespace mpk::dev
