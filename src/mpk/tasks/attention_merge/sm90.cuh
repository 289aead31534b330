// attention_merge, sm_90a: out = sum_s exp(lse_s - lse) * o_s, lse = log(sum_s exp(lse_s)).
//
// Layouts (default splits; grid = (KV-head tiles, B, 1)): part_o tile = part_o[b0, h0, 0, 0]
// ((bb, hh, s, j) at + ((bb*KVH + hh)*S + s)*G*D + j with j = g*D + d), part_lse tile =
// part_lse[b0, h0, 0, 0] ((bb, hh, s, g) at + ((bb*KVH + hh)*S + s)*G + g), out tile =
// out[b0, h0, 0] ((bb, hh, j) at + (bb*KVH + hh)*G*D + j). KV heads per task = heads_per_task;
// batch rows per task = batch_per_task when task.py declares it, else 1.
// Each thread owns 4 consecutive output elements of one (row, head, query head) and recomputes
// that head's weights from the S lse values (broadcast loads), so the task is one round trip of
// loads; empty splits (lse = -inf) weigh 0, an all-empty head gives 0 (as nan_to_num does).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"

namespace mpk::kinds::attention_merge {

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using bf16 = __nv_bfloat16;
  const int KVH = a.i(P_KV_HEADS), S = a.i(P_NUM_SPLITS), G = a.i(P_GROUP);
  const int D = a.i(P_HEAD_DIM), HT = a.i(P_HEADS_PER_TASK);
  const int BT = a.i(P_BATCH_PER_TASK);
  const float* po = a.operand<const float>(O_PART_O);
  const float* pl = a.operand<const float>(O_PART_LSE);
  bf16* out = a.operand<bf16>(O_OUT);
  const int W = G * D;
  const bool vec = (W % 4 == 0) && (D % 4 == 0) && dev::aligned16(po);
  const int per = vec ? 4 : 1;
  const int cols = W / per;
  const int total = BT * HT * cols;
  const float ninf = -__int_as_float(0x7f800000);
  for (int idx = threadIdx.x; idx < total; idx += NUM_THREADS) {
    const int bh = idx / cols, j = (idx - bh * cols) * per;
    const int bb = bh / HT, hh = bh - bb * HT;
    const long long head = (long long)bb * KVH + hh;
    const int g = j / D;
    const float* lse = pl + head * S * G + g;
    float m = ninf;
    for (int s = 0; s < S; ++s) m = fmaxf(m, dev::ld_act_f32(lse + (long long)s * G));
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (m != ninf && m == m) {
      float sum = 0.f;
      for (int s = 0; s < S; ++s) sum += expf(dev::ld_act_f32(lse + (long long)s * G) - m);
      const float total_lse = m + logf(sum);
      const float* o = po + head * S * W + j;
      for (int s = 0; s < S; ++s) {
        const float w = expf(dev::ld_act_f32(lse + (long long)s * G) - total_lse);
        if (vec) {
          const float4 v = dev::ld_act_f4(o + (long long)s * W);
          acc[0] = fmaf(v.x, w, acc[0]);
          acc[1] = fmaf(v.y, w, acc[1]);
          acc[2] = fmaf(v.z, w, acc[2]);
          acc[3] = fmaf(v.w, w, acc[3]);
        } else {
          acc[0] = fmaf(dev::ld_act_f32(o + (long long)s * W), w, acc[0]);
        }
      }
    }
    bf16* dst = out + head * W + j;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (e < per) dst[e] = dev::to_bf16(acc[e]);
  }
}

}  // namespace mpk::kinds::attention_merge
