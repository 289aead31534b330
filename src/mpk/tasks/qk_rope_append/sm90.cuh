// qk_rope_append, sm_90a: per KV-head group, optional q/k RMSNorm, RoPE (rotate-half), and the
// KV-cache append of this step's key and value.
//
// Layouts (default splits): the grid splits KV heads only. qkv tile pointer = qkv[0, h0, 0]
// (row b of head h at + b*KVH*(G+2)*D + h*(G+2)*D), q_out tile = q_out[0, h0, 0], k_cache /
// v_cache tile = cache[0, 0, h0, 0] (element (page, slot, h, d) at
// + ((page*page_size + slot)*KVH + h)*D + d). rope, positions, page_table are unsplit.
// KV heads per task: param heads_per_task.
// Defensive: a row whose position is outside [0, max_pos) is skipped entirely; the cache write
// is skipped when the page index is past max_pages or the page id is negative or >= num_pages.
// Rounding as the reference: normalised q/k are bf16 values (numerics.rmsnorm_rows), RoPE in fp32
// with separate multiplies and adds (no FMA contraction), q_out and k_cache rounded to bf16 once,
// v copied as is.
// Work: one warp per head vector (row b, head h, slot j in [0, G+2)); each lane holds elements
// d = lane + 32*i (D <= 256); the RoPE partner element comes through a per-warp smem buffer.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/bf16.cuh"
#include "../common/memory.cuh"
#include "../common/reduce.cuh"

namespace mpk::kinds::qk_rope_append {

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using bf16 = __nv_bfloat16;
  constexpr int kWarps = NUM_THREADS / 32;
  constexpr int kMaxE = 8;  // elements per lane: D <= 256
  const int B = a.i(P_BATCH), G = a.i(P_GROUP), D = a.i(P_HEAD_DIM), KVH = a.i(P_KV_HEADS);
  const int PS = a.i(P_PAGE_SIZE), MAXP = a.i(P_MAX_PAGES), MAXPOS = a.i(P_MAX_POS);
  const bool norm = a.i(P_HAS_QK_NORM) != 0 && a.has(O_Q_NORM) && a.has(O_K_NORM);
  const float eps = a.f(P_EPS);
  const int HT = a.i(P_HEADS_PER_TASK);
  const int NP = a.i(P_NUM_PAGES);
  const bf16* qkv = a.operand<const bf16>(O_QKV);
  const bf16* qn = a.operand<const bf16>(O_Q_NORM);
  const bf16* kn = a.operand<const bf16>(O_K_NORM);
  const float* rope = a.operand<const float>(O_ROPE);
  const int* positions = a.operand<const int>(O_POSITIONS);
  const int* page_table = a.operand<const int>(O_PAGE_TABLE);
  bf16* q_out = a.operand<bf16>(O_Q_OUT);
  bf16* k_cache = a.operand<bf16>(O_K_CACHE);
  bf16* v_cache = a.operand<bf16>(O_V_CACHE);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (D > 32 * kMaxE || D <= 0 || (D & 1)) return;  // unsupported head_dim (uniform)

  // Per row: position (or -1 when out of range) and cache row base (or -1: skip the append).
  int* s_pos = reinterpret_cast<int*>(a.smem);
  long long* s_row = reinterpret_cast<long long*>(a.smem + ((B * 4 + 15) / 16) * 16);
  float* buf = reinterpret_cast<float*>(a.smem + ((B * 4 + 15) / 16) * 16 + B * 8) + warp * D;
  for (int b = tid; b < B; b += NUM_THREADS) {
    int pos = dev::ld_act_i32(positions + b) + a.step;
    long long row = -1;
    if (pos < 0 || pos >= MAXPOS) {
      pos = -1;
    } else if (PS > 0 && pos / PS < MAXP) {
      const int page = dev::ld_act_i32(page_table + (long long)b * MAXP + pos / PS);
      if (page >= 0 && (NP < 0 || page < NP))
        row = ((long long)page * PS + pos % PS) * KVH;  // in units of D-element head rows
    }
    s_pos[b] = pos;
    s_row[b] = row;
  }
  __syncthreads();

  const int W = G + 2;
  const int half = D / 2;
  const int total = B * HT * W;
  for (int hv = warp; hv < total; hv += kWarps) {
    const int b = hv / (HT * W);
    const int rem = hv - b * (HT * W);
    const int h = rem / W, j = rem - h * W;
    const int pos = s_pos[b];
    if (pos < 0) continue;  // warp-uniform
    const bf16* src = qkv + ((long long)b * KVH + h) * W * D + (long long)j * D;
    const long long crow = s_row[b];
    if (j == G + 1) {  // value: copy into the cache
      if (crow >= 0) {
        bf16* dst = v_cache + (crow + h) * D;
        for (int e = lane; e < D; e += 32)
          dst[e] = __ushort_as_bfloat16(static_cast<unsigned short>(dev::ld_act_u16(src + e)));
      }
      continue;
    }
    float v[kMaxE], c[kMaxE], s[kMaxE], w[kMaxE];
    const float* rrow = rope + (long long)pos * D;
    const bf16* nw = j < G ? qn : kn;
#pragma unroll
    for (int i = 0; i < kMaxE; ++i) {
      const int e = lane + 32 * i;
      v[i] = c[i] = s[i] = 0.f;
      w[i] = 1.f;
      if (e < D) {
        v[i] = dev::ld_act_bf16f(src + e);
        const int r = e < half ? e : e - half;
        c[i] = dev::ld_act_f32(rrow + r);
        s[i] = dev::ld_act_f32(rrow + half + r);
        if (norm) w[i] = dev::ld_weight_bf16f(nw + e);
      }
    }
    if (norm) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kMaxE; ++i) ss = fmaf(v[i], v[i], ss);
      const float inv = dev::rms_inv(dev::warp_sum(ss), D, eps);
#pragma unroll
      for (int i = 0; i < kMaxE; ++i) v[i] = dev::rmsnorm_elem(v[i], inv, w[i]);
    }
#pragma unroll
    for (int i = 0; i < kMaxE; ++i)
      if (lane + 32 * i < D) buf[lane + 32 * i] = v[i];
    __syncwarp();
    float o[kMaxE];
#pragma unroll
    for (int i = 0; i < kMaxE; ++i) {
      const int e = lane + 32 * i;
      o[i] = 0.f;
      if (e < D) {
        if (e < half)  // x1 * cos - x2 * sin
          o[i] = __fsub_rn(__fmul_rn(v[i], c[i]), __fmul_rn(buf[e + half], s[i]));
        else  // x2 * cos + x1 * sin
          o[i] = __fadd_rn(__fmul_rn(v[i], c[i]), __fmul_rn(buf[e - half], s[i]));
      }
    }
    __syncwarp();  // buf is rewritten by this warp's next head vector
    if (j < G) {
      bf16* dst = q_out + ((long long)b * KVH + h) * G * D + (long long)j * D;
#pragma unroll
      for (int i = 0; i < kMaxE; ++i)
        if (lane + 32 * i < D) dst[lane + 32 * i] = dev::to_bf16(o[i]);
    } else if (crow >= 0) {
      bf16* dst = k_cache + (crow + h) * D;
#pragma unroll
      for (int i = 0; i < kMaxE; ++i)
        if (lane + 32 * i < D) dst[lane + 32 * i] = dev::to_bf16(o[i]);
    }
  }
}

}  // namespace mpk::kinds::qk_rope_append
