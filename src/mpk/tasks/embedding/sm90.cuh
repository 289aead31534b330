// embedding, sm_90a: out[b, h0:h0+tile_h] = table[token_b, h0:h0+tile_h].
//
// token_b = prompt[step, b] when step < prompt_steps and that entry is >= 0, else tokens[b];
// clamped to [0, vocab - 1] as the reference does. Layouts (default splits): table and out are
// split along H only, so the table / out operand pointers point at column h0 of row 0 (rows keep
// the full stride `hidden`); tokens and prompt are unsplit (pointer = base).
// tokens / prompt are activations (written by argmax_reduce / the host): L2-coherent loads. The
// table is read with L2-coherent loads too (it is not flagged weight=True).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/memory.cuh"

namespace mpk::kinds::embedding {

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  using bf16 = __nv_bfloat16;
  const int B = a.i(P_BATCH), V = a.i(P_VOCAB), H = a.i(P_HIDDEN), TH = a.i(P_TILE_H);
  const int prompt_steps = a.i(P_PROMPT_STEPS);
  const int* tokens = a.operand<const int>(O_TOKENS);
  const int* prompt = a.operand<const int>(O_PROMPT);
  const bf16* table = a.operand<const bf16>(O_TABLE);
  bf16* out = a.operand<bf16>(O_OUT);
  const bool vec = (TH % 8 == 0) && (H % 8 == 0) && dev::aligned16(table) && dev::aligned16(out);
  // Threads split the (row, column) space; each row's token is looked up per element group (the
  // loads hit the same L2 line, and B is small).
  if (vec) {
    const int vpr = TH / 8;
    for (int idx = threadIdx.x; idx < B * vpr; idx += NUM_THREADS) {
      const int b = idx / vpr, v = idx - b * vpr;
      int tok = dev::ld_act_i32(tokens + b);
      if (prompt != nullptr && a.step < prompt_steps) {
        const int forced = dev::ld_act_i32(prompt + (long long)a.step * B + b);
        if (forced >= 0) tok = forced;
      }
      tok = min(max(tok, 0), V - 1);
      const uint4 val = dev::ld_act_v4(table + (long long)tok * H + v * 8);
      *reinterpret_cast<uint4*>(out + (long long)b * H + v * 8) = val;
    }
  } else {
    for (int idx = threadIdx.x; idx < B * TH; idx += NUM_THREADS) {
      const int b = idx / TH, h = idx - b * TH;
      int tok = dev::ld_act_i32(tokens + b);
      if (prompt != nullptr && a.step < prompt_steps) {
        const int forced = dev::ld_act_i32(prompt + (long long)a.step * B + b);
        if (forced >= 0) tok = forced;
      }
      tok = min(max(tok, 0), V - 1);
      const uint32_t bits = dev::ld_act_u16(table + (long long)tok * H + h);
      out[(long long)b * H + h] = __ushort_as_bfloat16(static_cast<unsigned short>(bits));
    }
  }
}

}  // namespace mpk::kinds::embedding
