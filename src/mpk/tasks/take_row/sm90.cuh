// take_row, sm_90a: out[0] = x[n - 1], n = chunk[0] clamped to [1, rows] (task.py). The row is
// copied as bytes (row_bytes, any dtype); x is an activation (L2-coherent loads).
#pragma once
#include <stdint.h>

#include "../common/memory.cuh"

namespace mpk::kinds::take_row {

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  const int rows = a.i(P_ROWS), bytes = a.i(P_ROW_BYTES);
  const int n = min(max(dev::ld_act_i32(a.operand<const int>(O_CHUNK)), 1), rows);
  const char* src = a.operand<const char>(O_X) + (long long)(n - 1) * bytes;
  char* dst = a.operand<char>(O_OUT);
  if (bytes % 16 == 0 && dev::aligned16(src) && dev::aligned16(dst)) {
    for (int i = threadIdx.x; i < bytes / 16; i += NUM_THREADS)
      reinterpret_cast<uint4*>(dst)[i] = dev::ld_act_v4(src + 16 * i);
    return;
  }
  // Element sizes are 2 or 4 bytes (dtypes.py): copy 16-bit halves.
  for (int i = threadIdx.x; i < bytes / 2; i += NUM_THREADS)
    reinterpret_cast<unsigned short*>(dst)[i] =
        static_cast<unsigned short>(dev::ld_act_u16(src + 2 * i));
}

}  // namespace mpk::kinds::take_row
