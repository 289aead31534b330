// Does compute-sanitizer's racecheck follow mbarrier hand-offs? (scripts/racecheck_probe.cu)
//
// The megakernel's racecheck run (perf-log, ninth session) reported hazards between the
// fetcher's writes of a record slot and the slot's readers, which are ordered only by mbarriers.
// This kernel has that pattern and nothing else: a writer lane fills a shared slot and arrives on
// `loaded`; a reader warp waits on `loaded`, reads the slot, and releases it:
//   mode 0 (direct): the readers arrive on `freed`, which the writer waits on before the rewrite;
//   mode 1 (relay):  the readers arrive on `done`, a relay lane waits on it and arrives on
//                    `freed` (the megakernel's consumers -> storer -> fetcher chain);
//   mode 2 (early):  the readers release the slot BEFORE reading it: a real race, the control.
// Run each under racecheck and compare the hazard counts:
//   nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -o /tmp/rcp scripts/racecheck_probe.cu
//   for m in 0 1 2; do compute-sanitizer --tool racecheck /tmp/rcp $m | tail -2; done
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cuda_runtime.h>

constexpr int ROUNDS = 64;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

__global__ void probe(int mode, int* out) {
  __shared__ unsigned long long loaded, done, freed;
  __shared__ int slot[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    mbar_init(smem_u32(&loaded), 1);
    mbar_init(smem_u32(&done), 1);
    mbar_init(smem_u32(&freed), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {  // writer
    for (int r = 0; r < ROUNDS; ++r) {
      if (r > 0) mbar_wait(smem_u32(&freed), (r - 1) & 1);
      slot[lane] = r * 32 + lane;
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_u32(&loaded));
    }
  } else if (warp == 1) {  // readers
    int sum = 0;
    for (int r = 0; r < ROUNDS; ++r) {
      mbar_wait(smem_u32(&loaded), r & 1);
      if (mode == 2 && lane == 0) mbar_arrive(smem_u32(&freed));
      __syncwarp();
      sum += slot[31 - lane];
      __syncwarp();
      if (mode != 2 && lane == 0) mbar_arrive(smem_u32(mode == 1 ? &done : &freed));
    }
    out[lane] = sum;
  } else if (warp == 2 && lane == 0 && mode == 1) {  // relay
    for (int r = 0; r < ROUNDS; ++r) {
      mbar_wait(smem_u32(&done), r & 1);
      mbar_arrive(smem_u32(&freed));
    }
  }
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0;
  int* out;
  cudaMalloc(&out, 32 * sizeof(int));
  probe<<<1, 96>>>(mode, out);
  const cudaError_t e = cudaDeviceSynchronize();
  int h[32];
  cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost);
  // With the hand-offs honoured, reader lane l sums r * 32 + 31 - l over the rounds.
  const int want = 32 * ROUNDS * (ROUNDS - 1) / 2 + ROUNDS * 31;
  printf("mode %d: %s, lane 0 sum %d (want %d)\n", mode, cudaGetErrorString(e), h[0], want);
  return 0;
}
