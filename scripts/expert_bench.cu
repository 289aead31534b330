// How fast can 132 SMs read a MoE layer's chosen experts, by which load scheme?
// (scripts/expert_bench.cu)
//
// Question (docs/perf-log.md, twentieth to thirty-second sessions): at batch 1 on qwen3-30b-a3b
// the experts' phases take gate_up ~16.8 us and down ~13.4 us a layer against ~12 and ~6 us of
// bytes at the H200's rate; 16-byte register loads keep a few KB a warp in flight, and two
// attempts to keep more in flight inside the megakernel (per-warp rings of 1.5-2 KB bulk copies;
// L2 bulk prefetches) were slower, unexplained. Here the same reads run alone, in a persistent
// kernel of one CTA per SM that does REPS phases separated by a grid barrier (as the megakernel's
// counters), each phase one layer's experts (8 distinct random ids out of 128, a different layer
// each phase, so nothing is in L2 from the phase before):
//   down    (moe_down's split: task t of 132 takes outputs [lo, hi) of H = 2048, 8 slots x
//            I = 768 a row: 16 rows x 1.5 KB = 24 KB contiguous a slot, 192 KB a task)
//     regs    moe_down's scheme: a warp per output, 8 slots x 3 vectors a lane in flight
//     cp_all  every byte of the task copied to shared memory by 16-byte cp.async, then the dots
//     bulk_all  8 bulk copies of 24 KB (one a slot) on one mbarrier, then the dots
//     bulk_ring slot by slot through a ring of 3 x 24 KB stages (bulk copies), each warp keeping
//             its outputs' running sums in registers (a realistic shared-memory budget)
//     cp_ring   the same ring filled by 16-byte cp.async (commit groups)
//   gate_up (moe_gate_up's split at batch 1: task (slot u, tile t of 16) takes rows [lo, hi) of
//            I = 768, 48 rows of gate and of up, 4 KB each: 384 KB a task on 128 SMs)
//     regs4   moe_gate_up's scheme: a warp per row, 4 + 4 vectors a lane in flight, 2 rounds
//     regs8   8 + 8 vectors a lane (one round a row)
//     bulk_ring  stages of half of 8 rows of gate and of up (16 bulk copies of 2 KB: 32 KB), a
//                ring of 3 (96 KB)
//     cp_ring    the same ring by 16-byte cp.async
// Each method's outputs are checked against `regs` (same lanes, same order: bit-identical), so a
// broken scheme cannot post a time. Printed: us a phase minus the phase's own cost (barrier, no
// reads), and the rate that gives for the bytes read (down 25.2 MB, gate_up 50.3 MB a phase).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/exb scripts/expert_bench.cu && /tmp/exb
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bench.cuh"
#include "../src/mpk/tasks/common/memory.cuh"
#include "../src/mpk/tasks/common/reduce.cuh"

constexpr int THREADS = 256, WARPS = THREADS / 32, REPS = 64, LAYERS = 6;
constexpr int E = 128, H = 2048, I = 768, K = 8, TILES = 16;
constexpr int DOWN_ROWS = 16;  // outputs a down task at most (2048 / 132, 8-aligned)
constexpr int DOWN_SLOT = DOWN_ROWS * I * 2;   // 24 KB: a slot's rows of one down task
constexpr int GU_ROWS = I / TILES;             // 48 gate (and up) rows a gate_up task
constexpr int GU_STAGE_ROWS = 8;             // rows of a gate_up ring stage (half of each)
constexpr int RING = 3;

enum Method { NONE, D_REGS, D_CP_ALL, D_BULK_ALL, D_BULK_RING, D_CP_RING, G_REGS4, G_REGS8,
              G_BULK_RING, G_CP_RING };
static const char* kNames[] = {"none", "regs", "cp_all", "bulk_all", "bulk_ring", "cp_ring",
                               "regs4", "regs8", "bulk_ring", "cp_ring"};

using mpk::ptx::smem_u32;
using mpk::dev::warp_sum;
// A bulk copy with no L2 cache hint (bench.cuh), on a barrier given by pointer.
__device__ __forceinline__ void bulk(void* dst, const void* src, int bytes, uint64_t* bar) {
  probe::bulk_copy(smem_u32(dst), src, (uint32_t)bytes, smem_u32(bar));
}
__device__ __forceinline__ void expect(uint64_t* bar, int bytes) {
  mpk::ptx::mbar_arrive_expect_tx(smem_u32(bar), (uint32_t)bytes);
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  probe::mbar_wait(smem_u32(bar), parity);
}
// A ring's stage s (of `stages`) landed: its mbarrier (bulk copies; `par` holds each stage's
// parity) or this thread's cp.async groups and a barrier.
template <bool kBulk>
__device__ __forceinline__ void wait_stage(uint64_t* bars, int s, int stages, uint32_t& par) {
  if (kBulk) {
    mbar_wait(bars + s % RING, (par >> (s % RING)) & 1u);
    par ^= 1u << (s % RING);
  } else {
    mpk::dev::cp_async_wait_group(s + RING <= stages ? RING - 1 : 0);
    __syncthreads();
  }
}
// acc += x . w over one 16-byte vector of 8 bf16 each (x from shared memory).
__device__ __forceinline__ float dot8(const uint4& w, const __nv_bfloat16* x, float acc) {
  const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __bfloat1622float2(wp[i]), b = __bfloat1622float2(xp[i]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

struct Args {
  const __nv_bfloat16 *down, *gate_up;  // [LAYERS][E][H][I], [LAYERS][E][2][I][H]
  const __nv_bfloat16* x;               // [K][I] (down's x; gate_up's x is row 0, H long)
  const int* ids;                       // [REPS][K], distinct
  float* out;                           // [REPS][tasks][rows]: each method's results
  unsigned long long *ctr, *elapsed;
};

// down task t: rows [lo, hi) of H.
__device__ __forceinline__ void down_range(int t, int T, int& lo, int& hi) {
  const int units = H / 8, base = units / T, rem = units % T;
  lo = 8 * (t * base + min(t, rem));
  hi = lo + 8 * (base + (t < rem));
}

// One output's slot-j dot from `row` (I elements, global or shared), lane's vectors lane + 32 i.
template <bool kGlobal>
__device__ __forceinline__ float down_dot(const __nv_bfloat16* row, const __nv_bfloat16* xj,
                                          int lane) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < I / 256; ++i) {
    const int v = lane + 32 * i;
    const uint4 w = kGlobal ? mpk::dev::ld_weight_v4(row + v * 8)
                            : *reinterpret_cast<const uint4*>(row + v * 8);
    acc = dot8(w, xj + v * 8, acc);
  }
  return acc;
}

template <int kMethod>
__device__ void down_phase(const Args& a, int rep, char* smem, uint64_t* bars, uint32_t& par) {
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);  // K x I
  char* wbuf = smem + K * I * 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, T = gridDim.x;
  int lo, hi;
  down_range(blockIdx.x, T, lo, hi);
  const int* ids = a.ids + rep * K;
  const __nv_bfloat16* w = a.down + (long long)(rep % LAYERS) * E * H * I;
  auto slot_rows = [&](int j) { return w + ((long long)ids[j] * H + lo) * I; };
  const int slot_bytes = (hi - lo) * I * 2;
  float* out = a.out + ((long long)rep * T + blockIdx.x) * DOWN_ROWS;
  if (kMethod == D_REGS) {
    for (int n = lo + warp; n < hi; n += WARPS) {
      uint4 v[K][I / 256];
#pragma unroll
      for (int j = 0; j < K; ++j)
#pragma unroll
        for (int i = 0; i < I / 256; ++i)
          v[j][i] = mpk::dev::ld_weight_v4(slot_rows(j) + (long long)(n - lo) * I +
                                           (lane + 32 * i) * 8);
      float total = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < I / 256; ++i)
          acc = dot8(v[j][i], xs + j * I + (lane + 32 * i) * 8, acc);
        total += warp_sum(acc);
      }
      if (lane == 0) out[n - lo] = total;
    }
    return;
  }
  if (kMethod == D_CP_ALL || kMethod == D_BULK_ALL) {
    if (kMethod == D_CP_ALL) {
      for (int j = 0; j < K; ++j)
        for (int o = tid * 16; o < slot_bytes; o += THREADS * 16)
          mpk::dev::cp_async_act16(wbuf + j * DOWN_SLOT + o,
                                   reinterpret_cast<const char*>(slot_rows(j)) + o);
      mpk::dev::cp_async_commit();
      mpk::dev::cp_async_wait_all();
      __syncthreads();
    } else {
      if (tid == 0) {
        expect(bars, K * slot_bytes);
        for (int j = 0; j < K; ++j) bulk(wbuf + j * DOWN_SLOT, slot_rows(j), slot_bytes, bars);
      }
      mbar_wait(bars, par);
      par ^= 1u;
    }
    for (int n = lo + warp; n < hi; n += WARPS) {
      float total = 0.f;
      for (int j = 0; j < K; ++j)
        total += warp_sum(down_dot<false>(
            reinterpret_cast<const __nv_bfloat16*>(wbuf + j * DOWN_SLOT) + (n - lo) * I,
            xs + j * I, lane));
      if (lane == 0) out[n - lo] = total;
    }
    __syncthreads();  // the buffer is refilled next phase
    return;
  }
  // Rings: slot j in stage j % RING; each warp keeps its outputs' (at most 2) sums.
  auto issue = [&](int j) {
    char* dst = wbuf + (j % RING) * DOWN_SLOT;
    if (kMethod == D_BULK_RING) {
      if (tid == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        expect(bars + j % RING, slot_bytes);
        bulk(dst, slot_rows(j), slot_bytes, bars + j % RING);
      }
    } else {
      for (int o = tid * 16; o < slot_bytes; o += THREADS * 16)
        mpk::dev::cp_async_act16(dst + o, reinterpret_cast<const char*>(slot_rows(j)) + o);
      mpk::dev::cp_async_commit();
    }
  };
  for (int j = 0; j < RING; ++j) issue(j);
  float total[2] = {0.f, 0.f};
  for (int j = 0; j < K; ++j) {
    wait_stage<kMethod == D_BULK_RING>(bars, j, K, par);
    const __nv_bfloat16* rows =
        reinterpret_cast<const __nv_bfloat16*>(wbuf + (j % RING) * DOWN_SLOT);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int n = lo + warp + q * WARPS;
      if (n < hi) total[q] += warp_sum(down_dot<false>(rows + (n - lo) * I, xs + j * I, lane));
    }
    __syncthreads();  // every warp is done with the stage
    if (j + RING < K) issue(j + RING);
  }
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int n = lo + warp + q * WARPS;
    if (n < hi && lane == 0) out[n - lo] = total[q];
  }
}

// gate_up task (slot u, tile t): rows [lo, lo + 48) of expert ids[u]; out[r] = g * u sums.
template <int kMethod>
__device__ void gate_up_phase(const Args& a, int rep, char* smem, uint64_t* bars, uint32_t& par) {
  if (blockIdx.x >= K * TILES) return;
  const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(smem);  // H (row 0 of x)
  char* wbuf = smem + K * I * 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int u = blockIdx.x / TILES, lo = (blockIdx.x % TILES) * GU_ROWS;
  const __nv_bfloat16* gate = a.gate_up + (long long)(rep % LAYERS) * E * 2 * I * H +
                              ((long long)a.ids[rep * K + u] * 2 * I + lo) * H;
  const long long up_off = (long long)I * H;
  float* out = a.out + ((long long)rep * K * TILES + blockIdx.x) * GU_ROWS;
  if (kMethod == G_REGS4 || kMethod == G_REGS8) {
    constexpr int kV = kMethod == G_REGS4 ? 4 : 8;
    for (int r = warp; r < GU_ROWS; r += WARPS) {
      const __nv_bfloat16* g = gate + (long long)r * H;
      float ag = 0.f, au = 0.f;
      for (int c = 0; c < H / 8; c += 32 * kV) {
        uint4 gv[kV], uv[kV];
#pragma unroll
        for (int i = 0; i < kV; ++i) {
          gv[i] = mpk::dev::ld_weight_v4(g + (c + 32 * i + lane) * 8);
          uv[i] = mpk::dev::ld_weight_v4(g + up_off + (c + 32 * i + lane) * 8);
        }
#pragma unroll
        for (int i = 0; i < kV; ++i) {
          ag = dot8(gv[i], xs + (c + 32 * i + lane) * 8, ag);
          au = dot8(uv[i], xs + (c + 32 * i + lane) * 8, au);
        }
      }
      const float gs = warp_sum(ag), us = warp_sum(au);
      if (lane == 0) out[r] = gs * us;
    }
    return;
  }
  // Rings: stage s holds half hf = s % 2 of rows [8 rb, 8 rb + 8), rb = s / 2, of gate, then of
  // up (2 KB pieces: 8 + 8 of them, 32 KB a stage); warp w takes row 8 rb + w, both halves.
  constexpr int kStages = 2 * GU_ROWS / GU_STAGE_ROWS, kHalf = H / 2;
  constexpr int kPiece = kHalf * 2, kMat = GU_STAGE_ROWS * kPiece;  // bytes
  auto issue = [&](int s) {
    char* dst = wbuf + (s % RING) * 2 * kMat;
    const __nv_bfloat16* g = gate + (long long)(s / 2) * GU_STAGE_ROWS * H + (s % 2) * kHalf;
    if (kMethod == G_BULK_RING) {
      if (tid == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        expect(bars + s % RING, 2 * kMat);
        for (int r = 0; r < GU_STAGE_ROWS; ++r) {
          bulk(dst + r * kPiece, g + (long long)r * H, kPiece, bars + s % RING);
          bulk(dst + kMat + r * kPiece, g + up_off + (long long)r * H, kPiece, bars + s % RING);
        }
      }
    } else {
      for (int q = tid; q < 2 * kMat / 16; q += THREADS) {
        const int m = q / (kMat / 16), r = (q % (kMat / 16)) / (kPiece / 16), c = q % (kPiece / 16);
        mpk::dev::cp_async_act16(dst + m * kMat + r * kPiece + c * 16,
                                 g + (m ? up_off : 0) + (long long)r * H + c * 8);
      }
      mpk::dev::cp_async_commit();
    }
  };
  for (int s = 0; s < RING; ++s) issue(s);
  float ag = 0.f, au = 0.f;
  for (int s = 0; s < kStages; ++s) {
    wait_stage<kMethod == G_BULK_RING>(bars, s, kStages, par);
    const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(wbuf + (s % RING) * 2 * kMat) +
                             warp * kHalf;
    if (s % 2 == 0) ag = au = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int v = 32 * i + lane;  // of the half
      const __nv_bfloat16* xv = xs + (s % 2) * kHalf + v * 8;
      ag = dot8(*reinterpret_cast<const uint4*>(g + v * 8), xv, ag);
      au = dot8(*reinterpret_cast<const uint4*>(g + kMat / 2 + v * 8), xv, au);
    }
    if (s % 2 == 1) {
      const float gs = warp_sum(ag), us = warp_sum(au);
      if (lane == 0) out[(s / 2) * GU_STAGE_ROWS + warp] = gs * us;
    }
    __syncthreads();  // every warp is done with the stage
    if (s + RING < kStages) issue(s + RING);
  }
}

template <int kMethod>
__global__ void __launch_bounds__(THREADS, 1) bench(Args a) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[RING];
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int j = 0; j < RING; ++j)
      mpk::ptx::mbar_init(smem_u32(bars + j), 1u);
    mpk::ptx::mbar_init_fence();
  }
  for (int o = tid; o < K * I; o += THREADS)
    reinterpret_cast<__nv_bfloat16*>(smem)[o] = a.x[o];
  __syncthreads();
  uint32_t par = 0;
  const unsigned long long t0 = mpk::ptx::globaltimer();
  for (int rep = 0; rep < REPS; ++rep) {
    if (tid == 0) probe::wait_phase(a.ctr, rep);
    __syncthreads();
    if (kMethod >= D_REGS && kMethod <= D_CP_RING) down_phase<kMethod>(a, rep, smem, bars, par);
    if (kMethod >= G_REGS4) gate_up_phase<kMethod>(a, rep, smem, bars, par);
    __syncthreads();
    if (tid == 0) probe::signal_phase(a.ctr);
  }
  if (blockIdx.x == 0 && tid == 0) *a.elapsed = mpk::ptx::globaltimer() - t0;
}

template <int kMethod>
double run(Args a, int ctas, std::vector<float>* result, size_t out_floats) {
  cudaMemset(a.ctr, 0, 8);
  cudaMemset(a.out, 0xff, out_floats * 4);  // poisoned: an unwritten output shows as NaN
  const int smem = 210 * 1024;
  cudaFuncSetAttribute(bench<kMethod>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  bench<kMethod><<<ctas, THREADS, smem>>>(a);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("%s: error %s\n", kNames[kMethod], cudaGetErrorString(e));
    exit(1);
  }
  unsigned long long ns = 0;
  cudaMemcpy(&ns, a.elapsed, 8, cudaMemcpyDeviceToHost);
  if (result) {
    result->resize(out_floats);
    cudaMemcpy(result->data(), a.out, out_floats * 4, cudaMemcpyDeviceToHost);
  }
  return ns / 1e3 / REPS;
}

__global__ void fill(__nv_bfloat16* p, long long n, unsigned seed) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * 0.25f);
  }
}

template <int kMethod>
void report(Args a, int ctas, const std::vector<float>& ref, size_t n, double base, double mb) {
  std::vector<float> got;
  const double us = run<kMethod>(a, ctas, &got, n) - base;
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += memcmp(&got[i], &ref[i], 4) != 0;
  printf("  %-10s %8.3f us  %6.2f TB/s%s\n", kNames[kMethod], us, mb / us,
         bad ? "  MISMATCH" : "");
  if (bad) printf("    %zu of %zu outputs differ from regs\n", bad, n);
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  Args a{};
  const long long nd = (long long)LAYERS * E * H * I, ng = 2 * nd;
  __nv_bfloat16 *down, *gate_up, *x;
  cudaMalloc(&down, nd * 2), cudaMalloc(&gate_up, ng * 2), cudaMalloc(&x, K * I * 2);
  fill<<<1024, 256>>>(down, nd, 1u), fill<<<1024, 256>>>(gate_up, ng, 2u);
  fill<<<8, 256>>>(x, K * I, 3u);
  std::vector<int> ids(REPS * K);
  srand(7);
  for (int r = 0; r < REPS; ++r)
    for (int j = 0; j < K; ++j) {
      int e;
      bool dup;
      do {
        e = rand() % E, dup = false;
        for (int q = 0; q < j; ++q) dup |= ids[r * K + q] == e;
      } while (dup);
      ids[r * K + j] = e;
    }
  int* d_ids;
  cudaMalloc(&d_ids, ids.size() * 4);
  cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
  const size_t out_floats = (size_t)REPS * sms * GU_ROWS;
  cudaMalloc(&a.out, out_floats * 4), cudaMalloc(&a.ctr, 8), cudaMalloc(&a.elapsed, 8);
  a.down = down, a.gate_up = gate_up, a.x = x, a.ids = d_ids;
  const double base = run<NONE>(a, sms, nullptr, out_floats);
  printf("%d SMs, %d phases of %d layers' experts; a phase's own cost %.3f us (subtracted)\n",
         sms, REPS, LAYERS, base);
  const double down_mb = K * (double)H * I * 2 / 1e6, gu_mb = 2 * down_mb;
  std::vector<float> ref;
  const size_t nd_out = (size_t)REPS * sms * DOWN_ROWS;
  printf("down (%.1f MB a phase, %d tasks):\n", down_mb, sms);
  const double d_us = run<D_REGS>(a, sms, &ref, nd_out) - base;
  printf("  %-10s %8.3f us  %6.2f TB/s\n", "regs", d_us, down_mb / d_us);
  report<D_CP_ALL>(a, sms, ref, nd_out, base, down_mb);
  report<D_BULK_ALL>(a, sms, ref, nd_out, base, down_mb);
  report<D_BULK_RING>(a, sms, ref, nd_out, base, down_mb);
  report<D_CP_RING>(a, sms, ref, nd_out, base, down_mb);
  const size_t ng_out = (size_t)REPS * K * TILES * GU_ROWS;
  printf("gate_up (%.1f MB a phase, %d tasks):\n", gu_mb, K * TILES);
  const double g_us = run<G_REGS4>(a, sms, &ref, ng_out) - base;
  printf("  %-10s %8.3f us  %6.2f TB/s\n", "regs4", g_us, gu_mb / g_us);
  report<G_REGS8>(a, sms, ref, ng_out, base, gu_mb);
  report<G_BULK_RING>(a, sms, ref, ng_out, base, gu_mb);
  report<G_CP_RING>(a, sms, ref, ng_out, base, gu_mb);
  return 0;
}
