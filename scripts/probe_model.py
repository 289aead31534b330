#!/usr/bin/env python
"""A model's decode step taken apart on the GPU: probe_phases.py's patches on a real plan.

`mpk profile` splits each op's phase into handoff, input, compute, epilogue and signal
(mpk/profile/phases.py). This probe reruns that profile with patched copies of the kernel
headers (probe_phases.include_dir; the product is unchanged) to explain the compute part:
  none       the profile as is (the patched-build infrastructure, no edit),
  loader_lead  WAIT := when the loader issued the record's last page: per role, how far ahead
             of the task (RUN) the loader was (p10/p50/p90),
  pagewait   the WAIT stamp := 1 + warp 0's total time waiting for weight pages to land, per
             linear task: pages that are not resident when a task reaches them,
  no_mma     ablation (wrong outputs, timing only): the walk reads the weights but does no MMA,
  no_wload   ablation (wrong outputs, timing only): MMAs on a made-up fragment, no weight loads,
  attn_nokv  ablation (timing only): attention reads no cached key or value (only this step's),
  attn_l2pf  attention's prologue prefetches the cached keys and values to L2 (evict_last),
  attn_m_scores, attn_m_block, attn_m_loop  attention's COMPUTE mark at warp 0's scores, first
             block, loop end (where its compute goes),
  attn_m_polled  attention's INPUT mark once the flagged qkv is polled (before prepare),
  lin_m_allwalked  a linear's COMPUTE mark once every warp's walk of a shared block is done,
  lin_e_done, lin_e_finished  a linear's COMPUTE mark once finish_shared (or pc.finish()) is done,
  lin_i_entry, lin_i_issued, lin_i_landed, lin_i_polled, lin_i_summed  a linear's INPUT mark at
             the chunk loop's start, after thread 0 issued its x copies, once all landed (a
             flagged x: once polled in), or the norm's sums done,
  lin_s_top, lin_s_taskof  a linear's INPUT mark in its set-up: run()'s entry, after task_of,
  no_units   the page protocol without the units (timing only),
  no_xread   ablation (wrong outputs, timing only): the linear staging stores zeros where its
             cp.async copies of x would land (no global read of the input),
  quiet      the loader issues no copy while this CTA's consumers stage a task's input (RUN to
             the kind's INPUT mark; a kind without one: its whole body): do the weight copies in
             flight slow the activations' reads from L2?
  walk_cycles, no_loader_walk_cycles  warp 0's clock64 cycles in the linear walk per task and the
             pages it walked (cycles a page), with and without the loader's copies,
  walk_clock warp 0's walk in clock64 cycles and %globaltimer ns (the SM clock it ran at),
  no_aload_walk_cycles, no_wload_walk_cycles  walk_cycles with made-up A (input) or weight
             fragments, no shared-memory reads of them (timing only: is the walk
             bound by shared-memory traffic?),
  epi_cycles thread 0's clock64 cycles in a linear's last finish_shared: the partials' stores and
             barrier, the cross-warp sums, the stores, then pc.finish() (timing only),
  walk_start WAIT := warp 0's entry into the last block's walk (scripts/phase_spread.py --run),
  moe_gu_pf, moe_down_pf, moe_pf  the experts' weights prefetched to L2 in bulk as soon as
             their addresses are known (gate_up, down, both; same results),
  no_loader_moe_pf  moe_pf without the loader's page copies (timing only),
Per op role: the phase parts, and for pagewait the mean page wait of its linear tasks.

  python scripts/probe_model.py --model qwen3-0.6b [--runs none,pagewait] [--json]   # on the GPU
  python scripts/probe_model.py --dry-run    # anywhere: every patch applies
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from probe_phases import FINISH, PATCHES, UNIT_MMA, UNIT_W, UNIT_X, include_dir, probe_build, stamp
from probe_stream import page_config

from mpk.backends.cuda import codegen
from mpk.compiler import cache
from mpk.models.config import get_preset
from mpk.profile.phases import role_of

# Never zero (a zero stamp reads as "did not run").
PATCHES["pagewait1"] = {
    "task_args.cuh": PATCHES["pagewait"]["task_args.cuh"],
    "linear/sm90.cuh": [(FINISH, (f"  pc.finish();\n  {stamp('pc.waited + 1ull')}\n"
                                 "  if (t.argmax)"))]}
# The page protocol without the units. Timing only.
PATCHES["no_units"] = {"linear/sm90_walk.cuh": [
    (UNIT_W, "    ;\n"), (UNIT_X, "      ;\n"), (UNIT_MMA, "      ;\n"),
    ("        mma_unit(c.lo[j & 1], f.w[j], dev::lds_v4(x + j * xstep));\n"
     "        mma_unit(c.hi[j & 1], f.w[j], dev::lds_v4(xh + j * xstep));\n", "        ;\n")]}
# WAIT := when the loader issued the record's last page copy (the consumers' own WAIT stamp is
# dropped): RUN - WAIT is how far ahead of the task the loader was.
RECORD_END = "        src += sizes[r];\n      }\n    }\n"
PATCHES["loader_lead"] = {"runtime.cuh": [
    (RECORD_END, RECORD_END + "    sh.slot[sl].t_wait = ptx::globaltimer();\n"),
    ("      slot.t_wait = t_wait;\n", "")]}
# The controller polls with relaxed loads and acquires once the target is met (ld.acquire
# compiles to a load plus an L1 invalidation, CCTL.IVALL, on every poll).
POLL = "      for (;;) {\n        v = ptx::ld_acquire_u64(ctr);\n        if (v >= target) break;\n"
PATCHES["relaxed_poll"] = {"runtime.cuh": [(POLL, (
    "      for (;;) {\n"
    "        asm volatile(\"ld.relaxed.gpu.global.u64 %0, [%1];\" : \"=l\"(v) : \"l\"(ctr)"
    " : \"memory\");\n"
    "        if (v >= target) { v = ptx::ld_acquire_u64(ctr); break; }\n"))]}
# The loader copies nothing: pages complete at once with stale contents (timing only).
ISSUE = ("        ptx::mbar_arrive_expect_tx(full, sizes[r]);\n"
         "        ptx::bulk_copy_g2s(ring + ps * (uint32_t)PAGE_BYTES, src, sizes[r], full, policy);\n")
PATCHES["no_loader"] = {"runtime.cuh": [(ISSUE, "        ptx::mbar_arrive(full);\n")]}
# Lane 0 of each consumer warp releases a weight page after a warp sync (the empty barrier
# counts warps), instead of every consumer thread arriving itself (timing: same results).
RELEASE = "    ptx::mbar_arrive(full + 8u * (NUM_PAGES + slot()));\n"
PATCHES["warp_release"] = {
    "task_args.cuh": [(RELEASE, "    __syncwarp();\n    if ((threadIdx.x & 31) == 0) " + RELEASE.lstrip())],
    "runtime.cuh": [("ptx::mbar_init(ptx::smem_u32(&sh.bars.empty[i]), NUM_THREADS);",
                     "ptx::mbar_init(ptx::smem_u32(&sh.bars.empty[i]), CONSUMER_WARPS);")]}
# The producer warps (loader, storer, fetcher) spin in wait_unless_gone: try_wait, a shared
# load, again. nanosleep: they back off 64 ns per turn; hint: every try_wait asks the hardware
# to suspend the warp until the phase completes (suspendTimeHint, as CUTLASS does).
GONE = "    if (ptx::ld_acquire_cta(gone)) return ptx::mbar_try_wait(bar, parity);\n"
PATCHES["nanosleep"] = {"runtime.cuh": [(GONE, GONE + "    __nanosleep(64);\n")]}
TRY = "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
PATCHES["hint"] = {"ptx.cuh": [(TRY, TRY.replace("%2;", "%2, 0x989680;"))]}
# Combined ablations with no copies in flight (timing only): the page protocol alone, and the
# unit loop with neither its MMAs nor its weight loads.
PATCHES["no_loader_no_units"] = {**PATCHES["no_loader"], **PATCHES["no_units"]}
PATCHES["no_loader_bare_units"] = {**PATCHES["no_loader"], "linear/sm90_walk.cuh": [
    *PATCHES["no_mma"]["linear/sm90_walk.cuh"], *PATCHES["no_wload"]["linear/sm90_walk.cuh"]]}
# The controller reads %globaltimer and the abort flag on every poll; here on every 64th only.
PATCHES["sparse_timer"] = {"runtime.cuh": [
    ("      for (;;) {\n        v = ptx::ld_acquire_u64(ctr);\n        if (v >= target) break;\n",
     "      for (unsigned n = 1;; ++n) {\n        v = ptx::ld_acquire_u64(ctr);\n"
     "        if (v >= target) break;\n        if (n & 63) continue;\n")]}
# Attention ablations (timing only): the cached positions are masked, so only this step's own
# key and value are attended (no K/V loads from the cache); and with no loader as well, so no
# weight copies of later records compete with the attention's loads.
CACHE_ROW = "    return cache + (((long long)page * c.PS + (q - pi * c.PS)) * c.KVH + hh) * D;\n"
PATCHES["attn_nokv"] = {"attention/sm90.cuh": [(CACHE_ROW, "    return nullptr;\n")]}
PATCHES["no_loader_attn_nokv"] = {**PATCHES["no_loader"], **PATCHES["attn_nokv"]}
# The prologue (before the waits) prefetches the cached positions' keys and values to L2 with
# evict_last: are attention's K/V loads after the waits HBM round trips (timing; same results)?
PROLOGUE_END = "  if (t == 0) {\n    st.crow = "
# Where attention's compute goes (timing; same results): COMPUTE := warp 0's time at a point of
# its first block (after the values it depends on are in registers) instead of after every warp
# attended: its scores (the K loads and score MMAs), the block (softmax and the PV MMAs), the loop.
ATTN_MARK = ("  a.mark(1);  // profiling: every warp's positions are attended (the last pass's mark "
             "stays)\n")
SCORES_DONE = "    const float ninf = -__int_as_float(0x7f800000);\n"
BLOCK_DONE = ("    __syncwarp();  // the staged rows are read before the next block's copies "
              "overwrite them\n")
LOOP_DONE = "  // ---- warp state -> smem ----\n"
USE_O = '    asm volatile("" ::"f"(o[0][0]), "f"(o[MT_MAX - 1][3]), "f"(ot[0]));\n'
PATCHES["attn_m_scores"] = {"attention/sm90.cuh": [(ATTN_MARK, ""), (SCORES_DONE, (
    '    asm volatile("" ::"f"(sc[0]), "f"(sc[1]), "f"(sc[2]), "f"(sc[3]));\n'
    "    a.mark(1);\n") + SCORES_DONE)]}
PATCHES["attn_m_block"] = {"attention/sm90.cuh": [(ATTN_MARK, ""), (BLOCK_DONE, USE_O + "    a.mark(1);\n" + BLOCK_DONE)]}
PATCHES["attn_m_loop"] = {"attention/sm90.cuh": [(ATTN_MARK, ""), (LOOP_DONE, USE_O.replace("    ", "  ", 1) + "  a.mark(1);\n" + LOOP_DONE)]}
# Where a linear's epilogue goes (timing; same results): COMPUTE := every warp's walk of the
# block done (their sums forced into registers, then a barrier) instead of warp 0's: the rest
# of the epilogue is the cross-warp reduction, the residual and the stores.
SHARED_WALK = ("          walk(t, s, pc, u0, nb, nk, r);\n          a.mark(1);\n"
               "          finish_shared(")
PATCHES["lin_m_allwalked"] = {"linear/sm90.cuh": [(SHARED_WALK, (
    "          walk(t, s, pc, u0, nb, nk, r);\n"
    '          asm volatile("" ::"f"(r[0]), "f"(r[1]), "f"(r[2]), "f"(r[3]));\n'
    "          mpk::task_sync();\n          a.mark(1);\n          finish_shared("))]}
# The rest of it (timing; same results): COMPUTE := every thread out of finish_shared (the
# cross-warp sums reduced and the outputs stored), or out of the task's pc.finish(); the profile's
# epilogue is then what follows (the page releases and the runtime's barrier; or the barrier).
FINISH_SHARED = "          finish_shared(t, s, rg0, u0, nb, r, buf, resid, ch, inv);\n"
PATCHES["lin_e_done"] = {"linear/sm90.cuh": [(FINISH_SHARED, (
    FINISH_SHARED + "          mpk::task_sync();\n          a.mark(1);\n"))]}
PATCHES["lin_e_finished"] = {"linear/sm90.cuh": [(FINISH, (
    "  pc.finish();\n  mpk::task_sync();\n  a.mark(1);\n  if (t.argmax)"))]}
# Where attention's input goes (timing; same results): INPUT := the flagged qkv polled (before
# prepare's norms, RoPE and KV append) instead of after prepare.
QKV_POLLED = "    stage_flagged_qkv(a, c, L);\n    mpk::task_sync();\n"
PATCHES["attn_m_polled"] = {"attention/sm90.cuh": [
    ("  a.mark(0);  // profiling: the inputs are prepared\n", ""),
    (QKV_POLLED, QKV_POLLED + "    a.mark(0);\n")]}
PATCHES["attn_l2pf"] = {"attention/sm90.cuh": [(PROLOGUE_END, "  if (st.valid) {\n" + (
    "    for (int i = threadIdx.x, lines = c.D / 64, hi = min(st.R.hi, st.f0);\n"
    "         i < max(0, hi - st.R.lo) * 2 * lines; i += NUM_THREADS) {\n"
    "      const int q = st.R.lo + i / (2 * lines), part = i % (2 * lines);\n"
    "      const int page = dev::ld_act_i32(c.pt + q / c.PS);\n"
    "      if (page < 0 || page >= c.NP) continue;\n"
    "      const bf16* row = (part < lines ? c.kc : c.vc) +\n"
    "                        ((long long)page * c.PS + q % c.PS) * c.KVH * c.D + (part % lines) * 64;\n"
    "      asm volatile(\"prefetch.global.L2::evict_last [%0];\" ::\"l\"(row));\n"
    "    }\n  }\n") + PROLOGUE_END)]}
# The loader holds its next copy while the consumers stage a task's input: a CTA-wide flag set
# when the consumers start a record and cleared at the kind's INPUT mark (profiling builds
# stamp it) or when the record ends.
QUIET_FLAG = "__shared__ int mpk_probe_staging;\n"
PATCHES["quiet"] = {
    "task_args.cuh": [
        ("namespace mpk {\n", "namespace mpk {\n" + QUIET_FLAG),
        ("    if (threadIdx.x == 0) marks[i] = ptx::globaltimer();\n",
         "    if (threadIdx.x == 0) {\n      marks[i] = ptx::globaltimer();\n"
         "      if (i == 0) ptx::st_release_cta(&mpk_probe_staging, 0);\n    }\n")],
    "runtime.cuh": [
        ("  sh.consumers_gone = 0;\n", "  sh.consumers_gone = 0;\n  mpk_probe_staging = 0;\n"),
        ("    const TaskArgs a = task_args(p, sh, slot, ring, scratch, task_params);\n",
         "    if (tid == 0) ptx::st_release_cta(&mpk_probe_staging, 1);\n"
         "    const TaskArgs a = task_args(p, sh, slot, ring, scratch, task_params);\n"),
        ("    task_sync();\n#ifdef MPK_PROFILE\n    if (tid == 0) slot.t_done",
         "    task_sync();\n    if (tid == 0) ptx::st_release_cta(&mpk_probe_staging, 0);\n"
         "#ifdef MPK_PROFILE\n    if (tid == 0) slot.t_done"),
        (ISSUE, "        while (ptx::ld_acquire_cta(&mpk_probe_staging) &&\n"
                "               !ptx::ld_acquire_cta(&sh.consumers_gone)) {\n        }\n" + ISSUE)]}
# The loader holds its next copy from the end of a record's task (every page of it released)
# until the storer has fenced and signalled it: does the storer's fence wait longer because this
# SM's weight copies are in flight (signal ~0.9-1.1 us on linear phases, ~0.6 with no copies)?
SIGNALS = "      ptx::red_relaxed_add_u64(p.counters + slot.rec[REC_SIGNALS + j], 1ull);\n"
PATCHES["quiet_signal"] = {
    "task_args.cuh": [("namespace mpk {\n", "namespace mpk {\n" + QUIET_FLAG)],
    "runtime.cuh": [
        ("  sh.consumers_gone = 0;\n", "  sh.consumers_gone = 0;\n  mpk_probe_staging = 0;\n"),
        ("    if (!dispatch(slot.rec[REC_KIND], a)) __trap();  // the controller checked the kind id\n",
         "    if (!dispatch(slot.rec[REC_KIND], a)) __trap();  // the controller checked the kind id\n"
         "    if (tid == 0) ptx::st_release_cta(&mpk_probe_staging, 1);\n"),
        (SIGNALS, SIGNALS + "    ptx::st_release_cta(&mpk_probe_staging, 0);\n"),
        (ISSUE, "        while (ptx::ld_acquire_cta(&mpk_probe_staging) &&\n"
                "               !ptx::ld_acquire_cta(&sh.consumers_gone)) {\n        }\n" + ISSUE)]}
# The staging without its global reads: zeros where the input would land (timing only).
CP_X = "    dev::cp_async_act16(landing(s, b, v), t.x + (long long)b * t.K + k0 + v * 8);\n"
PATCHES["no_xread"] = {"linear/sm90.cuh": [
    (CP_X, "    *reinterpret_cast<uint4*>(landing(s, b, v)) = make_uint4(0u, 0u, 0u, 0u);\n")]}
# MoE experts (timing only): no expert weight loads (made-up vectors, the FMAs stay), or twice
# the loads in flight per lane (kV doubled: more registers, allowed in a probe build).
GU_LOAD = ("        g[i] = ok ? dev::ld_weight_v4(wg + v * 8) : make_uint4(0u, 0u, 0u, 0u);\n"
           "        u[i] = ok ? dev::ld_weight_v4(wg + up_off + v * 8) : make_uint4(0u, 0u, 0u, 0u);\n")
DOWN_LOAD = ("    w[i] = row != nullptr && v < vpr ? dev::ld_weight_v4(row + v * 8) : "
             "make_uint4(0u, 0u, 0u, 0u);\n")
PATCHES["moe_noload"] = {
    "moe_gate_up/sm90.cuh": [(GU_LOAD, "        g[i] = make_uint4(v, n, ok, c);\n"
                                       "        u[i] = make_uint4(n, v, c, ok);\n")],
    "moe_down/sm90.cuh": [(DOWN_LOAD, "    w[i] = make_uint4(v, n, j, row != nullptr);\n")]}
# Warp 0's own clock in the linear walk, per task (the WAIT stamp): bits 0-31 the cycles inside
# walk() (every block, page waits included; 32-bit clock), 48-63 the pages walked. Timing only;
# the phase parts of linear ops lose their WAIT split.
WALK = ("__device__ __forceinline__ void walk(const Task& t, const Scratch& s, mpk::PageCursor& pc,\n"
        "                                     int u0, int nb, int nk, float (&r)[4]) {\n")
WALK_END = "    mma_block<false>(t, s, pc, u0, nb, nk, r);\n}\n"
WALK_STEP = "  const int u = pos.u + pos.n * kWarps;\n"  # walk_step: once a page
PATCHES["walk_cycles"] = {
    "task_args.cuh": [("  long long limit_ns;",
                       "  long long limit_ns;\n  unsigned probe_cyc = 0, probe_pages = 0;")],
    "linear/sm90_walk.cuh": [
        (WALK, WALK + "  const unsigned probe_c0 = (unsigned)clock();\n"),
        (WALK_END, WALK_END[:-2] + "  pc.probe_cyc += (unsigned)clock() - probe_c0;\n}\n"),
        (WALK_STEP, "  ++pc.probe_pages;\n" + WALK_STEP)],
    "linear/sm90.cuh": [
        (FINISH, "  pc.finish();\n  " + stamp("(unsigned long long)pc.probe_cyc | "
                                            "((unsigned long long)(pc.probe_pages + 1) << 48)")
         + "\n  if (t.argmax)")]}
# The SM clock the walk runs at: WAIT := warp 0's cycles in walk() (bits 0-31) and the same
# span in %globaltimer ns (bits 32-63). Timing only.
PATCHES["walk_clock"] = {
    "task_args.cuh": [("  long long limit_ns;",
                       "  long long limit_ns;\n  unsigned probe_cyc = 0, probe_ns = 0;")],
    "linear/sm90_walk.cuh": [
        (WALK, WALK + "  const unsigned probe_c0 = (unsigned)clock();\n"
         "  const unsigned long long probe_t0 = mpk::ptx::globaltimer();\n"),
        (WALK_END, WALK_END[:-2] + "  pc.probe_cyc += (unsigned)clock() - probe_c0;\n"
         "  pc.probe_ns += (unsigned)(mpk::ptx::globaltimer() - probe_t0);\n}\n")],
    "linear/sm90.cuh": [
        (FINISH, "  pc.finish();\n  " + stamp("(unsigned long long)pc.probe_cyc | "
                                            "((unsigned long long)pc.probe_ns << 32) | 1ull")
         + "\n  if (t.argmax)")]}
# WAIT := when warp 0 enters each block's walk (the last block's stays): splits the profile's
# compute part (INPUT -> COMPUTE) at the walk's start. Timing only.
OWN_WALK = ("          prefetch_own(t, rg, resid);\n          walk(t, s, pc, u0, nb, nk, r);\n")
SHARED_WALK = ("          prefetch_shared(t, rg0, nb, resid);\n"
               "          walk(t, s, pc, u0, nb, nk, r);\n")
PATCHES["walk_start"] = {"linear/sm90.cuh": [
    (OWN_WALK, OWN_WALK.replace("          walk(", "          " + stamp() + "\n          walk(")),
    (SHARED_WALK, SHARED_WALK.replace("          walk(", "          " + stamp() + "\n          walk("))]}
PATCHES["no_loader_walk_cycles"] = {**PATCHES["walk_cycles"], **PATCHES["no_loader"]}
# Where finish_shared's ~0.9 us goes (eighteenth session: lin_e_done), on thread 0's clock in
# the task's last shared block: WAIT := four 16-bit cycle counts (saturated): bits 0-15 the
# partial sums' stores and the barrier, 16-31 the cross-warp sums, 32-47 the rest of
# finish_shared (residual, stores), 48-63 pc.finish(). Timing only (same results); a task whose
# last block is a finish_own block, or that has no block, keeps the stamp 0 and is left out.
EPI_SHARED = "__shared__ unsigned long long mpk_probe_epi;\n__shared__ unsigned mpk_probe_c;\n"
EPI_MARK = ("if (threadIdx.x == 0) {{ const unsigned c = (unsigned)clock(); "
            "mpk_probe_epi |= (unsigned long long)min(c - mpk_probe_c, 65535u) << {shift}; "
            "mpk_probe_c = c; }}")
FS_SYNC = ("  const float inv_b = t.rms ? __shfl_sync(0xffffffffu, inv, b) : 1.f;  // every lane, b < 16\n"
           "  mpk::task_sync();\n")
FS_SUMS = "    if (t.silu) up[e] = reduce_part(s, buf, u0, nb, rgl, r + 4 + e, b);\n  }\n"
FS_CALL = "          finish_shared(t, s, rg0, u0, nb, r, buf, resid, ch, inv);\n"
LINEAR_TASK = "  const Task t = task_at_run(a);\n"  # run()'s first line: a task without a shared
                                                   # block leaves its stamp's first 48 bits 0
PATCHES["epi_cycles"] = {
    "task_args.cuh": [("namespace mpk {\n", "namespace mpk {\n" + EPI_SHARED)],
    "linear/sm90.cuh": [
        ("  float* mine = s.part + (buf * kWarps + warp) * kPartWarp;\n",
         "  if (tid == 0) { mpk_probe_epi = 0ull; mpk_probe_c = (unsigned)clock(); }\n"
         "  float* mine = s.part + (buf * kWarps + warp) * kPartWarp;\n"),
        (FS_SYNC, FS_SYNC + "  " + EPI_MARK.format(shift=0) + "\n"),
        (FS_SUMS, FS_SUMS + '  asm volatile("" ::"f"(v[0]), "f"(v[1]), "f"(up[0]), "f"(up[1]));\n'
         "  " + EPI_MARK.format(shift=16) + "\n"),
        (FS_CALL, FS_CALL + "          " + EPI_MARK.format(shift=32) + "\n"),
        (LINEAR_TASK, LINEAR_TASK + "  if (threadIdx.x == 0) mpk_probe_epi = 0ull;\n"),
        (FINISH, "  pc.finish();\n  " + EPI_MARK.format(shift=48) + "\n  "
         + stamp("mpk_probe_epi") + "\n  if (t.argmax)")]}
# Is the walk bound by shared-memory traffic (seventeenth session: ~500 cycles a page, unchanged
# with the loads a page ahead)? walk_cycles with no A reads (made-up fragments), or no weight
# reads. Timing only (wrong results); batch <= 8 (the narrow walk).
NO_ALOAD = (UNIT_X, "      if (kWhole || j < n) a[j] = make_uint4(x, xstep, x ^ 3u, j);\n")
NO_WLOAD = PATCHES["no_wload"]["linear/sm90_walk.cuh"][0]
for _name, _edit in (("no_aload_walk_cycles", NO_ALOAD), ("no_wload_walk_cycles", NO_WLOAD)):
    PATCHES[_name] = {**PATCHES["walk_cycles"], "linear/sm90_walk.cuh": [
        *PATCHES["walk_cycles"]["linear/sm90_walk.cuh"], _edit]}
PATCHES["moe_inflight2x"] = {
    "moe_gate_up/sm90.cuh": [("constexpr int kV = 4;", "constexpr int kV = 8;")],
    "moe_down/sm90.cuh": [("constexpr int kV = 3;", "constexpr int kV = 6;")]}
# The experts' weights asked of L2 in bulk as soon as their addresses are known (the
# twentieth session's bulk-copy rings were slower than the register loads; do prefetches help
# the loads instead?). gate_up: one thread prefetches the task's gate and up ranges (two
# contiguous (hi - lo) x H blocks) in 16 KB pieces once the slot's expert is found; down: the
# thread that loads an id prefetches that expert's rows [lo, hi) (one contiguous block).
# Same results.
GU_PAIRS = "  // 2. the pairs that chose it (none for an unused slot: expert -1; no early return, which\n"
PF_PIECES = (
    "    for (unsigned o = 0; o < bytes; o += 16384u) {{\n"
    "      const unsigned n = min(16384u, bytes - o);\n"
    "{body}"
    "    }}\n")
PATCHES["moe_gu_pf"] = {"moe_gate_up/sm90.cuh": [(GU_PAIRS, (
    "  if (expert >= 0 && tid == 32) {  // probe moe_gu_pf\n"
    "    int plo, phi;\n"
    "    dev::split_bounds(I, T, kAlign, tile, plo, phi);\n"
    "    const char* pg = reinterpret_cast<const char*>(\n"
    "        weight + (long long)expert * 2 * I * H + (long long)plo * H);\n"
    "    const long long pup = (long long)I * H * 2;\n"
    "    const unsigned bytes = (unsigned)((phi - plo) * H * 2);\n"
    + PF_PIECES.format(body="      mpk::ptx::prefetch_l2_bulk(pg + o, n);\n"
                            "      mpk::ptx::prefetch_l2_bulk(pg + pup + o, n);\n")
    + "  }\n" + GU_PAIRS))]}
DOWN_IDS = "    ws[i] = i == tid ? first_w : dev::ld_act_bf16f(gws + i);\n  }\n"
PATCHES["moe_down_pf"] = {"moe_down/sm90.cuh": [(DOWN_IDS, (
    "    ws[i] = i == tid ? first_w : dev::ld_act_bf16f(gws + i);\n"
    "    const int pe = ids[i];  // probe moe_down_pf\n"
    "    if (0 <= pe && pe < E && hi > lo) {\n"
    "    const char* pw = reinterpret_cast<const char*>(weight + ((long long)pe * H + lo) * I);\n"
    "    const unsigned bytes = (unsigned)((hi - lo) * I * 2);\n"
    + PF_PIECES.format(body="      mpk::ptx::prefetch_l2_bulk(pw + o, n);\n")
    + "    }\n  }\n"))]}
PATCHES["moe_pf"] = {**PATCHES["moe_gu_pf"], **PATCHES["moe_down_pf"]}
# Are the prefetches slow because the loader's page copies hold the SM's bulk-copy unit? The
# same without the loader's copies (timing only: the weight pages hold garbage).
PATCHES["no_loader_moe_pf"] = {**PATCHES["no_loader"], **PATCHES["moe_pf"]}
# Where a linear's input goes (timing; same results): INPUT := thread 0 before the chunk loop
# (the task's set-up), after issuing its copies of chunk 0's x, once every thread's copies
# landed (plus a barrier), or (rmsnorm) once the sums of squares are complete.
INV = "    if (ch == t.nch - 1) inv = lane_inv(t, s);\n"
MARK0 = ("    stage_chunk(t, s, ch);\n" + INV
         + "    if (ch == 0) a.mark(0);  // profiling: the input is in\n")
MARK0_PA = "    stage_chunk(t, s, ch, ch == 0 ? a.marks : nullptr);\n" + INV
RAW_SIG = "int kfill) {\n"
CHUNK_SIG = "const Scratch& s, int ch) {\n"
RAW_CALL = "  stage_raw(t, s, k0, kc, kfill);\n"
PM_ARG = "unsigned long long* pm = nullptr) {"
PA_EDITS = [(MARK0, MARK0_PA), (RAW_SIG, RAW_SIG.replace(") {", ", " + PM_ARG)),
            (CHUNK_SIG, CHUNK_SIG.replace("int ch) {", "int ch, " + PM_ARG)),
            (RAW_CALL, RAW_CALL.replace(");", ", pm);"))]
PM_MARK = "    if (pm && threadIdx.x == 0) pm[0] = mpk::ptx::globaltimer();\n"
CHUNK_LOOP = "  int u0 = 0, buf = 0;\n  float inv = 1.f;\n  for (int ch = 0; ch < t.nch; ++ch) {\n"
PATCHES["lin_i_entry"] = {"linear/sm90.cuh": [(MARK0, "    stage_chunk(t, s, ch);\n" + INV),
                                               (CHUNK_LOOP, "  a.mark(0);\n" + CHUNK_LOOP)]}
COMMIT = "    dev::cp_async_commit();\n"
PATCHES["lin_i_issued"] = {"linear/sm90.cuh": [*PA_EDITS, (COMMIT, COMMIT + PM_MARK)]}
WAITED = "    dev::cp_async_wait_all();\n  }\n"
PM_SYNC_MARK = ("    if (pm) {\n      mpk::task_sync();\n" + PM_MARK.replace("    ", "      ", 1)
                + "    }\n")
PATCHES["lin_i_landed"] = {"linear/sm90.cuh": [*PA_EDITS, (WAITED, WAITED.replace(
    "  }\n", PM_SYNC_MARK + "  }\n"))]}
POLLED = "    poll_stage(t, s, k0, vpr, vfill);\n"
PATCHES["lin_i_polled"] = {"linear/sm90.cuh": [*PA_EDITS, (POLLED, POLLED + PM_SYNC_MARK)]}
SUMMED = "  sum_squares(t, s, kc, ch > 0);\n  if (ch == t.nch - 1) mpk::task_sync();\n"
PATCHES["lin_i_summed"] = {"linear/sm90.cuh": [*PA_EDITS, (SUMMED, SUMMED + PM_MARK)]}
# Where a linear's set-up goes (timing; same results): INPUT := thread 0 at run()'s entry (the
# dispatch reached it), after task_of (the PageCursor copy); lin_i_entry (after the scratch's
# slots are set) is the chunk loop's start.
SETUP_MARKS = {"lin_s_top": "  const Task t = task_at_run(a);\n",
               "lin_s_taskof": "  mpk::PageCursor pc = a.pages;\n"}
for _name, _at in SETUP_MARKS.items():
    PATCHES[_name] = {"linear/sm90.cuh": [(MARK0, "    stage_chunk(t, s, ch);\n" + INV),
                                          (_at, "  a.mark(0);\n" + _at)]}
RUNS = {"none": "none", "quiet": "quiet", "no_xread": "no_xread", "attn_nokv": "attn_nokv", "attn_l2pf": "attn_l2pf", "attn_m_scores": "attn_m_scores", "attn_m_block": "attn_m_block", "attn_m_loop": "attn_m_loop", "lin_m_allwalked": "lin_m_allwalked", "lin_e_done": "lin_e_done", "lin_e_finished": "lin_e_finished", "attn_m_polled": "attn_m_polled", "no_loader_attn_nokv": "no_loader_attn_nokv", "loader_lead": "loader_lead",
        "sparse_timer": "sparse_timer",
        "no_loader_no_units": "no_loader_no_units",
        "no_loader_bare_units": "no_loader_bare_units",
        "nanosleep": "nanosleep", "hint": "hint",
        "relaxed_poll": "relaxed_poll", "no_loader": "no_loader", "pagewait": "pagewait1", "no_mma": "no_mma", "no_wload": "no_wload",
        "no_units": "no_units", "warp_release": "warp_release",
        "moe_noload": "moe_noload", "quiet_signal": "quiet_signal", "walk_cycles": "walk_cycles", "walk_clock": "walk_clock", "walk_start": "walk_start", "no_loader_walk_cycles": "no_loader_walk_cycles", "no_aload_walk_cycles": "no_aload_walk_cycles", "no_wload_walk_cycles": "no_wload_walk_cycles", "epi_cycles": "epi_cycles", "moe_inflight2x": "moe_inflight2x",
        "moe_gu_pf": "moe_gu_pf", "moe_down_pf": "moe_down_pf", "moe_pf": "moe_pf",
        "no_loader_moe_pf": "no_loader_moe_pf",
        **{n: n for n in ("lin_i_entry", "lin_i_issued", "lin_i_landed", "lin_i_polled",
                          "lin_i_summed")},
        **{n: n for n in SETUP_MARKS}}


@contextmanager
def own_plan_cache(page_bytes: int) -> Iterator[None]:
    """Plans compiled under another page size go to a cache of their own: the shared plan
    cache's key does not see it, so a later default run would load a plan whose weight streams
    are cut in the probe's pages."""
    if page_bytes == codegen.PAGE_BYTES:
        yield
        return
    original = cache.compile_cached
    with tempfile.TemporaryDirectory() as root:
        cache.compile_cached = functools.partial(original, cache_root=Path(root))
        try:
            yield
        finally:
            cache.compile_cached = original


def linear_roles(tl) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    """Each task's op role, and which tasks are linear ones."""
    roles = np.asarray([role_of(o.name) for o in tl.plan.ops], dtype=object)[tl.op]
    return roles, tl.kind_names() == "linear"


def run(model: str, name: str, steps: int, page_bytes: int, max_pages: int, batch: int,
        plan_positions: int = 0) -> dict:
    from mpk.profile.run import profile_model

    patch = RUNS[name]
    with (include_dir(patch) as inc, probe_build(patch), tempfile.TemporaryDirectory() as out,
          own_plan_cache(page_bytes),
          page_config(page_bytes, max_pages)):
        res = profile_model(get_preset(model), steps=steps, batch=batch, out_dir=out, repeats=3,
                            measure_bandwidth=False, plan_positions=plan_positions,
                            extra_includes=(inc,))
    tl = res.timeline
    row = {"run": name, "batch": batch, "page_bytes": page_bytes,
           "plan_positions": plan_positions, "ms_per_token": res.timing["profiled_ms_per_token"],
           "phases": {r.role: {"phase": round(r.phase_us, 2),
                               **{k: round(v, 2) for k, v in r.parts_us.items()}}
                      for r in res.phases}}
    if name == "loader_lead":
        lead = (tl.ready_ns - tl.start_ns).astype(np.float64) / 1e3
        roles, lin = linear_roles(tl)
        row["loader_lead_us"] = {
            str(r): [round(float(np.percentile(lead[lin & (roles == r)], q)), 2)
                     for q in (10, 50, 90)] for r in sorted(set(roles[lin]))}
    if name == "walk_clock":
        raw = (tl.start_ns + tl.origin_ns).astype(np.uint64)
        cyc = (raw & np.uint64(0xFFFFFFFF)).astype(np.float64)
        ns = (raw >> np.uint64(32)).astype(np.float64)
        roles, lin = linear_roles(tl)
        row["walk_clock"] = {
            str(r): {"cycles": round(float(cyc[m].mean()), 1), "ns": round(float(ns[m].mean()), 1),
                     "mhz": round(float(cyc[m].sum() / max(ns[m].sum(), 1)) * 1e3, 1)}
            for r in sorted(set(roles[lin])) for m in [lin & (roles == r)]}
    if name.endswith("walk_cycles"):
        raw = (tl.start_ns + tl.origin_ns).astype(np.uint64)
        cyc = (raw & np.uint64(0xFFFFFFFF)).astype(np.float64)
        pages = (raw >> np.uint64(48)).astype(np.float64) - 1
        roles, lin = linear_roles(tl)
        row["walk_cycles"] = {
            str(r): {"cycles": round(float(cyc[m].mean()), 1), "pages": round(float(pages[m].mean()), 2),
                     "cycles_per_page": round(float(cyc[m].sum() / max(pages[m].sum(), 1)), 1)}
            for r in sorted(set(roles[lin])) for m in [lin & (roles == r)]}
    if name == "epi_cycles":
        raw = (tl.start_ns + tl.origin_ns).astype(np.uint64)
        parts = np.stack([((raw >> np.uint64(16 * i)) & np.uint64(0xFFFF)).astype(np.float64)
                          for i in range(4)], axis=1)
        roles, lin = linear_roles(tl)
        lin &= parts[:, :3].sum(axis=1) > 0
        row["epi_cycles"] = {
            str(r): dict(zip(("barrier", "sums", "stores", "finish"),
                             (round(float(x), 1) for x in parts[m].mean(axis=0))))
            for r in sorted(set(roles[lin])) for m in [lin & (roles == r)]}
    if name == "pagewait":
        waited = (tl.start_ns + tl.origin_ns - 1).astype(np.float64) / 1e3
        roles, lin = linear_roles(tl)
        row["page_wait_us"] = {str(r): round(float(waited[lin & (roles == r)].mean()), 3)
                               for r in sorted(set(roles[lin]))}
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", default="none,pagewait,no_mma,no_wload")
    p.add_argument("--all", action="store_true", help="every run (with --dry-run: every patch)")
    p.add_argument("--page-bytes", type=int, default=codegen.PAGE_BYTES)
    p.add_argument("--max-pages", type=int, default=codegen.MAX_PAGES)
    p.add_argument("--plan-positions", type=int, default=0,
                   help="compile for this many KV positions a row (a plan with KV splits)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    names = list(RUNS) if args.all else args.runs.split(",")
    if unknown := sorted(set(names) - set(RUNS)):
        p.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    if args.dry_run:
        for name in names:
            with include_dir(RUNS[name]) as inc, probe_build(RUNS[name]):
                print(f"{name}: {sorted(str(f.relative_to(inc)) for f in inc.rglob('*.cuh'))}")
        return 0
    rows = []
    for name in names:
        row = run(args.model, name, args.steps, args.page_bytes, args.max_pages, args.batch,
                  args.plan_positions)
        rows.append(row)
        print(f"{name}: {row['ms_per_token']:.3f} ms/token", flush=True)
        for role, parts in row["phases"].items():
            print(f"  {role:22s} " + " ".join(f"{k}={v}" for k, v in parts.items()))
        if "loader_lead_us" in row:
            print("  loader lead, RUN - last page issued (us, p10/p50/p90): "
                  + json.dumps(row["loader_lead_us"]))
        if "walk_clock" in row:
            print("  warp 0's walk, cycles / ns: " + json.dumps(row["walk_clock"]))
        if "epi_cycles" in row:
            print("  thread 0's last finish_shared (clock64): " + json.dumps(row["epi_cycles"]))
        if "walk_cycles" in row:
            print("  warp 0's walk (clock64): " + json.dumps(row["walk_cycles"]))
        if "page_wait_us" in row:
            print("  page wait per linear task (us): " + json.dumps(row["page_wait_us"]))
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
