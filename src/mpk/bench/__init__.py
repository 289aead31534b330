"""Benchmarking MPK against the torch.compile (gpt-fast style) baseline on the same GPU."""

from mpk.bench.baseline import DecodeLoop, StaticDecoder, compile_step
from mpk.bench.runner import bench_prompt, format_table, run_bench, weight_bytes_per_token
from mpk.bench.timing import floor_ms, percent_of_floor, read_bandwidth_probe, time_decode

__all__ = ["DecodeLoop", "StaticDecoder", "bench_prompt", "compile_step", "floor_ms",
           "format_table", "percent_of_floor", "read_bandwidth_probe", "run_bench",
           "time_decode", "weight_bytes_per_token"]
