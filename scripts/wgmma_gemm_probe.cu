// The prefill GEMM tile on wgmma, alone: C[M, N] = A[M, K] . B[N, K]^T in bf16 with fp32
// accumulation, checked against a naive kernel and timed (CUDA events, median of 20).
//
// Why: the gemm kind's tile (tasks/gemm/sm90.cuh, on wgmma since the seventh session; the
// mma.sync tile before it ran ~195 TFLOP/s in the megakernel) and variants of it, timed apart
// from the megakernel, in its shape: 256 threads (its consumer warps, two warpgroups), one CTA
// per SM, 128 x BN outputs per CTA, K in steps of 64 through a cp.async ring into
// 128-byte-swizzled shared memory, each warpgroup one m64nBNk16 wgmma per 16 k:
//   BN 128, stages 3, keep 0  tasks/gemm/sm90.cuh's: a k tile's MMAs are issued, then the copies
//                             of the tile two ahead, then the MMAs are waited for;
//   stages S, keep 1          one tile's MMAs stay in flight while the next tile's are issued
//                             (the copies run S - 2 tiles ahead);
//   BN 256                    the 128 x 256 tile: 4/3 the FLOPs per staged byte.
// Seventh session, H200 (TFLOP/s on 1024 x 6144 x 4096 / 1024 x 4096 x 12288): 128/3/0 285 /
// 318, 128/4/1 287 / 323, 128/5/1 291 / 320, 256/3/0 284 / 413, 256/4/1 290 / 433 (6,144
// columns are 1.45 waves of 256-wide tiles on 132 SMs; 4,096 are one). Copies issued before
// the MMAs: 272 / 309.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a scripts/wgmma_gemm_probe.cu \
//     -o /tmp/wgmma_probe
//   /tmp/wgmma_probe            (prints one JSON line per shape; exit 1 if any result is wrong)
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "../src/mpk/tasks/common/wgmma.cuh"  // the descriptor, swizzle and MMA of tasks/gemm

namespace {

constexpr int BM = 128, BK = 64, THREADS = 256;
constexpr int A_BYTES = BM * 128;  // 128 rows x 64 bf16 (128 B), swizzled; then BN rows of B
__host__ __device__ constexpr int stage_bytes(int bn) { return A_BYTES + bn * 128; }
__host__ __device__ constexpr int smem_bytes(int bn, int stages) {
  return stages * stage_bytes(bn) + 1024;  // + the alignment to 1024 (the swizzle atom)
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared (zeros when !valid), completion by commit / wait groups.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Rows 0..127 of the stage are A's (m0 ...), the next BN are B's (n0 ...).
template <int BN>
__device__ __forceinline__ void load_stage(uint32_t stage, const __nv_bfloat16* A,
                                           const __nv_bfloat16* B, int M, int N, int K, int m0,
                                           int n0, int k0) {
  for (int i = threadIdx.x; i < (BM + BN) * 8; i += THREADS) {
    const int r = i / 8, c = i % 8, k = k0 + c * 8;
    const bool is_a = r < BM;
    const int row = is_a ? m0 + r : n0 + r - BM, rows = is_a ? M : N;
    const __nv_bfloat16* base = is_a ? A : B;
    const bool ok = row < rows && k < K;
    cp_async16(stage + mpk::dev::sw128_offset(r, c), ok ? base + (long long)row * K + k : base,
               ok);
  }
}


// One CTA: outputs [m0, m0 + 128) x [n0, n0 + BN); warpgroup w computes rows m0 + 64w ...
// STAGES slots; KEEP wgmma groups (0 or 1) may stay in flight past a tile.
template <int BN, int STAGES, int KEEP>
__global__ void __launch_bounds__(THREADS) gemm_wgmma(const __nv_bfloat16* A,
                                                      const __nv_bfloat16* B, float* C, int M,
                                                      int N, int K) {
  static_assert(KEEP == 0 || KEEP == 1, "one tile's MMAs in flight at most");
  constexpr int AHEAD = STAGES - 1 - KEEP;  // tiles copied ahead of the one multiplied
  extern __shared__ __align__(1024) unsigned char raw[];
  const uint32_t smem = (smem_u32(raw) + 1023u) & ~1023u;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
  const int nk = (K + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < nk) load_stage<BN>(smem + s * stage_bytes(BN), A, B, M, N, K, m0, n0, s * BK);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  for (int kt = 0; kt < nk; ++kt) {
    asm volatile("cp.async.wait_group %0;" ::"n"(AHEAD - 1) : "memory");
    mpk::dev::fence_proxy_async_shared();  // cp.async writes -> wgmma's (async proxy) reads
    // Every thread's copies of tile kt landed; both warpgroups' MMAs of tile kt - 1 - KEEP are
    // done, so its slot, (kt + AHEAD) % STAGES, may be overwritten.
    __syncthreads();
    const uint32_t stage = smem + (kt % STAGES) * stage_bytes(BN);
    const uint32_t a = stage + wg * 64 * 128, b = stage + A_BYTES;
    mpk::dev::wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < BK / 16; ++k16)
      mpk::dev::wgmma_m64k16_bf16<BN>(d, mpk::dev::sw128_desc(a + 32 * k16),
                                      mpk::dev::sw128_desc(b + 32 * k16));
    mpk::dev::wgmma_commit();
    const int next = kt + AHEAD;
    if (next < nk)
      load_stage<BN>(smem + (next % STAGES) * stage_bytes(BN), A, B, M, N, K, m0, n0,
                     next * BK);
    asm volatile("cp.async.commit_group;" ::: "memory");
    mpk::dev::wgmma_wait<KEEP>();  // before the barrier that frees a slot for the copies
  }
  mpk::dev::wgmma_wait_all();
  // Fragment layout (as mma.sync's C per n8 tile): d[4i + 0, 1] = row 16 warp + g, columns
  // 8i + 2t, + 1; d[4i + 2, 3] = row + 8; g = lane / 4, t = lane % 4.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + wg * 64 + warp * 16 + g + 8 * h, col = n0 + 8 * i + 2 * t;
      if (row >= M) continue;
      if (col < N) C[(long long)row * N + col] = d[4 * i + 2 * h];
      if (col + 1 < N) C[(long long)row * N + col + 1] = d[4 * i + 2 * h + 1];
    }
}

__global__ void gemm_naive(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C, int M,
                           int N, int K) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x, row = blockIdx.y;
  if (col >= N) return;
  float s = 0.f;
  for (int k = 0; k < K; ++k)
    s = fmaf(__bfloat162float(A[(long long)row * K + k]),
             __bfloat162float(B[(long long)col * K + k]), s);
  C[(long long)row * N + col] = s;
}

// One CTA per SM as in the megakernel: each asks for more than half of an SM's shared memory.
constexpr int ONE_CTA_PER_SM = 116 * 1024;

template <int BN, int STAGES, int KEEP>
int check(int M, int N, int K) {
  const int smem = std::max(smem_bytes(BN, STAGES), ONE_CTA_PER_SM);
  if (K % 8) {  // the 16-byte copies need whole 8-element groups of k (as tasks/gemm checks)
    printf("{\"M\": %d, \"N\": %d, \"K\": %d, \"ok\": false, \"why\": \"K %% 8\"}\n", M, N, K);
    return 1;
  }
  std::vector<__nv_bfloat16> ha((size_t)M * K), hb((size_t)N * K);
  uint32_t x = 12345u;
  auto rnd = [&x]() { x = x * 1664525u + 1013904223u; return ((x >> 8) & 0xffff) / 32768.f - 1.f; };
  for (auto& v : ha) v = __float2bfloat16(rnd());
  for (auto& v : hb) v = __float2bfloat16(rnd() / std::sqrt((float)K));
  __nv_bfloat16 *a, *b;
  float *c, *ref;
  cudaMalloc(&a, ha.size() * 2);
  cudaMalloc(&b, hb.size() * 2);
  cudaMalloc(&c, (size_t)M * N * 4);
  cudaMalloc(&ref, (size_t)M * N * 4);
  cudaMemcpy(a, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(b, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(c, 0xff, (size_t)M * N * 4);  // NaN poison: an unwritten output shows
  auto kernel = gemm_wgmma<BN, STAGES, KEEP>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const dim3 grid((N + BN - 1) / BN, (M + BM - 1) / BM);
  kernel<<<grid, THREADS, smem>>>(a, b, c, M, N, K);
  gemm_naive<<<dim3((N + 127) / 128, M), 128>>>(a, b, ref, M, N, K);
  cudaError_t err = cudaDeviceSynchronize();
  std::vector<float> hc((size_t)M * N), hr((size_t)M * N);
  cudaMemcpy(hc.data(), c, hc.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(hr.data(), ref, hr.size() * 4, cudaMemcpyDeviceToHost);
  double num = 0, den = 0;
  size_t bad = 0;
  for (size_t i = 0; i < hc.size(); ++i) {
    if (!std::isfinite(hc[i])) { ++bad; continue; }
    num += (hc[i] - hr[i]) * (double)(hc[i] - hr[i]);
    den += (double)hr[i] * hr[i];
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  std::vector<float> ms;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < 23; ++i) {
    cudaEventRecord(e0);
    kernel<<<grid, THREADS, smem>>>(a, b, c, M, N, K);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t;
    cudaEventElapsedTime(&t, e0, e1);
    if (i >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const bool ok = err == cudaSuccess && bad == 0 && rel < 1e-3;
  printf("{\"bn\": %d, \"stages\": %d, \"keep\": %d, \"M\": %d, \"N\": %d, \"K\": %d, "
         "\"error\": \"%s\", \"nonfinite\": %zu, \"rel_err\": %.3e, \"median_ms\": %.4f, "
         "\"tflops\": %.1f, \"ok\": %s}\n",
         BN, STAGES, KEEP, M, N, K, cudaGetErrorString(err), bad, rel, med,
         2.0 * M * N * K / med / 1e9,
         ok ? "true" : "false");
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cudaFree(ref);
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  int failed = 0;
  // qwen3-8b's projections at a 1024-row chunk, a ragged shape (odd N), qwen3-0.6b's qkv at 256
  // rows.
  const int shapes[][3] = {{1024, 6144, 4096}, {1024, 4096, 12288}, {200, 327, 200},
                           {256, 4096, 1024}};
  for (const auto& s : shapes) {
    failed |= check<128, 3, 0>(s[0], s[1], s[2]);  // tasks/gemm/sm90.cuh
    failed |= check<128, 4, 1>(s[0], s[1], s[2]);
    failed |= check<128, 5, 1>(s[0], s[1], s[2]);
    failed |= check<256, 3, 0>(s[0], s[1], s[2]);  // twice the FLOPs per byte staged
    failed |= check<256, 4, 1>(s[0], s[1], s[2]);
  }
  return failed;
}
