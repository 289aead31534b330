// A warp's private ring of shared-memory slots that the TMA engine fills with bulk copies, for
// kinds whose weight addresses depend on this step's activations (the MoE experts: which rows
// are read is known only once the router's ids are), so the runtime's loader cannot stream them.
//
// Why a ring and not register loads: a warp's loads keep only what its registers hold in flight
// and wait for all of them at once; the ring keeps `depth` copies in flight per warp without a
// register, issued by one lane as soon as the address is known, and refilled slot by slot as the
// warp consumes them, so an SM streams its share of HBM continuously.
//
// Units are numbered k = 0, 1, ... in the order the warp consumes them; unit k lives in slot
// k % depth and completes phase (k / depth) of that slot's mbarrier. Lane 0 fills, every lane
// waits. A unit with no bytes (an id outside the table) completes its phase by a plain arrive.
// Each warp's barriers are its own: no other warp touches them, so no CTA barrier is needed
// between init, fills and waits. Every filled unit must be waited for before `finish`.
//
// Uses mpk::ptx (backends/cuda/csrc/ptx.cuh), which the megakernel includes before the kinds.
#pragma once
#include <stdint.h>

namespace mpk::dev {

struct WarpRing {
  uint32_t bars;   // smem address of `depth` mbarriers (8 bytes each)
  uint32_t slots;  // smem address of `depth` slots of slot_bytes
  uint32_t slot_bytes;
  int depth;

  // Lane 0 initialises the barriers; the warp then may fill and wait.
  __device__ __forceinline__ void init(int lane) {
    if (lane == 0) {
      for (int s = 0; s < depth; ++s) ptx::mbar_init(bars + 8u * s, 1u);
      ptx::mbar_init_fence();
    }
    __syncwarp();
  }

  // Lane 0: unit k's bytes (0 < bytes <= slot_bytes, a multiple of 16) from src, or, with
  // bytes == 0, an empty unit. The slot's previous unit (k - depth) must have been consumed
  // by every lane (a __syncwarp after its reads).
  __device__ __forceinline__ void fill(int k, const void* src, uint32_t bytes) const {
    const int s = k % depth;
    const uint32_t bar = bars + 8u * s;
    if (bytes == 0u) {
      ptx::mbar_arrive(bar);
      return;
    }
    ptx::mbar_arrive_expect_tx(bar, bytes);
    ptx::bulk_copy_g2s(slots + slot_bytes * s, src, bytes, bar, ptx::l2_evict_first_policy());
  }

  // Every lane: waits for unit k, returns its slot's smem address. A unit that never lands (a
  // fill missed by a bug: the copies themselves cannot stall) traps after ~2 s, so the launch
  // fails with an error instead of holding the GPU until the process is killed.
  __device__ __forceinline__ uint32_t wait(int k) const {
    const int s = k % depth;
    const uint32_t parity = (uint32_t)(k / depth) & 1u;
    unsigned long long since = 0;
    for (uint32_t spins = 1; !ptx::mbar_try_wait(bars + 8u * s, parity); ++spins) {
      if ((spins & 1023u) == 0u) {
        const unsigned long long now = ptx::globaltimer();
        if (since == 0) since = now;
        else if (now - since > 2000000000ull) __trap();
      }
    }
    return slots + slot_bytes * s;
  }

  // After the last wait: the barriers go back to plain memory (the SM's next task owns it).
  __device__ __forceinline__ void finish(int lane) const {
    __syncwarp();
    if (lane == 0)
      for (int s = 0; s < depth; ++s) ptx::mbar_inval(bars + 8u * s);
  }
};

}  // namespace mpk::dev
