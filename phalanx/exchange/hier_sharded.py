"""The sharded exchange across hosts: reduce-scatter and all-gather in two levels, like hierarchical.py.

Ownership is the flat one (bucket/shard_plan.py: rank r owns chunk r of P), so optimizer state and
checkpoints do not change. Local rank j of a host handles the chunks of the ranks with local index j
on every host (N of them):
- reduce-scatter, in backward: each rank posts its scaled bucket in shared memory; local rank j sums
  those N chunks over its host's copies into a scratch row of N chunks (N reduce-scatter calls, one
  per chunk); then a Gloo reduce-scatter of the row across hosts (local index j's group) leaves this
  rank's own chunk, summed over every rank;
- all-gather, after the step: a Gloo all-gather of this rank's updated chunk across hosts fills the
  row with the N chunks of local index j; then each rank posts its row and copies every other row's
  chunks from the host's peers into its staging view of the whole bucket.
Each host's link carries (N-1)/N * S each way per half, as the hierarchical all-reduce does. The
scratch rows (S/L per rank, in shared memory) are the price.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ..bucket.buckets import Bucket
from ..bucket.shard_plan import chunk_size
from ..bucket.step_guard import StepGuard
from ..diagnose import recorder
from ..shm import ShmCommunicator
from .sharded import ShardedExchange, all_gather, reduce_scatter


class HierShardedExchange(ShardedExchange):
    """ShardedExchange whose collectives run in shared memory inside each host and on `network` (this
    local index on every host) between hosts; `hosts` lists the group ranks of each host."""

    defers_gathers = False  # the all-gather's host phase is a collective in shared memory: done within the step

    def __init__(self, comm: ShmCommunicator, network, group, guard: StepGuard, mode: str,
                 hosts: tuple[tuple[int, ...], ...]):
        super().__init__(group, guard, mode)
        self.comm = comm
        self.network = network
        group_rank = {dist.get_global_rank(group, g): g for g in range(self.world_size)}
        by_host = {g: h for h, members in enumerate(hosts) for g in members}
        # network[k]: the group rank at position k of the network group; rows[j][k]: the same for local index j
        self.network_ranks = [group_rank[r] for r in dist.get_process_group_ranks(network)]
        order = [by_host[g] for g in self.network_ranks]  # the network group's order of hosts
        self.rows = [[hosts[h][j] for h in order] for j in range(len(hosts[0]))]
        self.position = self.network_ranks.index(self.rank)
        self._scratch: list[torch.Tensor] = []

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.alloc(numel, dtype)

    def release(self, storage: torch.Tensor) -> None:
        self.comm.release(storage)

    def allocate_plan(self, sizes: list) -> list:
        storage = super().allocate_plan(sizes)
        hosts = len(self.network_ranks)
        self._scratch = [self.comm.alloc(hosts * chunk_size(numel - 1, self.world_size), dtype)
                         for numel, dtype, _ in sizes]
        return storage

    def buffers(self) -> list[torch.Tensor]:
        return super().buffers() + list(self._scratch)

    def settle(self, buckets: list[Bucket]) -> None:
        for storage in [b.storage for b in buckets] + self._staging_bases + self._scratch:
            self.comm.claim(storage)

    def _claim(self, storage: torch.Tensor) -> None:
        self.comm.claim(storage)

    def _await(self, ticket: int, what: str) -> None:
        self.guard.wait_until(partial(self.comm.posted_ready, ticket), what)

    # -- reduce-scatter ------------------------------------------------------------------------------

    def _start_reduce(self, bucket: Bucket, target: torch.Tensor) -> None:
        index, shard = bucket.index, self.shards[bucket.index]
        span, row, chunk = bucket.storage[:shard.padded], self._scratch[index], shard.chunk
        what = f"the host phase of the gradient reduce-scatter of bucket {index}"
        self.comm.claim(row)
        ticket = self.comm.post(span)
        entry = recorder.begin(recorder.HOST_PHASE, index, shard.padded, span.dtype)
        with self.timer("reduce", index):
            self._await(ticket, what)
            for k, owner in enumerate(self.rows[self.comm.rank]):
                self.comm.reduce_scatter(span, ticket, owner * chunk, row[k * chunk:(k + 1) * chunk])
        recorder.done(entry)
        self._reduced[index] = target
        self._reduces[index] = reduce_scatter(target, row, group=self.network, async_op=True)

    def _finish_reduce(self, index: int) -> None:
        shard = self.shards[index]
        entry = recorder.begin(recorder.NETWORK_PHASE, index, shard.padded, self.buckets[index].storage.dtype)
        self._wait_reduce(index, f"the network phase of the gradient reduce-scatter of bucket {index}")
        recorder.done(entry)

    # -- all-gather ----------------------------------------------------------------------------------

    def _start_gather(self, index: int, staging: torch.Tensor, own: torch.Tensor) -> None:
        row = self._scratch[index]
        self.comm.claim(row)  # no peer still copies from this row
        self._gathers[index] = all_gather(row, own, group=self.network, async_op=True)

    @torch.no_grad()
    def _finish_gather(self, index: int) -> None:
        shard, row, staging = self.shards[index], self._scratch[index], self.staging[index]
        what = f"the parameter all-gather of bucket {index}"
        entry = recorder.begin(recorder.NETWORK_PHASE, index, shard.padded, staging.dtype)
        with self.timer("wait", index):
            self.guard.wait_work(self._gathers.pop(index), f"the network phase of {what}")
        recorder.done(entry)
        ticket = self.comm.post(row)
        chunk = shard.chunk
        pieces = [(j, k * chunk, staging[owner * chunk:(owner + 1) * chunk])
                  for j, owners in enumerate(self.rows) for k, owner in enumerate(owners) if owner != self.rank]
        entry = recorder.begin(recorder.HOST_PHASE, index, shard.padded, staging.dtype)
        with self.timer("copy_out", index):
            self._await(ticket, f"the host phase of {what}")
            self.comm.fetch_chunks(row, ticket, pieces)
            torch._foreach_copy_(self.buckets[index].params, self._gather_views[index])
        recorder.done(entry)
