// argmax_reduce, sm_90a: tokens[b] = part_idx[b, argmax_t part_val[b, t]] (first maximum; NaN wins
// as in torch.argmax); tokens_out[step, b] too when step < out_steps. One task (grid (1, 1, 1)):
// one warp per row (rows round-robin over the 8 warps), lanes stride the T partials.
#pragma once
#include <stdint.h>

#include "../common/memory.cuh"
#include "../common/reduce.cuh"

namespace mpk::kinds::argmax_reduce {

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  constexpr int kWarps = NUM_THREADS / 32;
  const int B = a.i(P_BATCH), T = a.i(P_NUM_TILES), steps = a.i(P_OUT_STEPS);
  const float* pval = a.operand<const float>(O_PART_VAL);
  const int* pidx = a.operand<const int>(O_PART_IDX);
  int* tokens = a.operand<int>(O_TOKENS);
  int* tokens_out = a.operand<int>(O_TOKENS_OUT);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int b = warp; b < B; b += kWarps) {
    float best = -__int_as_float(0x7f800000);
    int bt = 0x7fffffff;
    for (int t = lane; t < T; t += 32) {
      const float v = dev::ld_act_f32(pval + (long long)b * T + t);
      if (dev::argmax_better(v, t, best, bt)) {
        best = v;
        bt = t;
      }
    }
    dev::warp_argmax(best, bt);
    if (lane == 0) {
      const int tok = bt < T ? dev::ld_act_i32(pidx + (long long)b * T + bt) : 0;
      tokens[b] = tok;
      if (tokens_out != nullptr && a.step < steps) tokens_out[(long long)a.step * B + b] = tok;
    }
  }
}

}  // namespace mpk::kinds::argmax_reduce
