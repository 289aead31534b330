// linear, sm_90a: the MMA walk over a block's weight pages, part of linear/sm90.cuh (included
// there, after the task's types; read that file's header first).
#pragma once

namespace mpk::kinds::linear {
namespace detail {

// ---- the MMA walk over one block ---------------------------------------------------------------
struct Acc {
  float p[4], q[4];  // D of MMA 1 (weight words 0, 1) and MMA 2 (words 2, 3) of each unit
};
// A warp's accumulators: row g's (lo) and, wide, row g + 8's (hi), each on two chains (a page's
// even and odd units). Every row sums its units in the same order at every batch, so a row's
// outputs do not depend on the rows beside it (the serving engine's one-row plan must round as
// its 16-row plan: engine/scheduler.py).
struct Chains {
  Acc lo[2], hi[2];
};

// Units of one page a warp takes (its units are kWarps apart).
constexpr int kWarpUnitsPerPage = kPageUnits / kWarps;
static_assert(kPageUnits % kWarps == 0, "a page holds whole rounds of the warps' units");

// One unit for one input row: the weight read w is both MMAs' B fragments, the lane's 16-byte
// read a of the row (natural order) both MMAs' whole A fragment (header).
__device__ __forceinline__ void mma_unit(Acc& c, const uint4& w, const uint4& a) {
  dev::mma_bf16_16816(c.p, a.x, a.y, a.z, a.w, w.x, w.y);
  dev::mma_bf16_16816(c.q, a.x, a.y, a.z, a.w, w.z, w.w);
}

// A warp's weight reads of one page (its units' B fragments), loaded a page ahead of their MMAs.
// The A fragments are read just before the MMAs (the staged input: a broadcast at batch 1).
struct PageFrags {
  uint4 w[kWarpUnitsPerPage];
};

// The n (1..kWarpUnitsPerPage) weight units of this warp on page pg from unit u: units u,
// u + kWarps, ... kWhole: all of them (n == kWarpUnitsPerPage), with no per-unit predicate.
template <bool kWhole>
__device__ __forceinline__ void load_units(PageFrags& f, uint32_t pg, int u, int n) {
  const uint32_t wu = pg + ((unsigned)u % kPageUnits) * kUnitBytes;  // unit u in the page
#pragma unroll
  for (int j = 0; j < kWarpUnitsPerPage; ++j)
    // Unit u + j * kWarps sits j * kWarps units after unit u on the same page: a constant offset.
    if (kWhole || j < n) f.w[j] = dev::lds_v4(wu + j * kWarps * kUnitBytes);
}
__device__ __forceinline__ void load_page(PageFrags& f, uint32_t pg, int u, int n) {
  if (n == kWarpUnitsPerPage)
    load_units<true>(f, pg, u, n);
  else
    load_units<false>(f, pg, u, n);
}

// The MMAs of a loaded page, their A fragments read first (x, xh: the lane's fragment address of
// the page's first unit in row g, g + 8). Row g's MMAs on two accumulator chains (alternate
// units); wide, row g + 8's the same on its own two: four MMAs a unit where a permuted pair of
// rows took two, so the staged rows need no permute pass (perf-log, twenty-seventh session: that
// pass was 1.1-1.6 us of a b16 input). kWhole: no per-unit predicate (a predicated MMA is a
// convergence point: each waited for its own A read).
template <bool kWhole, bool kWide>
__device__ __forceinline__ void mma_units(const PageFrags& f, int n, unsigned x, unsigned xh,
                                          unsigned xstep, Chains& c) {
  if constexpr (kWide) {  // two fragments a unit, read at their MMAs (ahead: too many registers)
#pragma unroll
    for (int j = 0; j < kWarpUnitsPerPage; ++j)
      if (kWhole || j < n) {
        mma_unit(c.lo[j & 1], f.w[j], dev::lds_v4(x + j * xstep));
        mma_unit(c.hi[j & 1], f.w[j], dev::lds_v4(xh + j * xstep));
      }
  } else {
    uint4 a[kWarpUnitsPerPage];
#pragma unroll
    for (int j = 0; j < kWarpUnitsPerPage; ++j)
      if (kWhole || j < n) a[j] = dev::lds_v4(x + j * xstep);
#pragma unroll
    for (int j = 0; j < kWarpUnitsPerPage; ++j)
      if (kWhole || j < n) mma_unit(c.lo[j & 1], f.w[j], a[j]);
  }
}
template <bool kWide>
__device__ __forceinline__ void mma_page(const PageFrags& f, int n, unsigned x, unsigned xh,
                                         unsigned xstep, Chains& c) {
  if (n == kWarpUnitsPerPage)
    mma_units<true, kWide>(f, n, x, xh, xstep, c);
  else
    mma_units<false, kWide>(f, n, x, xh, xstep, c);
}

// Units of this warp on the page of unit u, below end (a page holds a whole round of units).
__device__ __forceinline__ int units_on_page(int u, int end) {
  const int stop = min(end, (int)((unsigned)u / kPageUnits + 1) * kPageUnits);
  return (stop - u + kWarps - 1) / kWarps;
}

// Where a warp's walk stands: its next unit u, that unit's k-group offset xo in the staged rows,
// and its n units on u's page (loaded, MMAs pending).
struct WalkPos {
  int u;
  unsigned xo;
  int n;
};

// One step of the walk: page `cur` is loaded (pos); wait for the next page, load its weight
// units into `nxt`, then run cur's MMAs and release cur: the next page's loads are in flight
// under this page's MMAs. (Measured: warp 0 still takes ~500 cycles a page at batch 1, as when a
// page's loads came before its own MMAs only, so the walk is not latency-bound; shared-memory
// traffic is the suspect: perf-log, seventeenth session.) False after the block's last page (its
// MMAs done, the page still held).
template <bool kWide>
__device__ __forceinline__ bool walk_step(mpk::PageCursor& pc, PageFrags& cur, PageFrags& nxt,
                                          WalkPos& pos, int end,
                                          unsigned x, unsigned xh, unsigned xstep, Chains& c) {
  const int u = pos.u + pos.n * kWarps;
  if (u >= end) {
    mma_page<kWide>(cur, pos.n, x + pos.xo, xh + pos.xo, xstep, c);
    return false;
  }
  const uint32_t pg = pc.peek(pc.next_landed()) + (threadIdx.x & 31) * 16;
  const unsigned xo = pos.xo + pos.n * xstep;
  const int n = units_on_page(u, end);
  load_page(nxt, pg, u, n);
  mma_page<kWide>(cur, pos.n, x + pos.xo, xh + pos.xo, xstep, c);
  pc.step();  // cur's fragments are in registers, consumed: release it; nxt's page landed
  pos = WalkPos{u, xo, n};
  return true;
}

// Accumulate this warp's units of a block (task-local units [u0, u0 + nb*nk)) into the lane's
// outputs r[j] (batch_of(j), row_of(j); zero where the layout leaves none). Page by page, a page
// ahead (walk_step), on two accumulator chains a row (Chains). (One accumulator and a wait,
// loads and an index division per unit made every unit a ~300-cycle dependent chain:
// scripts/probe_phases.py.)
template <bool kWide>
__device__ __forceinline__ void mma_block(const Task& t, const Scratch& s, mpk::PageCursor& pc,
                                          int u0, int nb, int nk, float (&r)[4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int first = u0 + ((warp - u0) & (kWarps - 1));  // kWarps and nb: powers of two
  const int end = u0 + nb * nk;
  // Staged bytes per k group (32 k) of a staged row, and a lane's A fragment in it.
  constexpr unsigned kGroupBytes = 64u;
  // A warp's units are kWarps apart: k groups kWarps / nb apart (nb divides kWarps).
  const unsigned xstep = (unsigned)(kWarps >> (31 - __clz(nb))) * kGroupBytes;
  const unsigned kg0 = (unsigned)((first - u0) >> (31 - __clz(nb))) * kGroupBytes;  // its k group
  // Rows past B read a real row (wide: zeros): they only reach discarded rows of D.
  const int row = kWide ? g : min(g, t.B - 1);
  const unsigned x = dev::smem_addr(s.xs + row * s.XS) + tq * (kGroupBytes / 4) + kg0;
  const unsigned xh = x + (unsigned)(kRows * s.XS * 2);  // wide: row g + 8
  Chains c;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 4; ++e) c.lo[h].p[e] = c.lo[h].q[e] = c.hi[h].p[e] = c.hi[h].q[e] = 0.f;
  if (first < end) {
    // The block's first page may be the one the previous block ended in; after it, a warp's
    // next unit is always on the next page.
    const uint32_t pg = pc.at((int)((unsigned)first / kPageUnits)) + lane * 16;
    WalkPos pos{first, 0u, units_on_page(first, end)};
    PageFrags cur, nxt;
    load_page(cur, pg, pos.u, pos.n);
#pragma unroll 1
    while (walk_step<kWide>(pc, cur, nxt, pos, end, x, xh, xstep, c)) cur = nxt;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    // Row g's output n is D1[g][n] + D2[g + 8][n] (header), each the sum of its two chains;
    // wide, row g + 8's is the same of its own MMAs (hi). The same order at every batch.
    r[j] = (c.lo[0].p[j] + c.lo[1].p[j]) + (c.lo[0].q[j + 2] + c.lo[1].q[j + 2]);
    r[j + 2] = kWide ? (c.hi[0].p[j] + c.hi[1].p[j]) + (c.hi[0].q[j + 2] + c.hi[1].q[j + 2]) : 0.f;
  }
}

__device__ __forceinline__ void walk(const Task& t, const Scratch& s, mpk::PageCursor& pc,
                                     int u0, int nb, int nk, float (&r)[4]) {
  if (t.wide)
    mma_block<true>(t, s, pc, u0, nb, nk, r);
  else
    mma_block<false>(t, s, pc, u0, nb, nk, r);
}

}  // namespace detail
}  // namespace mpk::kinds::linear
