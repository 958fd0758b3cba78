"""The seam between the reducer and the transports: how one full bucket becomes its average.

The reducer decides *when* a bucket is ready and launches buckets in index order; an exchange
decides *how* the bucket's gradients are averaged and delivered into `param.grad`. Nothing else
crosses this seam. Here: the interface, the default all-reduce of the process group, and the
exchange that runs a user's comm hook. The shared-memory exchange is in shm_exchange.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from ..bucket.buckets import Bucket, GradBucket
from ..bucket.step_guard import StepGuard
from .phase_timer import PhaseTimer


class BucketExchange(ABC):
    """How a bucket of gradients becomes its average across ranks, delivered into each `param.grad`.

    Per synchronized backward the reducer calls `launch(bucket)` for every bucket, in index order,
    each as soon as its gradients are ready (the exchange starts and returns at once, so it overlaps
    the rest of backward); then at the end of backward `deliver(bucket, used)` for every bucket, in
    index order (the exchange waits, within the step guard's bounds, and writes the result).

    The exchange owns its buckets' storage (`allocate`: shared memory for the shared-memory
    exchange) and is told the plan each time it changes (`prepare`). It holds the step guard it was
    built with, so its waits are bounded and name the ranks that are missing.

    A sharded exchange (sharded_exchange.py) fits the same calls: `launch` reduce-scatters the bucket
    and `deliver` hands the chunk this rank owns to the optimizer; its all-gather of the updated
    parameters after the optimizer step works over the same bucket layout.
    """

    keeps_plan = False  # True: the bucket plan must not change once built (the one-time rebuild is skipped)

    def __init__(self, guard: StepGuard):
        self.guard = guard
        self.divisor = guard.world_size  # averaged over this many ranks (join may change it)
        self.timer = PhaseTimer()  # off unless a profiler (phalanx bench --profile) turns it on

    # -- storage and plan -------------------------------------------------------------------------

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Storage for a bucket: a zero-filled 1-D tensor. Collective for exchanges that share memory."""
        return torch.zeros(numel, dtype=dtype, device=device)

    def allocate_plan(self, sizes: list) -> list:
        """Storage for every bucket of a plan: `sizes` holds (numel, dtype, device) per bucket, None for a
        sparse one (no storage). An exchange may give more elements than asked, or views of shared buffers."""
        return [None if size is None else self.allocate(*size) for size in sizes]

    def release(self, storage: torch.Tensor) -> None:
        """`storage` (from allocate) is no longer a bucket's."""

    def prepare(self, buckets: list[Bucket]) -> None:
        """The buckets were (re)built: precompute what each one's exchange needs."""

    def buffers(self) -> list[torch.Tensor]:
        """Tensors this exchange holds besides the buckets' storage (for counting memory)."""
        return []

    # -- one backward ----------------------------------------------------------------------------

    @abstractmethod
    def launch(self, bucket: Bucket) -> None:
        """Start averaging `bucket`: its parameters' `.grad` hold this rank's gradients (None: zeros)."""

    @abstractmethod
    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        """Wait for `bucket`'s exchange and write the average into `.grad`. With `used` (per parameter
        index, the number of ranks where it got a gradient) a parameter unused everywhere is left alone."""

    @abstractmethod
    def discard(self, bucket: Bucket) -> None:
        """Finish a launched exchange whose result is not wanted (a backward that failed): the peers
        may still need this rank's part."""

    @abstractmethod
    def shadow(self, buckets: list[Bucket]) -> None:
        """join(): issue the collectives of one synchronized backward with zero gradients, as a rank that
        ran out of data, without touching `.grad`."""

    def settle(self, buckets: list[Bucket]) -> None:
        """Before this exchange is replaced: return once no peer can still read this rank's buckets."""

    def _write_back(self, bucket: Bucket, used: list[int] | None, sparse_sum: torch.Tensor | None) -> None:
        """The average into .grad: a dense bucket's buffer, or a sparse bucket's sum (a new tensor)."""
        if not bucket.sparse:
            with self.timer("copy_out", bucket.index):
                bucket.write_back(used)
        elif used is None or used[bucket.indices[0]]:
            bucket.params[0].grad = sparse_sum

    @property
    def scale(self) -> float | None:
        """What the gradients are multiplied by on the way into the bucket (None: nothing)."""
        return None if self.divisor == 1 else 1.0 / self.divisor


class AllReduceExchange(BucketExchange):
    """phalanx's default on a process group: the gradients are divided by the world size while they
    are copied into the bucket, then one all-reduce (sum) carries them and the step tag after them."""

    def __init__(self, group, guard: StepGuard):
        super().__init__(guard)
        self.group = group
        self._handles: dict[int, object] = {}

    def launch(self, bucket: Bucket) -> None:
        if bucket.sparse:
            self._launch_sparse(bucket, bucket.sparse_gradient())
            return
        with self.timer("copy_in", bucket.index):
            bucket.fill_(self.scale)
        bucket.tag_slot.fill_(self.guard.tag_for(bucket.storage.dtype))
        self._handles[bucket.index] = self._start(bucket.storage)

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        with self.timer("wait", bucket.index):
            result = self._finish(bucket)
        self._write_back(bucket, used, result)

    def discard(self, bucket: Bucket) -> None:
        self._finish(bucket)

    def shadow(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            self._launch_shadow(bucket)
        for bucket in buckets:
            self._finish(bucket, "the shadow all-reduce")

    def _launch_shadow(self, bucket: Bucket) -> None:
        if bucket.sparse:
            self._launch_sparse(bucket, bucket.sparse_gradient(zeros=True))
            return
        bucket.detach_gradient_views()  # the bucket itself carries the zeros: shared-memory peers read it there
        bucket.storage.zero_()
        self._handles[bucket.index] = self._start(bucket.storage)

    def _launch_sparse(self, bucket: Bucket, gradient: torch.Tensor) -> None:
        """A sparse gradient goes through the process group (Gloo sums sparse tensors), divided first, as
        torch DDP does; it carries no step tag."""
        scale = self.scale
        work = dist.all_reduce(gradient if scale is None else gradient * scale, group=self.group, async_op=True)
        self._handles[bucket.index] = work.get_future()

    def _start(self, storage: torch.Tensor):
        return dist.all_reduce(storage, group=self.group, async_op=True)

    def _wait(self, handle, what: str) -> None:
        self.guard.wait_work(handle, what)  # a timed wait in C++: no Python callback per bucket

    def _finish(self, bucket: Bucket, kind: str = "the gradient all-reduce") -> torch.Tensor | None:
        """Wait for the bucket's all-reduce and check its step tag; returns a sparse bucket's sum."""
        what = f"{kind} of bucket {bucket.index}"
        handle = self._handles.pop(bucket.index)
        if bucket.sparse:
            return self.guard.wait(handle, what)[0]  # a sparse sum is a new tensor, not written in place
        self._wait(handle, what)
        # The check reads the tag back: free on the CPU, a stream synchronization on a GPU.
        if bucket.storage.device.type == "cpu":
            self.guard.check_tag_sum(bucket.tag_slot.item(), bucket.storage.dtype, what)
        return None


class CommHookExchange(BucketExchange):
    """A comm hook with torch's contract: `hook(state, GradBucket) -> Future` whose value is the
    averaged buffer. torch's stock hooks and users' own run here; they do the averaging themselves."""

    def __init__(self, state, hook, guard: StepGuard):
        super().__init__(guard)
        self.state, self.hook = state, hook
        self._last = 0  # the index of the last bucket (GradBucket.is_last)
        self._futures: dict[int, torch.futures.Future] = {}

    def prepare(self, buckets: list[Bucket]) -> None:
        self._last = len(buckets) - 1

    def launch(self, bucket: Bucket) -> None:
        if not bucket.sparse:
            with self.timer("copy_in", bucket.index):
                bucket.fill_(None)
        with self.timer("reduce", bucket.index):  # what the hook does before it returns its future
            self._futures[bucket.index] = self.hook(self.state, GradBucket(bucket, bucket.index == self._last))

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        with self.timer("wait", bucket.index):
            result = self._collect(bucket, "the comm hook")
        self._write_back(bucket, used, result)

    def discard(self, bucket: Bucket) -> None:
        self._collect(bucket, "the comm hook")

    def shadow(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            facade = GradBucket(bucket, bucket.index == self._last)
            if bucket.sparse:
                facade.set_buffer(bucket.sparse_gradient(zeros=True))
            else:
                bucket.detach_gradient_views()
                bucket.storage.zero_()
            self._futures[bucket.index] = self.hook(self.state, facade)
        for bucket in buckets:
            self._collect(bucket, "the shadow comm hook")

    def _collect(self, bucket: Bucket, kind: str) -> torch.Tensor | None:
        """Wait for the hook's future; make sure its result is in the bucket's buffer (a sparse bucket's
        result is returned instead)."""
        value = self.guard.wait(self._futures.pop(bucket.index), f"{kind} of bucket {bucket.index}")
        result = value[0] if isinstance(value, (list, tuple)) else value
        if bucket.sparse:
            return result
        if result is not None and result.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(result[:bucket.numel] if result.numel() > bucket.numel else result)
        return None
