"""The sharded exchange in shared memory: a true reduce-scatter, and an all-gather that is a copy.

Each rank posts its scaled bucket where it lies (its slot of the bucket's shared allocation), then
sums only its own chunk, reading that chunk of every peer's slot once, in rank order (the same bits
as the unsharded shared-memory exchange). After the step each rank posts its updated chunk in a
staging buffer (one chunk per bucket in flight) and copies the others' chunks straight from their
slots into its parameters.
Gloo's reduce-scatter costs about as much as its all-reduce; here it moves half the bytes.
"""

from __future__ import annotations

from functools import partial

import torch

from ..bucket.buckets import Bucket
from ..bucket.shard_levels import GRADIENTS
from ..bucket.shard_plan import BucketShard
from ..bucket.step_guard import StepGuard
from ..shm import ShmCommunicator
from .sharded import ShardedExchange


class ShmShardedExchange(ShardedExchange):
    """ShardedExchange over a ShmCommunicator that allocated its buckets and staging buffers."""

    defers_gathers = False  # copies on this host's cores: nothing to overlap, so done within the step

    def __init__(self, comm: ShmCommunicator, guard: StepGuard, mode: str):
        super().__init__(comm.group, guard, mode)
        self.comm = comm
        self._fetches: list[list[tuple[int, int, torch.Tensor]]] = []

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.alloc(numel, dtype)

    def release(self, storage: torch.Tensor) -> None:
        self.comm.release(storage)

    def staging_numel(self, padded: int) -> int:
        # Peers copy a rank's chunk straight from its slot: the all-gather stages one chunk, unless the
        # staging buffers also carry the reduce-scatter's whole buckets ("gradients").
        return padded if self.mode == GRADIENTS else padded // self.world_size

    def own_offset(self, shard: BucketShard) -> int:
        return shard.start if self.mode == GRADIENTS else 0

    def _plan_gathers(self) -> None:
        self._fetches = [_fetch_plan(bucket, shard, whole=self.mode == GRADIENTS)
                         for bucket, shard in zip(self.buckets, self.shards)]

    def settle(self, buckets: list[Bucket]) -> None:
        for storage in [b.storage for b in buckets] + self._staging_bases:
            self.comm.claim(storage)

    def _claim(self, storage: torch.Tensor) -> None:
        self.comm.claim(storage)

    def _await(self, ticket: int, what: str, index: int) -> None:
        with self.timer("wait", index):
            self.guard.wait_until(partial(self.comm.posted_ready, ticket), what)

    # -- reduce-scatter ------------------------------------------------------------------------------

    def _start_reduce(self, bucket: Bucket, target: torch.Tensor) -> None:
        self._reduced[bucket.index] = target
        self._reduces[bucket.index] = self.comm.post(bucket.storage[:self.shards[bucket.index].padded])

    def _finish_reduce(self, index: int) -> None:
        shard, storage = self.shards[index], self.buckets[index].storage
        ticket = self._reduces.pop(index)
        self._await(ticket, f"the gradient reduce-scatter of bucket {index}", index)
        with self.timer("reduce", index):
            self.comm.reduce_scatter(storage[:shard.padded], ticket, shard.start, self._reduced[index])

    # -- all-gather ----------------------------------------------------------------------------------

    def _start_gather(self, index: int, staging: torch.Tensor, own: torch.Tensor) -> None:
        self._gathers[index] = self.comm.post(staging)

    @torch.no_grad()
    def _finish_gather(self, index: int) -> None:
        ticket = self._gathers.pop(index)
        self._await(ticket, f"the parameter all-gather of bucket {index}", index)
        with self.timer("copy_out", index):
            self.comm.fetch_chunks(self.staging[index], ticket, self._fetches[index])


def _fetch_plan(bucket: Bucket, shard: BucketShard, whole: bool) -> list[tuple[int, int, torch.Tensor]]:
    """(owner, start in the owner's staging, the parameter's elements there) for every part of the bucket's
    parameters in another rank's chunk: fetch_chunks() copies them straight into the parameters. The
    staging holds the whole bucket (`whole`) or only its owner's chunk."""
    plan = []
    for param, offset in zip(bucket.params, bucket.offsets):
        flat = param.detach().view(-1)
        for owner in range(shard.owner_of(offset), shard.owner_of(offset + param.numel() - 1) + 1):
            if owner == shard.rank:
                continue
            lo, hi = max(offset, owner * shard.chunk), min(offset + param.numel(), (owner + 1) * shard.chunk)
            plan.append((owner, lo if whole else lo - owner * shard.chunk, flat[lo - offset:hi - offset]))
    return plan
