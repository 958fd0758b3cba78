"""The one place that picks how buckets are averaged: a new transport plugs in here, not in the DDP front.

The answer depends on the user's comm hook (it does the averaging itself), on the hosts the ranks of
the process group run on (one host: shared memory, unless `PHALANX_SHM=0`; several, each with the
same number of ranks, some more than one: shared memory inside each host and Gloo between them,
unless `PHALANX_XHOST=flat`), on the parameters (CPU, floating point: what the shared-memory kernels
take) and on the shard level (a reduce-scatter in place of the all-reduce).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .. import log
from ..bucket.step_guard import StepGuard
from ..errors import WorldConfigError, explain
from ..shm import shm_communicator
from ..shm.reduce import DTYPE_CODES
from .all_reduce import AllReduceExchange
from .base import BucketExchange
from .comm_hook import CommHookExchange
from .hier_sharded import HierShardedExchange
from .hierarchical import HierarchicalExchange
from .sharded import ShardedExchange
from .shm import ShmExchange
from .shm_sharded import ShmShardedExchange

SHM_DTYPES = frozenset(dtype for dtype in DTYPE_CODES if dtype.is_floating_point)


def choose_exchange(group, guard: StepGuard, params: list[torch.Tensor], *, owner: object, shard: str = "none",
                    comm_hook: tuple | None = None, hosts=None) -> BucketExchange:
    """The exchange for `params` (the model's trainable parameters) on `group`.

    - `comm_hook` (state, hook), registered by the user: the hook's exchange, whatever else holds;
    - CPU floating-point parameters and `PHALANX_SHM` not 0, and every rank on one host (`hosts`, a
      world.topology.HostGroups, says which host each rank is on; None: one host): shared memory,
      reduce-scattered when `shard` is "optimizer" or "gradients";
    - the same across hosts where the two-level exchange applies (`hosts.topology.hierarchical()`):
      shared memory inside each host, Gloo between hosts (hierarchical.py; hier_sharded.py when sharded);
    - otherwise the process group: an all-reduce, or a reduce-scatter when sharded.

    Collective unless `comm_hook` is given: the conditions are the same on every rank (DDP checked
    that every rank holds the same model, the topology was gathered), so either all ranks ask for a
    shared-memory communicator, which agrees on one answer, or none does. The communicator is closed
    when `owner` (the DDP model) is collected.
    """
    if comm_hook is not None:
        state, hook = comm_hook
        return CommHookExchange(state, hook, guard)
    topology = hosts.topology if hosts is not None else None
    key = topology.key if topology is not None else None
    cpu_floats = all(p.device.type == "cpu" and p.dtype in SHM_DTYPES for p in params)
    if topology is not None and topology.spans_hosts:
        _check_forced(topology, guard)
        if cpu_floats and hosts.whole_world and topology.hierarchical():  # the host groups are made from every rank
            exchange = _hierarchical(hosts, group, guard, owner, shard)
            if exchange is not None:
                return exchange
    elif group.size() > 1 and cpu_floats:
        comm = shm_communicator(group, host=key)
        if comm is not None:
            exchange = ShmShardedExchange(comm, guard, shard) if shard != "none" else ShmExchange(comm, guard)
            return _closed_with(exchange, owner, comm)
    if shard != "none":
        return ShardedExchange(group, guard, shard)
    return AllReduceExchange(group, guard)


def _check_forced(topology, guard: StepGuard) -> None:
    """PHALANX_XHOST=hier where the two-level exchange cannot work is the user's error (alike on every rank)."""
    if topology.xhost == "hier" and not (topology.uniform and max(map(len, topology.hosts)) > 1):
        raise WorldConfigError(explain(
            "PHALANX_XHOST=hier needs the same number of ranks on every host, more than one",
            rank=dist.get_rank(guard.group), seen=f"ranks per host {[len(r) for r in topology.hosts]}",
            expected="e.g. 2 hosts x 2 ranks",
            fix="Start as many ranks on every node (--nproc-per-node), or unset PHALANX_XHOST (flat here)."))


def _hierarchical(hosts, group, guard: StepGuard, owner: object, shard: str) -> BucketExchange | None:
    """The two-level exchange, when every host's ranks could share memory; else None (flat) on every rank."""
    groups = hosts.build()
    comm = shm_communicator(groups.host, host=hosts.topology.key)
    # Hosts answer for themselves: agree on the whole world, or one host would wait in Gloo for the other.
    able = torch.tensor([0 if comm is None else 1], dtype=torch.int32)
    dist.all_reduce(able, op=dist.ReduceOp.MIN, group=group)
    if not able.item():
        if comm is not None:
            comm.close()
        log.logger.info("the exchange across hosts is flat: shared memory is off on some host")
        return None
    if shard != "none":
        return _closed_with(HierShardedExchange(comm, groups.network, group, guard, shard, hosts.topology.hosts),
                            owner, comm)
    # PHALANX_XHOST=hier: every bucket in two levels; unset: each bucket by its size (hierarchical.two_level).
    return _closed_with(HierarchicalExchange(comm, groups.network, group, guard,
                                             per_bucket=hosts.topology.xhost != "hier"), owner, comm)


def _closed_with(exchange: BucketExchange, owner: object, comm) -> BucketExchange:
    """`exchange`, whose communicator is closed when `owner` (the DDP model) is collected, or sooner by
    `exchange.close()` (the engine rebuilt on a new process group)."""
    exchange.closing = weakref.finalize(owner, comm.close)
    return exchange
