// What one dependent phase costs across all SMs, by hand-off protocol (scripts/handoff_bench.cu).
//
// Question (docs/perf-log.md, tenth session): a linear phase of the megakernel spends ~3.5 us
// outside its weight walk (handoff ~0.5, input ~1.2-1.6, epilogue ~0.8, signal ~0.9). How much
// of that is the counter protocol itself (stores, a release fence, a relaxed add, an acquire
// poll, then the input read), and what would a protocol without the fence cost?
// Every CTA (one per SM) runs PHASES phases; in phase p it waits until every CTA finished phase
// p - 1, reads the whole activation x (N floats, written by all CTAs in phase p - 1), reduces it
// and writes its own slice of the next activation. Modes:
//   0 counter: thread 0 polls a counter (ld.acquire.gpu), CTA barrier, read x (ld.global.cg),
//     reduce, store the slice, CTA barrier, thread 0: fence.acq_rel.gpu + red.relaxed.gpu.add
//     (the megakernel's signal, without its warp roles)
//   1 roles: as 0, but a controller warp polls and arrives on an mbarrier the consumers wait on,
//     and a storer warp waits on an mbarrier the consumer warps arrive on, then fences and adds
//     (the megakernel's hand-off as it is)
//   2 flags: each x element is stored with its phase in one 8-byte word (value, phase + 1); a
//     reader polls its own words until every flag is current: no counter, no fence (NCCL's LL
//     protocol; 8-byte aligned stores are single-copy atomic)
// stream: a loader lane keeps 16 KB bulk copies from HBM in flight into a 4-page ring all the
// time, as the megakernel's loader does (the release fence is said to wait for them).
// Prints us per phase (globaltimer over the launch / PHASES) and checks that every mode
// produced the same final activation.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/hob scripts/handoff_bench.cu && /tmp/hob
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

constexpr int THREADS = 256, PHASES = 2000, RING = 4, PAGE = 16384;
constexpr int kMaxPer = 16;  // activation words per thread at most (n <= 4096)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
               " selp.u32 %0, 1, 0, p;\n}"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void signal(unsigned long long* ctr) {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
}
__device__ __forceinline__ uint2 ld_relaxed_v2(const uint2* p) {
  uint2 v;
  asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_v2(uint2* p, uint2 v) {
  asm volatile("st.relaxed.gpu.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y)
               : "memory");
}
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Bars {
  unsigned long long ready, done, full[RING];
};

// Sum of x (N values, this thread's elements tid, tid + THREADS, ...), reduced over the CTA in a
// fixed order: the same result in every mode.
__device__ __forceinline__ float cta_sum(float mine, float* red) {
  for (int o = 16; o; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) red[warp] = mine;
  asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
  float s = 0.f;
  for (int w = 0; w < THREADS / 32; ++w) s += red[w];
  return s;
}

__device__ __forceinline__ float next_value(float sum, int i, int p) {
  return sum * 1e-3f + (float)((i * 7 + p) & 63);
}

template <int kMode, bool kStream>
__global__ void __launch_bounds__(THREADS + 96, 1)
    bench(float* x, uint2* xf, unsigned long long* ctr, int n, const char* hbm, long long hbm_bytes,
          unsigned long long* elapsed) {
  __shared__ Bars bars;
  __shared__ float red[2][THREADS / 32];  // by phase parity (mode 2 has no barrier between phases)
  __shared__ volatile int finished;
  extern __shared__ __align__(1024) char ring[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int ctas = gridDim.x, slice = (n + ctas - 1) / ctas;
  if (tid == 0) {
    mbar_init(smem_u32(&bars.ready), 1);
    mbar_init(smem_u32(&bars.done), THREADS / 32);
    for (int i = 0; i < RING; ++i) mbar_init(smem_u32(&bars.full[i]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    finished = 0;
  }
  __syncthreads();
  const unsigned long long t0 = now();
  if (warp == THREADS / 32 + 2) {  // loader: copies in flight all the time
    if (!kStream || lane != 0) return;
    const long long pages = hbm_bytes / PAGE;
    long long k = blockIdx.x * 97;
    uint32_t i = 0;
    for (; !finished; ++i) {
      const uint32_t s = i % RING, bar = smem_u32(&bars.full[s]);
      if (i >= RING) mbar_wait(bar, ((i / RING) - 1) & 1u);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "n"(PAGE)
                   : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(smem_u32(ring + s * PAGE)), "l"(hbm + (k++ % pages) * PAGE), "n"(PAGE),
          "r"(bar) : "memory");
    }
    for (uint32_t j = i > RING ? i - RING : 0; j < i; ++j)  // the last copies land first
      mbar_wait(smem_u32(&bars.full[j % RING]), (j / RING) & 1u);
    return;
  }
  if (warp == THREADS / 32) {  // controller (mode 1)
    if (kMode != 1 || lane != 0) return;
    for (int p = 0; p < PHASES; ++p) {
      const unsigned long long target = (unsigned long long)p * ctas;
      while (ld_acquire(ctr) < target) {
      }
      mbar_arrive(smem_u32(&bars.ready));
    }
    return;
  }
  if (warp == THREADS / 32 + 1) {  // storer (mode 1)
    if (kMode != 1 || lane != 0) return;
    for (int p = 0; p < PHASES; ++p) {
      mbar_wait(smem_u32(&bars.done), p & 1);
      signal(ctr);
    }
    return;
  }
  for (int p = 0; p < PHASES; ++p) {
    const int in = p & 1, out = in ^ 1;
    float mine = 0.f;
    if (kMode == 2) {
      // Every word of this thread in flight at once, then re-read only the stale ones (phase
      // p's input carries flag p); n / THREADS <= kMaxPer words a thread.
      const uint2* src = xf + (long long)in * n;
      uint2 v[kMaxPer];
#pragma unroll
      for (int j = 0; j < kMaxPer; ++j)
        if (tid + j * THREADS < n) v[j] = ld_relaxed_v2(src + tid + j * THREADS);
#pragma unroll
      for (int j = 0; j < kMaxPer; ++j) {
        if (tid + j * THREADS >= n) continue;
        while (v[j].y != (uint32_t)p) v[j] = ld_relaxed_v2(src + tid + j * THREADS);
        mine += __uint_as_float(v[j].x);
      }
    } else {
      if (kMode == 0) {
        if (tid == 0) {
          const unsigned long long target = (unsigned long long)p * ctas;
          while (ld_acquire(ctr) < target) {
          }
        }
        asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
      } else {
        mbar_wait(smem_u32(&bars.ready), p & 1);
      }
      const float* src = x + (long long)in * n;
      for (int i = tid; i < n; i += THREADS) mine += __ldcg(src + i);
    }
    const float sum = cta_sum(mine, red[p & 1]);
    const int lo = blockIdx.x * slice;
    for (int i = lo + tid; i < min(n, lo + slice); i += THREADS) {
      const float y = next_value(sum, i, p);
      if (kMode == 2)
        st_relaxed_v2(xf + (long long)out * n + i, make_uint2(__float_as_uint(y), p + 1));
      else
        x[(long long)out * n + i] = y;
    }
    if (kMode == 0) {
      asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
      if (tid == 0) signal(ctr);
    } else if (kMode == 1) {
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_u32(&bars.done));
    }
  }
  asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
  if (tid == 0) {
    finished = 1;
    if (blockIdx.x == 0) *elapsed = now() - t0;
  }
}

template <int kMode, bool kStream>
double run(int n, int ctas, std::vector<float>& result) {
  float* x;
  uint2* xf;
  unsigned long long *ctr, *elapsed;
  char* hbm;
  const long long hbm_bytes = 2ll << 30;
  cudaMalloc(&x, 2 * n * sizeof(float));
  cudaMalloc(&xf, 2 * n * sizeof(uint2));
  cudaMalloc(&ctr, 8);
  cudaMalloc(&elapsed, 8);
  cudaMalloc(&hbm, hbm_bytes);
  cudaMemset(hbm, 1, hbm_bytes);
  std::vector<float> x0(n);
  std::vector<uint2> xf0(2 * n);
  for (int i = 0; i < n; ++i) x0[i] = (float)(i % 13);
  for (int i = 0; i < n; ++i) xf0[i] = make_uint2(0, 0), std::memcpy(&xf0[i].x, &x0[i], 4);
  for (int i = n; i < 2 * n; ++i) xf0[i] = make_uint2(0, 0xffffffffu);
  cudaMemcpy(x, x0.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(xf, xf0.data(), 2 * n * sizeof(uint2), cudaMemcpyHostToDevice);
  cudaMemset(ctr, 0, 8);
  auto k = bench<kMode, kStream>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, RING * PAGE);
  k<<<ctas, THREADS + 96, RING * PAGE>>>(x, xf, ctr, n, hbm, hbm_bytes, elapsed);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("error: %s\n", cudaGetErrorString(e));
    return -1;
  }
  unsigned long long ns;
  cudaMemcpy(&ns, elapsed, 8, cudaMemcpyDeviceToHost);
  result.assign(n, 0.f);
  const int last = PHASES & 1;
  if (kMode == 2) {
    std::vector<uint2> f(n);
    cudaMemcpy(f.data(), xf + (long long)last * n, n * sizeof(uint2), cudaMemcpyDeviceToHost);
    for (int i = 0; i < n; ++i) std::memcpy(&result[i], &f[i].x, 4);
  } else {
    cudaMemcpy(result.data(), x + (long long)last * n, n * sizeof(float), cudaMemcpyDeviceToHost);
  }
  cudaFree(x), cudaFree(xf), cudaFree(ctr), cudaFree(elapsed), cudaFree(hbm);
  return ns / 1e3 / PHASES;
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  printf("%d SMs, %d phases; us per phase\n", sms, PHASES);
  printf("%8s %6s %10s %10s %10s\n", "n", "stream", "counter", "roles", "flags");
  for (int n : {1024, 4096}) {
    for (int stream = 0; stream < 2; ++stream) {
      std::vector<float> r0, r1, r2;
      double a, b, c;
      if (stream) {
        a = run<0, true>(n, sms, r0), b = run<1, true>(n, sms, r1), c = run<2, true>(n, sms, r2);
      } else {
        a = run<0, false>(n, sms, r0), b = run<1, false>(n, sms, r1), c = run<2, false>(n, sms, r2);
      }
      const bool same = r0 == r1 && r1 == r2;
      printf("%8d %6d %10.3f %10.3f %10.3f %s\n", n, stream, a, b, c,
             same ? "" : "RESULTS DIFFER");
    }
  }
  return 0;
}
