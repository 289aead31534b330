// embedding, sm_90a: out[b, h0:h0+tile_h] = table[token_b, h0:h0+tile_h].
//
// token_b = prompt[step, b] when step < prompt_steps and that entry is >= 0, else tokens[b];
// clamped to [0, vocab - 1] as the reference does. Layouts (default splits): table and out are
// split along H only, so the table / out operand pointers point at column h0 of row 0 (rows keep
// the full stride `hidden`); tokens and prompt are unsplit (pointer = base).
// tokens / prompt are activations (written by argmax_reduce / the host): L2-coherent loads. The
// table is read with L2-coherent loads too (it is not flagged weight=True).
// A flagged out (compiler/flags.py) gets one 64-bit word per pair of columns, with its epoch.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/flags.cuh"
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
  const uint32_t ep = dev::flag_epoch<FLAGGED>(a, O_OUT);
  // Flagged: out's words, at column h0 (the element offset halved: h0 and H are even).
  dev::flag_word* words = ep ? reinterpret_cast<dev::flag_word*>(a.base[O_OUT]) +
                                   (reinterpret_cast<bf16*>(out) -
                                    reinterpret_cast<bf16*>(a.base[O_OUT])) / 2
                             : nullptr;
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
      if (ep) {
        dev::flag_word* w = words + ((long long)b * H + v * 8) / 2;
        dev::st_flag2(w, dev::make_flag_word(val.x, ep), dev::make_flag_word(val.y, ep));
        dev::st_flag2(w + 2, dev::make_flag_word(val.z, ep), dev::make_flag_word(val.w, ep));
      } else {
        *reinterpret_cast<uint4*>(out + (long long)b * H + v * 8) = val;
      }
    }
  } else {
    // Flagged: a thread writes the word of its pair (even h), loading both elements.
    const int step = ep ? 2 : 1;
    for (int idx = threadIdx.x * step; idx < B * TH; idx += NUM_THREADS * step) {
      const int b = idx / TH, h = idx - b * TH;
      int tok = dev::ld_act_i32(tokens + b);
      if (prompt != nullptr && a.step < prompt_steps) {
        const int forced = dev::ld_act_i32(prompt + (long long)a.step * B + b);
        if (forced >= 0) tok = forced;
      }
      tok = min(max(tok, 0), V - 1);
      const uint32_t bits = dev::ld_act_u16(table + (long long)tok * H + h);
      if (ep) {
        const uint32_t hi = dev::ld_act_u16(table + (long long)tok * H + h + 1);
        dev::st_flag(words + ((long long)b * H + h) / 2, dev::make_flag_word(bits | hi << 16, ep));
      } else {
        out[(long long)b * H + h] = __ushort_as_bfloat16(static_cast<unsigned short>(bits));
      }
    }
  }
}

}  // namespace mpk::kinds::embedding
