// TEST STUB standing in for the real silu_mul kernel (found first on the include path when a
// test passes this directory): out[e] = x[e] + 1 over a.i(P_TILE_I) int32 elements. It tests
// the runtime (records, waits, signals, steps), not the numerics; plans built by
// tests/cuda/runtime_plans.py give it int32 tensors.
#pragma once

namespace mpk::kinds::silu_mul {

MPK_TASK_ENTRY void run(const mpk::TaskArgs& a) {
  const int* x = a.operand<const int>(O_X);
  int* out = a.operand<int>(O_OUT);
  const int n = a.i(P_TILE_I);
  for (int e = threadIdx.x; e < n; e += NUM_THREADS) out[e] = __ldcg(x + e) + 1;
}

}  // namespace mpk::kinds::silu_mul
