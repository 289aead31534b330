// What does a cp.async.bulk.prefetch.L2 cost the SM that issues it? (scripts/prefetch_bench.cu)
//
// Question (docs/perf-log.md, twentieth and twenty-first sessions): four times a bulk L2
// prefetch or bulk copy beside the runtime loader made a step slower: the experts through
// per-warp bulk-copy rings (1.4-1.7x slower), the experts' weights prefetched to L2 as soon as
// their addresses were known (+2-3.4 us a phase, also with the loader's copies switched off),
// and the loader asking L2 for its next 8 pages while its ring was full (8B models 12% slower).
// Every CTA (one per SM) streams its own `mb` MB of a buffer far larger than L2 into shared
// memory, the way the megakernel's loader does: one thread issues 16 KB cp.async.bulk copies
// into a ring of `pages` pages (an mbarrier each), the consumer warps wait for each page and
// release it. Modes:
//   0 copy       the ring alone (the loader's pace at full HBM load)
//   1 ahead      before each copy, the loader prefetches the page `ahead` pages on (the
//                twenty-first session's lookahead, issued on every page)
//   2 blocked    the same, but only when the ring is full (the lookahead as it was built)
//   3 regs       no copies: the 256 consumer threads read the same bytes with 16-byte
//                ld.global.nc loads, 4 in flight each (the MoE experts' register loads)
//   4 regs_pf    mode 3, with thread 0 prefetching `ahead` x 16 KB ahead of the loads
// Printed per mode: GB/s over all SMs (bytes / slowest CTA's time) and the loader's mean cycles
// to issue one prefetch (clock64 around the instruction: does it block the issuing thread?).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/pfb scripts/prefetch_bench.cu && /tmp/pfb [mb] [pages] [ahead]
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

#include "../src/mpk/backends/cuda/csrc/ptx.cuh"       // the runtime's own PTX wrappers
#include "../src/mpk/tasks/common/memory.cuh"           // the experts' weight loads

namespace ptx = mpk::ptx;

constexpr int THREADS = 256 + 32;  // consumers, then the loader warp
constexpr int PAGE = 16384, MAX_PAGES = 12;

__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  while (!ptx::mbar_try_wait(bar, parity)) {
  }
}

struct Out {
  unsigned long long ns;   // this CTA's time
  unsigned long long pf_cycles, pf_count;  // the issuing thread's cycles inside prefetch_l2
  unsigned sink;
};

__device__ __forceinline__ void timed_prefetch(const char* p, Out& o) {
  const long long c0 = clock64();
  ptx::prefetch_l2_bulk(p, PAGE);
  o.pf_cycles += clock64() - c0;
  ++o.pf_count;
}

__global__ void __launch_bounds__(THREADS, 1)
bench(const char* buf, size_t per_cta, int pages, int ahead, int mode, Out* out) {
  extern __shared__ __align__(1024) char ring[];
  __shared__ __align__(8) unsigned long long full[MAX_PAGES], empty[MAX_PAGES];
  const int tid = threadIdx.x, warp = tid / 32;
  const char* src = buf + per_cta * blockIdx.x;
  const int n = (int)(per_cta / PAGE);
  if (tid == 0)
    for (int i = 0; i < pages; ++i) {
      ptx::mbar_init(ptx::smem_u32(&full[i]), 1);
      ptx::mbar_init(ptx::smem_u32(&empty[i]), 256);
    }
  ptx::mbar_init_fence();
  __syncthreads();
  Out o{0, 0, 0, 0};
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (mode == 3 || mode == 4) {  // register loads by the consumers, 4 vectors in flight each
    if (warp < 8) {
      unsigned acc = 0;
      for (int p = 0; p < n; ++p) {
        if (mode == 4 && tid == 0 && p + ahead < n)
          timed_prefetch(src + (size_t)(p + ahead) * PAGE, o);
        const char* pg = src + (size_t)p * PAGE;
        uint4 v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = mpk::dev::ld_weight_v4(pg + (tid + 256 * i) * 16);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc ^= v[i].x ^ v[i].w;
      }
      o.sink = acc;
    }
  } else if (warp == 8) {  // the loader
    const uint64_t policy = ptx::l2_evict_first_policy();  // as the loader's copies
    if ((tid & 31) == 0)
      for (int p = 0; p < n; ++p) {
        const int s = p % pages;
        const uint32_t e = ptx::smem_u32(&empty[s]), parity = ((p / pages) & 1) ^ 1;
        const bool free_now = ptx::mbar_test_wait(e, parity);
        if ((mode == 1 || (mode == 2 && !free_now)) && p + ahead < n)
          timed_prefetch(src + (size_t)(p + ahead) * PAGE, o);
        wait(e, parity);
        const uint32_t f = ptx::smem_u32(&full[s]);
        ptx::mbar_arrive_expect_tx(f, PAGE);
        ptx::bulk_copy_g2s(ptx::smem_u32(ring + s * PAGE), src + (size_t)p * PAGE, PAGE, f, policy);
      }
  } else {  // consumers: wait for each page, read a word, release it
    unsigned acc = 0;
    for (int p = 0; p < n; ++p) {
      const int s = p % pages;
      wait(ptx::smem_u32(&full[s]), (p / pages) & 1);
      acc ^= reinterpret_cast<const unsigned*>(ring + s * PAGE)[tid];
      ptx::mbar_arrive(ptx::smem_u32(&empty[s]));
    }
    o.sink = acc;
  }
  __syncthreads();
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (tid == 0 || tid == 256) {  // the prefetching thread of its mode
    Out& d = out[blockIdx.x];
    if (tid == 0) { d.ns = t1 - t0; d.sink = o.sink; }
    if ((tid == 0) == (mode >= 3)) { d.pf_cycles = o.pf_cycles; d.pf_count = o.pf_count; }
  }
}

int main(int argc, char** argv) {
  const int mb = argc > 1 ? atoi(argv[1]) : 4;
  const int pages = argc > 2 ? (atoi(argv[2]) > MAX_PAGES ? MAX_PAGES : atoi(argv[2])) : 8;
  const int ahead = argc > 3 ? atoi(argv[3]) : 8;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms == 0) {
    fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const size_t per_cta = (size_t)mb << 20, total = per_cta * sms;
  char* buf = nullptr;
  Out* out = nullptr;
  if (cudaMalloc(&buf, total) != cudaSuccess ||
      cudaMalloc(&out, sms * sizeof(Out)) != cudaSuccess) {
    fprintf(stderr, "cudaMalloc of %zu MB failed\n", total >> 20);
    return 1;
  }
  cudaMemset(buf, 1, total);  // real bytes: never time a read of untouched memory
  const int smem = pages * PAGE;
  cudaFuncSetAttribute(bench, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const char* names[] = {"copy", "ahead", "blocked", "regs", "regs_pf"};
  printf("%d SMs, %d MB a CTA (%zu MB in all), %d pages, prefetch %d pages ahead\n", sms, mb,
         total >> 20, pages, ahead);
  Out* host = new Out[sms];
  for (int mode = 0; mode < 5; ++mode) {
    double best = 0;
    for (int rep = 0; rep < 4; ++rep) {  // the first is a warm-up
      cudaMemset(out, 0, sms * sizeof(Out));
      bench<<<sms, THREADS, smem>>>(buf, per_cta, pages, ahead, mode, out);
      if (cudaDeviceSynchronize() != cudaSuccess) {
        fprintf(stderr, "%s: %s\n", names[mode], cudaGetErrorString(cudaGetLastError()));
        return 1;
      }
      cudaMemcpy(host, out, sms * sizeof(Out), cudaMemcpyDeviceToHost);
      unsigned long long worst = 0, cyc = 0, cnt = 0;
      for (int i = 0; i < sms; ++i) {
        worst = host[i].ns > worst ? host[i].ns : worst;
        cyc += host[i].pf_cycles;
        cnt += host[i].pf_count;
      }
      const double gbs = (double)total / (double)worst;
      if (rep > 0 && gbs > best) best = gbs;
      if (rep == 3)
        printf("%-8s %7.1f GB/s   prefetch issue %.0f cycles (%llu issued)\n", names[mode],
               best, cnt ? (double)cyc / cnt : 0.0, cnt);
    }
  }
  delete[] host;
  return 0;
}
