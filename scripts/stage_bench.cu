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
// `load` 1 (thirty-first session): the ninth warp streams "weights" as the runtime's loader
// does all along: 16 KB bulk copies of the CTA's own 4 MB region (far more than L2 holds, so
// from HBM) into a ring of LOAD_PAGES pages, a page reissued as soon as its copy lands. Does a
// full-rate weight stream on every SM slow the broadcast read of x (perf-log, thirty-first
// session: the megakernel's b16 input takes ~2x stage_bench's time)?
// The depth table (thirty-third session): the loader keeps at most `depth` copies in flight
// (page i waits for page i - depth to land); a phase that reads nothing or 64 KB against it, and
// the stream's rate. Does a shallower stream keep HBM fed and the consumers' round trips short?
// Without arguments: the rewrite and depth tables; `/tmp/stb x y` adds the older ones.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/stb scripts/stage_bench.cu && /tmp/stb
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#include "bench.cuh"

constexpr int THREADS = 256, PHASES = 500, MAX_BYTES = 96 * 1024, CHUNK = 4096;
constexpr int LOAD_PAGES = 4, LOAD_PAGE = 16 * 1024;
constexpr long long LOAD_REGION = 4ll << 20;  // bytes of "weights" a CTA streams, cycled

using mpk::ptx::smem_u32;
__device__ __forceinline__ unsigned long long now() { return mpk::ptx::globaltimer(); }
__device__ __forceinline__ void cta_bar() { mpk::ptx::named_sync(1, THREADS); }
using probe::mbar_wait;

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
      mpk::ptx::mbar_arrive_expect_tx(bar, (uint32_t)bytes);
      for (int o = 0; o < bytes; o += CHUNK)
        probe::bulk_copy(smem_u32(dst + o), src + o, (uint32_t)min(CHUNK, bytes - o), bar);
    }
    mbar_wait(bar, phase & 1u);
  }
}

// The ninth warp's lane 0 as the runtime's loader: page i of the stream into ring slot
// i % LOAD_PAGES once the copy that used the slot before has landed, until the consumers finish;
// then every copy in flight is waited for (none may outlive the CTA).
// At most `depth` (<= LOAD_PAGES) copies in flight: page i waits for page i - depth to land.
__device__ long long stream_weights(const char* w, char* ring, unsigned long long* bars,
                                    volatile int* finished, int depth) {
  long long i = 0;
  for (; !*finished; ++i) {
    const int slot = (int)(i % LOAD_PAGES);
    const uint32_t bar = smem_u32(bars + slot);
    if (i >= LOAD_PAGES) mbar_wait(bar, (uint32_t)((i / LOAD_PAGES - 1) & 1));
    if (depth < LOAD_PAGES && i >= depth)
      mbar_wait(smem_u32(bars + (i - depth) % LOAD_PAGES),
                (uint32_t)(((i - depth) / LOAD_PAGES) & 1));
    mpk::ptx::mbar_arrive_expect_tx(bar, LOAD_PAGE);
    probe::bulk_copy(smem_u32(ring + slot * LOAD_PAGE), w + (i * LOAD_PAGE) % LOAD_REGION,
                     LOAD_PAGE, bar);
  }
  for (long long j = i > LOAD_PAGES ? i - LOAD_PAGES : 0; j < i; ++j)
    mbar_wait(smem_u32(bars + j % LOAD_PAGES), (uint32_t)((j / LOAD_PAGES) & 1));
  return i;
}

template <int kMethod, bool kPoll, bool kLoad = false>
__global__ void __launch_bounds__(THREADS + 32, 1)
    bench(char* x, unsigned long long* ctr, int bytes, int shared, unsigned long long* elapsed,
          unsigned* sink, int rewrite, const char* weights, int depth = LOAD_PAGES,
          unsigned long long* pages = nullptr) {
  extern __shared__ __align__(128) char xs[];
  __shared__ __align__(8) unsigned long long bar;
  __shared__ __align__(8) unsigned long long load_bars[LOAD_PAGES];
  __shared__ volatile int finished;
  const int tid = threadIdx.x, ctas = gridDim.x;
  if (tid == 0) {
    mpk::ptx::mbar_init(smem_u32(&bar), 1);
    for (int j = 0; j < LOAD_PAGES; ++j) mpk::ptx::mbar_init(smem_u32(load_bars + j), 1);
    mpk::ptx::mbar_init_fence();
    finished = 0;
  }
  __syncthreads();
  if (tid >= THREADS) {  // the poller, or the loader
    unsigned long long v = 0;
    if (kLoad && tid == THREADS) {
      const long long n = stream_weights(weights + blockIdx.x * LOAD_REGION, xs + MAX_BYTES,
                                         load_bars, &finished, depth);
      if (pages != nullptr) atomicAdd(pages, (unsigned long long)n);
    }
    else if (kPoll && tid == THREADS)
      while (!finished) v += mpk::ptx::ld_acquire_u64(ctr + 1 + blockIdx.x);
    if (v == 1) sink[0] = 1;
    return;
  }
  const unsigned long long t0 = now();
  unsigned acc = 0;
  for (int p = 0; p < PHASES; ++p) {
    if (tid == 0) probe::wait_phase(ctr, p);
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
    if (tid == 0) probe::signal_phase(ctr);
  }
  sink[blockIdx.x * THREADS + tid] = acc;
  cta_bar();
  if (tid == 0) finished = 1;
  if (blockIdx.x == 0 && tid == 0) *elapsed = now() - t0;
}

double g_stream_tbs = 0;  // the last loaded run's stream rate (all CTAs' pages / its time)

template <int kMethod, bool kPoll = false, bool kLoad = false>
double run(int bytes, int shared, int ctas, int smem_kb = MAX_BYTES / 1024, int rewrite = 0,
           int depth = LOAD_PAGES) {
  char *x, *weights = nullptr;
  unsigned long long *ctr, *elapsed, *pages;
  unsigned* sink;
  if (kLoad) {  // the ring follows the staged bytes
    smem_kb = smem_kb > (MAX_BYTES + LOAD_PAGES * LOAD_PAGE) / 1024
                  ? smem_kb : (MAX_BYTES + LOAD_PAGES * LOAD_PAGE) / 1024;
    cudaMalloc(&weights, ctas * LOAD_REGION);
    cudaMemset(weights, 3, ctas * LOAD_REGION);
  }
  cudaMalloc(&x, 2ll * ctas * MAX_BYTES);
  cudaMemset(x, 1, 2ll * ctas * MAX_BYTES);
  cudaMalloc(&ctr, 8 * (ctas + 1));
  cudaMemset(ctr, 0, 8 * (ctas + 1));
  cudaMalloc(&elapsed, 8);
  cudaMalloc(&pages, 8);
  cudaMemset(pages, 0, 8);
  cudaMalloc(&sink, ctas * THREADS * 4);
  auto k = bench<kMethod, kPoll, kLoad>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_kb * 1024);
  k<<<ctas, THREADS + 32, smem_kb * 1024>>>(x, ctr, bytes, shared, elapsed, sink, rewrite,
                                            weights, depth, pages);
  const cudaError_t e = cudaDeviceSynchronize();
  unsigned long long ns = 0, npages = 0;
  cudaMemcpy(&ns, elapsed, 8, cudaMemcpyDeviceToHost);
  cudaMemcpy(&npages, pages, 8, cudaMemcpyDeviceToHost);
  g_stream_tbs = ns ? npages * (double)LOAD_PAGE / ns / 1e3 : 0;
  cudaFree(x), cudaFree(ctr), cudaFree(elapsed), cudaFree(sink), cudaFree(weights), cudaFree(pages);
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
    if (argc < 3) break;  // the first table only with two arguments (measured in call 5)
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
  printf("\nthe loader's copies in flight (depth pages of 16 KB) against a phase that reads "
         "nothing / 64 KB (cp16), and the stream's rate:\n%6s %9s %9s %9s\n", "depth",
         "no read", "64 KB", "TB/s");
  for (int depth = 1; depth <= LOAD_PAGES; ++depth) {
    const double none = run<-1, false, true>(4096, 1, sms, 96, 1, depth);
    const double tbs = g_stream_tbs;
    printf("%6d %9.3f %9.3f %9.2f\n", depth, none, run<0, false, true>(65536, 1, sms, 96, 1, depth),
           tbs);
  }
  if (argc < 3) return 0;  // the older tables with two arguments
  printf("\nshared, rewrite 1, with the loader streaming (load 1) or not:\n%8s %6s %8s %8s\n",
         "bytes", "load", "cp16", "bulk");
  for (int bytes : {0, 16384, 32768, 65536, 98304}) {
    const int b = bytes ? bytes : 4096;  // 0: no read at all (the phase's own cost)
    printf("%8d %6d %8.3f %8.3f\n", bytes, 0,
           bytes ? run<0>(b, 1, sms, 96, 1) : run<-1>(b, 1, sms, 96, 1),
           bytes ? run<2>(b, 1, sms, 96, 1) : 0.0);
    printf("%8d %6d %8.3f %8.3f\n", bytes, 1,
           bytes ? run<0, false, true>(b, 1, sms, 96, 1) : run<-1, false, true>(b, 1, sms, 96, 1),
           bytes ? run<2, false, true>(b, 1, sms, 96, 1) : 0.0);
  }
  return 0;
}
