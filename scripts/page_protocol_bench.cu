// The runtime's weight-page protocol alone, on one H200 (scripts/page_protocol_bench.cu).
//
// Question (docs/perf-log.md, third session): in the megakernel a consumer warp's walk costs
// ~0.46 us per 16 KB page even with no copies in flight and no work per page. Is that the
// protocol itself (a warp's release + wait), the loader's turnaround (one lane that waits on
// `empty` and then arrives on / copies into `full`), or something of the megakernel around it?
// This kernel has the same roles and barriers and nothing else: NUM_PAGES pages, 8 consumer warps
// that walk PAGES pages (optionally 4 units of 2 shared loads + 2 MMAs per warp per page, as the
// linear walk), one loader lane that refills each page once all 8 warps released it (a bulk copy
// of 16 KB from global memory, or a plain arrive). Reports cycles per page (clock64, warp 0).
// Optional neighbours, as the megakernel has them: a poller warp (the controller: acquire loads
// of a counter that is never met) and a fencer warp (the storer: a store, fence.acq_rel.gpu and a
// relaxed add, in a loop).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/ppb scripts/page_protocol_bench.cu && /tmp/ppb
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

constexpr int NUM_PAGES = 10, PAGE_BYTES = 16384, CONSUMERS = 8, PAGES = 4096;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
template <bool kHint>
__device__ __forceinline__ bool try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  if (kHint)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, "
                 "0x989680;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  else
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
template <bool kHint>
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  while (!try_wait<kHint>(bar, parity)) {
  }
}
__device__ __forceinline__ uint4 lds(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a0), "r"(a1), "r"(a1), "r"(b0), "r"(b1));
}

template <bool kCopy, bool kUnits, bool kHint, int kEnv>
__global__ void __launch_bounds__(384, 1) bench(const char* weights, long long* cycles,
                                                float* sink, unsigned long long* counters) {
  extern __shared__ __align__(1024) char ring[];
  __shared__ __align__(8) unsigned long long full[NUM_PAGES], empty[NUM_PAGES];
  __shared__ __align__(16) char xs[1024];
  __shared__ int consumers_done;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NUM_PAGES; ++i) {
      mbar_init(smem_u32(&full[i]), 1);
      mbar_init(smem_u32(&empty[i]), CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < 256) reinterpret_cast<float*>(xs)[threadIdx.x] = 0.001f * threadIdx.x;
  if (threadIdx.x == 0) consumers_done = 0;
  __syncthreads();
  if (warp == 10 || warp == 11) {  // the neighbours
    if (lane != 0 || !((warp == 10 && (kEnv & 1)) || (warp == 11 && (kEnv & 2)))) return;
    unsigned long long* ctr = counters + blockIdx.x * 16;
    unsigned long long v = 0;
    while (!*reinterpret_cast<volatile int*>(&consumers_done)) {
      if (warp == 10) {
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
        if (kEnv & 4) {  // as the controller: the timeout check reads %globaltimer every poll
          unsigned long long t;
          asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
          v += t & 1;
        }
      } else {
        asm volatile("st.global.u64 [%0], %1;" ::"l"(ctr + 8), "l"(v + 1) : "memory");
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        asm volatile("red.relaxed.gpu.global.add.u64 [%0], 1;" ::"l"(ctr + 4) : "memory");
      }
    }
    sink[blockIdx.x * 256 + 255] = (float)v;
    return;
  }
  const uint32_t base = smem_u32(ring);
  if (warp == 9) {  // the loader
    if (lane != 0) return;
    const char* src = weights + (long long)blockIdx.x * PAGES * PAGE_BYTES / 8;
    for (int p = 0; p < PAGES; ++p) {
      const int s = p % NUM_PAGES;
      const uint32_t round = p / NUM_PAGES;
      wait<kHint>(smem_u32(&empty[s]), (round & 1u) ^ 1u);
      const uint32_t bar = smem_u32(&full[s]);
      if (kCopy) {
        mbar_expect(bar, PAGE_BYTES);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(base + s * PAGE_BYTES),
            "l"(src + (long long)(p % (PAGES / 8)) * PAGE_BYTES), "r"(PAGE_BYTES), "r"(bar)
            : "memory");
      } else {
        mbar_arrive(bar);
      }
    }
    return;
  }
  if (warp >= CONSUMERS) return;
  float c[4] = {0.f, 0.f, 0.f, 0.f}, d[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t xa = smem_u32(xs) + (lane & 3) * 16;
  const long long t0 = clock64();
  for (int p = 0; p < PAGES; ++p) {
    const int s = p % NUM_PAGES;
    wait<kHint>(smem_u32(&full[s]), (p / NUM_PAGES) & 1u);
    if (kUnits) {
      const uint32_t pg = base + s * PAGE_BYTES + lane * 16;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 w = lds(pg + (warp + j * CONSUMERS) * 512);
        const uint4 x = lds(xa + j * 64);
        float* acc = (j & 1) ? d : c;
        mma(acc, w.x, w.y, x.x, x.y);
        mma(acc, w.z, w.w, x.z, x.w);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_u32(&empty[s]));
  }
  const long long t1 = clock64();
  if (lane == 0 && warp == 0) atomicExch(&consumers_done, 1);
  if (lane == 0) cycles[blockIdx.x * CONSUMERS + warp] = t1 - t0;
  sink[blockIdx.x * 256 + threadIdx.x] = c[0] + c[1] + c[2] + c[3] + d[0] + d[1] + d[2] + d[3];
}

template <bool kCopy, bool kUnits, bool kHint, int kEnv = 0>
void run(const char* name, int blocks, const char* w, long long* cyc, float* sink,
         unsigned long long* ctr) {
  auto k = bench<kCopy, kUnits, kHint, kEnv>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, NUM_PAGES * PAGE_BYTES);
  k<<<blocks, 384, NUM_PAGES * PAGE_BYTES>>>(w, cyc, sink, ctr);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<<<blocks, 384, NUM_PAGES * PAGE_BYTES>>>(w, cyc, sink, ctr);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  long long host[132 * CONSUMERS];
  cudaMemcpy(host, cyc, sizeof(long long) * blocks * CONSUMERS, cudaMemcpyDeviceToHost);
  double mean = 0;
  for (int i = 0; i < blocks * CONSUMERS; ++i) mean += host[i];
  mean /= blocks * CONSUMERS;
  const double gbs = (double)blocks * PAGES * PAGE_BYTES / (ms * 1e-3) / 1e9;
  printf("%-34s blocks %3d: %7.1f cycles/page, %6.3f us/page (events), %7.1f GB/s in all, "
         "%5.1f GB/s per SM  [%s]\n", name, blocks, mean / PAGES, ms * 1e3 / PAGES, gbs,
         gbs / blocks, cudaGetErrorString(cudaGetLastError()));
}

int main() {
  const size_t bytes = (size_t)132 * PAGES * PAGE_BYTES / 8;
  char* w;
  long long* cyc;
  float* sink;
  cudaMalloc(&w, bytes);
  cudaMemset(w, 1, bytes);
  cudaMalloc(&cyc, sizeof(long long) * 132 * CONSUMERS);
  cudaMalloc(&sink, sizeof(float) * 132 * 256);
  unsigned long long* ctr;
  cudaMalloc(&ctr, sizeof(unsigned long long) * 132 * 16);
  cudaMemset(ctr, 0, sizeof(unsigned long long) * 132 * 16);
  for (int blocks : {1, 132}) {
    run<false, false, false>("no copy, no units", blocks, w, cyc, sink, ctr);
    run<false, true, false>("no copy, units", blocks, w, cyc, sink, ctr);
    run<false, true, false, 1>("no copy, units, poller", blocks, w, cyc, sink, ctr);
    run<false, true, false, 2>("no copy, units, fencer", blocks, w, cyc, sink, ctr);
    run<false, true, false, 3>("no copy, units, poller+fencer", blocks, w, cyc, sink, ctr);
    run<false, true, false, 5>("no copy, units, poller reading the timer", blocks, w, cyc, sink,
                               ctr);
    run<false, false, false, 3>("no copy, no units, poller+fencer", blocks, w, cyc, sink, ctr);
    run<true, true, false>("copy, units", blocks, w, cyc, sink, ctr);
    run<true, true, false, 3>("copy, units, poller+fencer", blocks, w, cyc, sink, ctr);
  }
  return 0;
}
