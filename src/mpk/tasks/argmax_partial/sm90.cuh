// argmax_partial, sm_90a: per row, the largest logit of this vocabulary slice and its global
// index (ties -> lowest index; NaN wins, as torch.max propagates it).
//
// Layouts (default splits; grid = (T, 1, 1)): logits tile = logits[0, v0] (row b at + b*vocab),
// part_val / part_idx tile = part[0, tile] (row b at + b*T). global index = tile*tile_v + local.
// Warps are spread over rows (8 / B warps per row when B < 8); each lane scans its elements with
// 16-byte loads (8 in flight), then warp shuffles and a fixed-order merge of the warps of a row.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"

namespace mpk::kinds::argmax_partial {

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using bf16 = __nv_bfloat16;
  constexpr int kWarps = NUM_THREADS / 32;
  const int B = a.i(P_BATCH), V = a.i(P_VOCAB), TV = a.i(P_TILE_V), T = a.i(P_NUM_TILES);
  const bool f32 = a.i(P_LOGITS_F32) != 0;
  // Typed operand pointer: the tile offset is in elements of the logits dtype.
  const void* logits = f32 ? static_cast<const void*>(a.operand<const float>(O_LOGITS))
                           : static_cast<const void*>(a.operand<const bf16>(O_LOGITS));
  float* pval = a.operand<float>(O_PART_VAL);
  int* pidx = a.operand<int>(O_PART_IDX);
  const int base_idx = a.point(0) * TV;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per = f32 ? 4 : 8;  // elements per 16-byte vector
  const bool vec = (TV % per == 0) && (V % per == 0) && dev::aligned16(logits);
  const int wpr = B < kWarps ? kWarps / B : 1;  // warps per row
  const int rows_at_once = kWarps / wpr;
  float* sval = reinterpret_cast<float*>(a.smem);
  int* sidx = reinterpret_cast<int*>(a.smem + kWarps * 4);

  for (int r0 = 0; r0 < B; r0 += rows_at_once) {
    const int b = r0 + warp / wpr, part = warp - (warp / wpr) * wpr;
    float best = -__int_as_float(0x7f800000);
    int bidx = 0x7fffffff;
    if (b < B && warp / wpr < rows_at_once) {
      if (vec) {
        const int nv = TV / per;
        // this warp's vectors: part, part + wpr, ... (lane-strided inside)
        constexpr int kU = 8;
        for (int v0 = part * 32 + lane; v0 < nv; v0 += wpr * 32 * kU) {
          uint4 buf[kU];
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int v = v0 + u * wpr * 32;
            if (v < nv) {
              buf[u] = f32 ? dev::ld_act_v4(static_cast<const float*>(logits) + (long long)b * V + v * 4)
                           : dev::ld_act_v4(static_cast<const bf16*>(logits) + (long long)b * V + v * 8);
            }
          }
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int v = v0 + u * wpr * 32;
            if (v < nv) {
              float f[8];
              int cnt;
              if (f32) {
                f[0] = __uint_as_float(buf[u].x);
                f[1] = __uint_as_float(buf[u].y);
                f[2] = __uint_as_float(buf[u].z);
                f[3] = __uint_as_float(buf[u].w);
                cnt = 4;
              } else {
                dev::unpack8(buf[u], f);
                cnt = 8;
              }
#pragma unroll
              for (int e = 0; e < 8; ++e)
                if (e < cnt && dev::argmax_better(f[e], v * per + e, best, bidx)) {
                  best = f[e];
                  bidx = v * per + e;
                }
            }
          }
        }
      } else {
        for (int i = part * 32 + lane; i < TV; i += wpr * 32) {
          const float f = f32 ? dev::ld_act_f32(static_cast<const float*>(logits) + (long long)b * V + i)
                              : dev::ld_act_bf16f(static_cast<const bf16*>(logits) + (long long)b * V + i);
          if (dev::argmax_better(f, i, best, bidx)) {
            best = f;
            bidx = i;
          }
        }
      }
    }
    dev::warp_argmax(best, bidx);
    if (lane == 0) {
      sval[warp] = best;
      sidx[warp] = bidx;
    }
    mpk::task_sync();
    if (threadIdx.x < rows_at_once && r0 + threadIdx.x < B) {
      const int rb = r0 + threadIdx.x;
      float v = sval[threadIdx.x * wpr];
      int i = sidx[threadIdx.x * wpr];
      for (int p = 1; p < wpr; ++p) {
        const float ov = sval[threadIdx.x * wpr + p];
        const int oi = sidx[threadIdx.x * wpr + p];
        if (dev::argmax_better(ov, oi, v, i)) {
          v = ov;
          i = oi;
        }
      }
      if (i == 0x7fffffff) i = 0;  // empty slice (cannot happen for tile_v >= 1)
      pval[(long long)rb * T] = v;
      pidx[(long long)rb * T] = base_idx + i;
    }
    mpk::task_sync();
  }
}

}  // namespace mpk::kinds::argmax_partial
