// Row runs (tasks/runs.py): rows that hold consecutive positions of one sequence in a step.
// The RUNS row layout (RUN_WORDS, RUN_INDEX, RUN_WIDTH) is generated from tasks/runs.py.
#pragma once

#include "memory.cuh"

namespace mpk::dev {

struct RowRun {
  int index;  // this row's place in its run: rows row-index .. row are this step's positions
  int width;  // rows in the run: how far each row's position moves per step
};

// Row `row`'s run from its RUNS words (host-written IO: L2-coherent loads), clamped as
// tasks/runs.py clamps them; `words` null (the op has no runs operand): the row is alone.
__device__ __forceinline__ RowRun row_run(const int* words, int row) {
  if (words == nullptr) return RowRun{0, 1};
  const int width = max(ld_act_i32(words + RUN_WIDTH), 1);
  const int index = min(max(ld_act_i32(words + RUN_INDEX), 0), min(width - 1, row));
  return RowRun{index, width};
}

// The row's position at local step `step` (`start`: its positions entry): only the width.
__device__ __forceinline__ long long row_position(int start, const int* words, int step) {
  const int width = words == nullptr ? 1 : max(ld_act_i32(words + RUN_WIDTH), 1);
  return (long long)start + (long long)step * width;
}

}  // namespace mpk::dev
