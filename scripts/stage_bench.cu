// How fast can every SM read the same freshly written activation into shared memory?
// (scripts/stage_bench.cu)
//
// Question (docs/perf-log.md, tenth session): at batch 16 a linear task spends 7.6-10.4 us
// staging its input (16 rows x K bf16, 32-64 KB, the same bytes on every SM) with 16-byte
// cp.async, and copies of weights in flight are not the cause (probe_model no_loader). Is it the
// broadcast itself (every SM reading the same L2 lines), or the 16-byte cp.async path?
// Every CTA (one per SM) runs PHASES phases: wait for every CTA's previous phase (a counter, as
// the megakernel), read `bytes` of x into shared memory by one method, CTA barrier, signal.
// Methods:
//   0 cp16   cp.async.cg 16 B per thread, wait_all (the megakernel's stage_raw)
//   1 ldg16  ld.global.cg.v4 16 B per thread into registers, then st.shared
//   2 bulk   one thread issues cp.async.bulk copies of 4 KB completing on an mbarrier
// `shared` 1: every CTA reads the same bytes (the broadcast); 0: each its own (distinct lines).
// `poll` 1: a ninth warp polls a counter with ld.acquire.gpu all the time, as the megakernel's
// controller does while the consumers run a task (an acquire load compiles to a load and an L1
// invalidation, CCTL.IVALL). A phase's own cost with no read at all is printed as the baseline.
// `rewrite` 1: in each phase the CTAs together rewrite ALL of the next phase's bytes (CTA c a
// contiguous 1/ctas slice, 16-byte stores), as the megakernel's producers do; 0: 32 bytes each.
// `smem` KB: the dynamic shared memory each CTA asks for (at least MAX_BYTES). The megakernel
// takes ~208 KB (weight pages + scratch), which leaves the L1 cache the rest of the 256 KB.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/stb scripts/stage_bench.cu && /tmp/stb
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

constexpr int THREADS = 256, PHASES = 500, MAX_BYTES = 96 * 1024, CHUNK = 4096;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void cta_bar() { asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory"); }

template <int kMethod>
__device__ __forceinline__ void stage(char* dst, const char* src, int bytes, uint32_t bar,
                                      uint32_t phase) {
  const int tid = threadIdx.x;
  if (kMethod == 0) {
    for (int o = tid * 16; o < bytes; o += THREADS * 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst + o)),
                   "l"(src + o) : "memory");
    asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
  } else if (kMethod == 1) {
    constexpr int kPer = MAX_BYTES / (THREADS * 16);
    uint4 v[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int o = (tid + j * THREADS) * 16;
      if (o < bytes)
        asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w) : "l"(src + o));
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int o = (tid + j * THREADS) * 16;
      if (o < bytes) *reinterpret_cast<uint4*>(dst + o) = v[j];
    }
  } else if (kMethod == 2) {
    if (tid == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                   : "memory");
      for (int o = 0; o < bytes; o += CHUNK)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem_u32(dst + o)), "l"(src + o), "r"(min(CHUNK, bytes - o)), "r"(bar)
            : "memory");
    }
    uint32_t done = 0;
    while (!done)
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}"
                   : "=r"(done) : "r"(bar), "r"(phase & 1u) : "memory");
  }
}

template <int kMethod, bool kPoll>
__global__ void __launch_bounds__(THREADS + 32, 1)
    bench(char* x, unsigned long long* ctr, int bytes, int shared, unsigned long long* elapsed,
          unsigned* sink, int rewrite) {
  extern __shared__ __align__(128) char xs[];
  __shared__ __align__(8) unsigned long long bar;
  __shared__ volatile int finished;
  const int tid = threadIdx.x, ctas = gridDim.x;
  if (tid == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    finished = 0;
  }
  __syncthreads();
  if (tid >= THREADS) {  // the poller
    unsigned long long v = 0;
    if (kPoll && tid == THREADS)
      while (!finished) v += ld_acquire(ctr + 1 + blockIdx.x);
    if (v == 1) sink[0] = 1;
    return;
  }
  const unsigned long long t0 = now();
  unsigned acc = 0;
  for (int p = 0; p < PHASES; ++p) {
    if (tid == 0) {
      const unsigned long long target = (unsigned long long)p * ctas;
      while (ld_acquire(ctr) < target) {
      }
    }
    cta_bar();
    // The source: this phase's buffer (two, alternating), shared by all CTAs or per CTA.
    char* src = x + ((long long)(p & 1) * (shared ? 1 : ctas) + (shared ? 0 : blockIdx.x)) *
                        MAX_BYTES;
    if (kMethod >= 0) stage<kMethod>(xs, src, bytes, smem_u32(&bar), (uint32_t)p);
    cta_bar();
    acc += reinterpret_cast<const unsigned*>(xs)[(tid * 37 + p) % (bytes / 4 + 1)];
    // Each CTA rewrites 32 bytes of the next phase's buffer (the producers' stores).
    char* next = x + ((long long)((p + 1) & 1) * (shared ? 1 : ctas) + (shared ? 0 : blockIdx.x)) *
                         MAX_BYTES;
    if (rewrite) {  // this CTA's 16-byte-aligned slice of all the bytes
      const int slice = (bytes / 16 + ctas - 1) / ctas * 16;
      for (int o = blockIdx.x * slice + tid * 16; o < min(bytes, (blockIdx.x + 1) * slice);
           o += THREADS * 16)
        *reinterpret_cast<uint4*>(next + o) = make_uint4(acc, o, p, 1);
    } else if (tid < 8) {
      const int o = ((blockIdx.x * 8 + tid) * 4) % max(bytes, 4);
      *reinterpret_cast<unsigned*>(next + o) = acc;
    }
    cta_bar();
    if (tid == 0) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      asm volatile("red.relaxed.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
    }
  }
  sink[blockIdx.x * THREADS + tid] = acc;
  cta_bar();
  if (tid == 0) finished = 1;
  if (blockIdx.x == 0 && tid == 0) *elapsed = now() - t0;
}

template <int kMethod, bool kPoll = false>
double run(int bytes, int shared, int ctas, int smem_kb = MAX_BYTES / 1024, int rewrite = 0) {
  char* x;
  unsigned long long *ctr, *elapsed;
  unsigned* sink;
  cudaMalloc(&x, 2ll * ctas * MAX_BYTES);
  cudaMemset(x, 1, 2ll * ctas * MAX_BYTES);
  cudaMalloc(&ctr, 8 * (ctas + 1));
  cudaMemset(ctr, 0, 8 * (ctas + 1));
  cudaMalloc(&elapsed, 8);
  cudaMalloc(&sink, ctas * THREADS * 4);
  auto k = bench<kMethod, kPoll>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_kb * 1024);
  k<<<ctas, THREADS + 32, smem_kb * 1024>>>(x, ctr, bytes, shared, elapsed, sink, rewrite);
  const cudaError_t e = cudaDeviceSynchronize();
  unsigned long long ns = 0;
  cudaMemcpy(&ns, elapsed, 8, cudaMemcpyDeviceToHost);
  cudaFree(x), cudaFree(ctr), cudaFree(elapsed), cudaFree(sink);
  if (e != cudaSuccess) {
    printf("error: %s\n", cudaGetErrorString(e));
    return -1;
  }
  return ns / 1e3 / PHASES;
}

int main(int argc, char** argv) {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  printf("%d SMs, %d phases; us per phase (no read: %.3f)\n", sms, PHASES, run<-1>(4096, 1, sms));
  printf("%8s %7s %8s %8s %8s %11s %11s %10s\n", "bytes", "shared", "cp16", "ldg16", "bulk",
         "cp16+poll", "ldg16+poll", "bulk+poll");
  for (int bytes : {4096, 16384, 32768, 65536, 98304}) {
    if (argc < 2) break;  // the first table only with an argument (measured in call 5)
    for (int shared = 1; shared >= 0; --shared) {
      printf("%8d %7d %8.3f %8.3f %8.3f %11.3f %11.3f %10.3f\n", bytes, shared,
             run<0>(bytes, shared, sms), run<1>(bytes, shared, sms), run<2>(bytes, shared, sms),
             run<0, true>(bytes, shared, sms), run<1, true>(bytes, shared, sms),
             run<2, true>(bytes, shared, sms));
    }
  }
  printf("\nshared, 96 KB smem, by rewrite (1: all bytes rewritten every phase):\n%8s %8s %8s %8s "
         "%8s\n", "bytes", "rewrite", "cp16", "ldg16", "bulk");
  for (int bytes : {4096, 16384, 32768, 65536, 98304})
    for (int rw = 0; rw < 2; ++rw)
      printf("%8d %8d %8.3f %8.3f %8.3f\n", bytes, rw, run<0>(bytes, 1, sms, 96, rw),
             run<1>(bytes, 1, sms, 96, rw), run<2>(bytes, 1, sms, 96, rw));
  printf("no read, rewrite 65536: %.3f\n", run<-1>(65536, 1, sms, 96, 1));
  return 0;
}
