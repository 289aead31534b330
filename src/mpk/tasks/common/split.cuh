// Uneven aligned splits (tasks/base.py split_bounds): part `index` of `parts` contiguous ranges
// of `size` items, each starting at a multiple of `align`; sizes differ by at most `align`.
#pragma once

namespace mpk::dev {

__device__ __forceinline__ void split_bounds(int size, int parts, int align, int index, int& lo,
                                             int& hi) {
  const long long units = (size + align - 1) / align;
  lo = (int)min((long long)size, align * ((long long)index * units / parts));
  hi = (int)min((long long)size, align * ((long long)(index + 1) * units / parts));
}

}  // namespace mpk::dev
