"""Tensor parallelism over the GPUs of one host: sharding, per-rank plans, the launcher (the
simulation of G ranks in one process, for tests, is mpk.testing.MultiRankCpuExecutor).

See docs/tensor-parallel.md. `launch.run_ranks` starts one process per rank and `group` gives a
rank's interpreter its all-reduce over a torch.distributed group; on CUDA the all-reduce runs in
the megakernel over peer memory (tasks/allreduce/sm90.cuh, backends/cuda/peers.py), which has
not run on GPUs yet.
"""

from mpk.parallel.plans import rank_plans
from mpk.parallel.tp import RankView, TensorParallel, shard_dim, unshard

__all__ = ["RankView", "TensorParallel", "rank_plans", "shard_dim", "unshard"]
