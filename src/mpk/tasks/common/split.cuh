// Uneven aligned splits (tasks/base.py split_bounds): part `index` of `parts` contiguous ranges
// of `size` items, each starting at a multiple of `align`; sizes differ by at most `align`.
#pragma once

namespace mpk::dev {

// 32-bit quotients: the kinds that split unevenly refuse grids with ceil(size / align) x parts
// >= 2^32 (graph.py _check_splits). A 64-bit division is a ~70-instruction
// software routine, and every thread of every such task computes these (ncu, perf-log).
__device__ __forceinline__ void split_bounds(int size, int parts, int align, int index, int& lo,
                                             int& hi) {
  const unsigned units = (unsigned)(size + align - 1) / (unsigned)align;
  lo = (int)min((unsigned)size, (unsigned)align * ((unsigned)index * units / (unsigned)parts));
  hi = (int)min((unsigned)size, (unsigned)align * ((unsigned)(index + 1) * units / (unsigned)parts));
}

}  // namespace mpk::dev
