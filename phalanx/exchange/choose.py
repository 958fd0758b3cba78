"""The one place that picks how buckets are averaged: a new transport plugs in here, not in the DDP front.

The answer depends on the user's comm hook (it does the averaging itself), on whether every rank of
the process group shares this host (shared memory, unless `PHALANX_SHM=0`), on the parameters (CPU,
floating point: what the shared-memory kernels take) and on the shard level (a reduce-scatter in
place of the all-reduce).
"""

from __future__ import annotations

import weakref

import torch

from ..bucket.step_guard import StepGuard
from ..shm import shm_communicator
from ..shm.reduce import DTYPE_CODES
from .all_reduce import AllReduceExchange
from .base import BucketExchange
from .comm_hook import CommHookExchange
from .sharded import ShardedExchange
from .shm import ShmExchange
from .shm_sharded import ShmShardedExchange

SHM_DTYPES = frozenset(dtype for dtype in DTYPE_CODES if dtype.is_floating_point)


def choose_exchange(group, guard: StepGuard, params: list[torch.Tensor], *, owner: object, shard: str = "none",
                    comm_hook: tuple | None = None) -> BucketExchange:
    """The exchange for `params` (the model's trainable parameters) on `group`.

    - `comm_hook` (state, hook), registered by the user: the hook's exchange, whatever else holds;
    - every rank on this host, CPU floating-point parameters, and `PHALANX_SHM` not 0: shared memory,
      reduce-scattered when `shard` is "optimizer" or "gradients";
    - otherwise the process group: an all-reduce, or a reduce-scatter when sharded.

    Collective unless `comm_hook` is given: the conditions are the same on every rank (DDP checked
    that every rank holds the same model), so either all ranks ask for a shared-memory communicator,
    which agrees on one answer, or none does. The communicator is closed when `owner` (the DDP model)
    is collected.
    """
    if comm_hook is not None:
        state, hook = comm_hook
        return CommHookExchange(state, hook, guard)
    if group.size() > 1 and all(p.device.type == "cpu" and p.dtype in SHM_DTYPES for p in params):
        comm = shm_communicator(group)
        if comm is not None:
            weakref.finalize(owner, comm.close)
            if shard != "none":
                return ShmShardedExchange(comm, guard, shard)
            return ShmExchange(comm, guard)
    if shard != "none":
        return ShardedExchange(group, guard, shard)
    return AllReduceExchange(group, guard)
