"""The sharded exchange: a reduce-scatter per bucket in backward, an all-gather of parameters after the step.

Each rank owns one chunk of every bucket (bucket/shard_plan.py). In backward a full bucket is
reduce-scattered, so each rank receives only the average of the chunk it owns, as soon as the
bucket is complete; after the optimizer has updated the owned chunks, `gather_parameters()` sends
each rank's chunk to the others. The same bytes as an all-reduce move, in the same two halves.

Two memory modes:
- "optimizer" (ZeRO-1): the bucket is the gradients' storage (`.grad` views it), reduce-scattered in
  place; the owned chunk of `.grad` holds the average, the rest this rank's own scaled gradient.
- "gradients" (ZeRO-2): buckets are views into a few reusable staging buffers; `.grad` is dropped
  as soon as it is copied in, and each rank keeps only its averaged chunk (`owned`).
In both, the all-gather goes through the staging buffers, in forward order (the first layers' bucket
first), and each bucket's wait can be deferred to the forward that needs it (`wait_gathered`).

Here the process group's collectives carry the bytes; shm_sharded.py does the same in
shared memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..bucket.buckets import Bucket
from ..bucket.shard_levels import GRADIENTS, OPTIMIZER, unsupported_with_sharding
from ..bucket.shard_plan import BucketShard, chunk_size, cut_bucket
from ..bucket.step_guard import StepGuard
from ..diagnose import recorder
from ..errors import ShardingError, explain
from .base import BucketExchange

# torch 2.13 renamed the flat collectives (`reduce_scatter_tensor` -> `reduce_scatter_single`,
# `all_gather_into_tensor` -> `all_gather_single`) and deprecated the old names; earlier releases have
# only the old ones. Every flat reduce-scatter and all-gather in phalanx goes through these two.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

STAGING_BUFFERS = 2  # per dtype and device: two buckets in flight, the rest of the gradients freed


class ShardedExchange(BucketExchange):
    """Reduce-scatter gradients, all-gather parameters (see the module docstring)."""

    keeps_plan = True  # optimizer state is laid out on the buckets: they are not rebuilt
    defers_gathers = True  # a bucket's parameter all-gather may be waited for by the forward that needs it

    def __init__(self, group, guard: StepGuard, mode: str):
        super().__init__(guard)
        self.group = group
        self.mode = mode
        self.rank, self.world_size = dist.get_group_rank(group, dist.get_rank()), group.size()
        self.shards: list[BucketShard] = []
        self.owned: list[torch.Tensor | None] = []  # "gradients": each bucket's averaged chunk
        self.staging: list[torch.Tensor] = []  # per bucket: its view of a staging buffer
        self._staging_bases: list[torch.Tensor] = []
        self._slot_of: list[tuple] = []  # per bucket: which staging buffer it uses
        self._slot_user: dict[tuple, int] = {}  # staging buffer -> bucket index using it now
        self._reduces: dict[int, object] = {}  # bucket index -> handle of its reduce-scatter
        self._reduced: dict[int, torch.Tensor] = {}  # bucket index -> where its averaged chunk landed
        self._gathers: dict[int, object] = {}  # bucket index -> handle of its parameter all-gather
        self._gather_entries: dict[int, int] = {}  # bucket index -> its all-gather's entry in the record
        self._gather_views: list[list[torch.Tensor]] = []
        self.buckets: list[Bucket] = []

    # -- storage and plan -------------------------------------------------------------------------

    def padded(self, storage_numel: int) -> int:
        """Storage elements for a bucket whose gradients and step tag take `storage_numel`."""
        return chunk_size(storage_numel - 1, self.world_size) * self.world_size

    def allocate_plan(self, sizes: list) -> list:
        self._slot_of, self._staging_bases, self._slot_user = [], [], {}
        largest: dict[tuple, int] = {}
        counts: dict[tuple, int] = {}
        for size in sizes:
            if size is None:
                raise ShardingError(explain(
                    "sharded DistributedDataParallel cannot shard sparse gradients", rank=self.rank,
                    seen="an embedding with sparse=True", expected="dense gradients",
                    fix="Use sparse=False in the embedding, or shard='none'."))
            numel, dtype, device = size
            key = (dtype, device)
            slot = (dtype, device, counts.get(key, 0) % STAGING_BUFFERS)
            counts[key] = counts.get(key, 0) + 1
            self._slot_of.append(slot)
            largest[slot] = max(largest.get(slot, 0), self.staging_numel(self.padded(numel)))
        bases = {slot: self.allocate(numel, slot[0], slot[1]) for slot, numel in largest.items()}
        self._staging_bases = list(bases.values())
        self.staging = [bases[slot][:self.staging_numel(self.padded(size[0]))]
                        for slot, size in zip(self._slot_of, sizes)]
        if self.mode == GRADIENTS:
            return list(self.staging)
        return [self.allocate(self.padded(numel), dtype, device) for numel, dtype, device in sizes]

    def staging_numel(self, padded: int) -> int:
        """Elements of a bucket's staging view: the all-gather's output, a whole bucket here."""
        return padded

    def own_offset(self, shard: BucketShard) -> int:
        """Where this rank's chunk lies in the bucket's staging view."""
        return shard.start

    def prepare(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self.shards = [cut_bucket(b, self.rank, self.world_size) for b in buckets]
        if self.mode == GRADIENTS:
            self.owned = [torch.zeros(s.chunk, dtype=b.storage.dtype, device=b.storage.device)
                          for s, b in zip(self.shards, buckets)]
        self._plan_gathers()

    def _plan_gathers(self) -> None:
        """Each bucket's parameters as views of its staging buffer, where the all-gather leaves them."""
        self._gather_views = [[piece.view(p.shape) for piece, p in zip(view[:b.numel].split(
            [p.numel() for p in b.params]), b.params)] for view, b in zip(self.staging, self.buckets)]

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor this exchange holds (for counting memory)."""
        held = list(self._staging_bases) + [t for t in self.owned if t is not None]
        if self.mode == OPTIMIZER:
            held += [b.storage for b in self.buckets]
        return held

    # -- one backward: reduce-scatter -------------------------------------------------------------

    def launch(self, bucket: Bucket) -> None:
        self._free_staging_for(bucket.index)
        self._claim(bucket.storage)
        with self.timer("copy_in", bucket.index):
            bucket.fill_(self.scale)
            if self.mode == GRADIENTS:  # copied: the full gradients are not kept
                for p in bucket.params:
                    p.grad = None
        self._check_local(bucket)
        bucket.tag_slot.fill_(self.guard.tag_for(bucket.storage.dtype))
        self._start_reduce(bucket, self._reduce_target(bucket.index))

    def _free_staging_for(self, index: int) -> None:
        """Before bucket `index` writes its staging buffer, the bucket that used it last finishes with it."""
        slot = self._slot_of[index]
        previous = self._slot_user.get(slot)
        if previous is not None and previous != index:
            if previous in self._gathers:
                self._complete_gather(previous)
            if previous in self._reduces:
                self._finish_reduce(previous)
        self._slot_user[slot] = index

    def _reduce_target(self, index: int) -> torch.Tensor:
        """Where this rank's averaged chunk of bucket `index` goes: in place ("optimizer"), the owned buffer
        (gradients mode, nothing accumulated), else a scratch chunk added to what is there."""
        shard = self.shards[index]
        if self.mode == OPTIMIZER:
            return self.buckets[index].storage[shard.start:shard.start + shard.chunk]
        if all(piece.tensor.grad is None for piece in shard.pieces):
            return self.owned[index]
        return torch.empty_like(self.owned[index])  # rare: a chunk of its own, as buckets overlap in flight

    def _claim(self, storage: torch.Tensor) -> None:
        """Before this rank rewrites `storage`: no peer may still read it (shared memory only)."""

    def _start_reduce(self, bucket: Bucket, target: torch.Tensor) -> None:
        shard = self.shards[bucket.index]
        self._reduced[bucket.index] = target
        self._reduces[bucket.index] = reduce_scatter(target, bucket.storage[:shard.padded],
                                                      group=self.group, async_op=True)

    def _finish_reduce(self, index: int) -> None:
        self._wait_reduce(index, f"the gradient reduce-scatter of bucket {index}")

    def _wait_reduce(self, index: int, what: str) -> None:
        with self.timer("wait", index):
            self.guard.wait_work(self._reduces.pop(index), what, aside=True)  # Gloo's own wait ignores timeouts

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        index = bucket.index
        if index in self._reduces:
            self._finish_reduce(index)
        target = self._reduced.pop(index)
        shard = self.shards[index]
        tag_at = bucket.numel - shard.start
        if 0 <= tag_at < shard.chunk and self.guard.reads_back(bucket.storage.device):  # this rank holds the tag
            self.guard.check_tag_sum(target[tag_at].item(), bucket.storage.dtype,
                                     f"the gradient reduce-scatter of bucket {index}")
        owned = target if self.mode == OPTIMIZER else self.owned[index]
        if target is not owned:  # gradients accumulated over steps (no zero_grad): add
            owned.add_(target)
        for piece in shard.pieces:
            if used is not None and not used[piece.index]:
                continue  # no rank gave it a gradient: like .grad, it stays as it was
            grad = owned[piece.offset:piece.offset + piece.numel].view(piece.tensor.shape)
            if piece.tensor.grad is None or piece.tensor.grad.data_ptr() != grad.data_ptr():
                piece.tensor.grad = grad

    def discard(self, bucket: Bucket) -> None:
        if bucket.index in self._reduces:
            self._finish_reduce(bucket.index)
        self._reduced.pop(bucket.index, None)

    def shadow(self, buckets: list[Bucket]) -> None:
        raise unsupported_with_sharding("join()", self.mode, "Give every rank the same number of batches "
                                        "(phalanx.DistributedSampler does), or use shard='none'.")

    # -- after the optimizer step: all-gather -----------------------------------------------------

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Send this rank's updated chunks to the others; each bucket is complete after wait_gathered()."""
        self.wait_gathered()
        for index in reversed(range(len(self.buckets))):  # forward order: the first layers' bucket first
            self._free_staging_for(index)
            shard, staging = self.shards[index], self.staging[index]
            self._claim(staging)
            own = staging[self.own_offset(shard):self.own_offset(shard) + shard.chunk]
            if shard.pieces:
                torch._foreach_copy_([own[p.offset:p.offset + p.numel] for p in shard.pieces],
                                     [p.tensor.view(-1) for p in shard.pieces])
            self._gather_entries[index] = recorder.begin(recorder.ALL_GATHER, index, shard.padded, staging.dtype)
            self._start_gather(index, staging, own)
        if not self.defers_gathers:
            self.wait_gathered()

    def _start_gather(self, index: int, staging: torch.Tensor, own: torch.Tensor) -> None:
        self._gathers[index] = all_gather(staging, own, group=self.group, async_op=True)

    @torch.no_grad()
    def _finish_gather(self, index: int) -> None:
        with self.timer("wait", index):
            self.guard.wait_work(self._gathers.pop(index), f"the parameter all-gather of bucket {index}")
        with self.timer("copy_out", index):
            torch._foreach_copy_(self.buckets[index].params, self._gather_views[index])

    def wait_gathered(self, indices=None) -> None:
        """The parameters of these buckets (None: all) hold every rank's update."""
        for index in list(self._gathers) if indices is None else indices:
            if index in self._gathers:
                self._complete_gather(index)

    def _complete_gather(self, index: int) -> None:
        self._finish_gather(index)
        recorder.done(self._gather_entries.pop(index, -1))

    def zero_owned_grads(self, set_to_none: bool) -> None:
        for shard in self.shards:
            for piece in shard.pieces:
                if piece.tensor.grad is not None:
                    if set_to_none:
                        piece.tensor.grad = None
                    else:
                        piece.tensor.grad.zero_()

    @property
    def gathering(self) -> bool:
        return bool(self._gathers)

