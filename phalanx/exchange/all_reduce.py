"""`AllReduceExchange`: phalanx's default on a process group (Gloo, NCCL), one all-reduce per bucket.

The gradients are divided by the world size on their way into the bucket, so the sum the process
group computes is already the average; the step tag in the bucket's last slot rides along and is
checked when the bucket is delivered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..bucket.buckets import Bucket
from ..bucket.step_guard import StepGuard
from ..shm.reduce import kernel_serves, streams
from .base import BucketExchange
from .shm_copy_in import BucketCopyIn


class AllReduceExchange(BucketExchange):
    """phalanx's default on a process group: the gradients are divided by the world size while they
    are copied into the bucket, then one all-reduce (sum) carries them and the step tag after them."""

    def __init__(self, group, guard: StepGuard):
        super().__init__(guard)
        self.group = group
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM
        self._handles: dict[int, object] = {}
        self._checked_copies: dict[int, BucketCopyIn] = {}  # bucket index -> its copy-in that checks on the way

    def launch(self, bucket: Bucket) -> None:
        if bucket.sparse:
            self._check_local(bucket)
            self._launch_sparse(bucket, bucket.sparse_gradient())
            return
        copy_in = self._checking_copy_in(bucket)
        with self.timer("copy_in", bucket.index):
            if copy_in is None:
                bucket.fill_(self.scale)
            else:
                self._copy_in_checking(bucket, copy_in)
        if copy_in is None:
            self._check_local(bucket)
        self._fill_tag(bucket)
        self._handles[bucket.index] = self._start(bucket.storage)

    def _checking_copy_in(self, bucket: Bucket) -> BucketCopyIn | None:
        """Under the non-finite check, on the CPU: the shared-memory exchange's copy kernel for `bucket`, which
        says whether every element was finite as it copies (the same bits as fill_; no second pass over the
        bucket, which a sum is: ~3 ms a step on a 34 MB model). None where it cannot serve (gradients as bucket
        views, a dtype the kernel does not take): fill_ and a sum then."""
        if (self.check is None or bucket.as_view or bucket.storage.device.type != "cpu"
                or not kernel_serves(bucket.storage.dtype)):
            return None
        copy_in = self._checked_copies.get(bucket.index)
        if copy_in is None or copy_in.bucket is not bucket:  # (re)built buckets
            copy_in = BucketCopyIn.whole_gradients(bucket, streams(bucket.storage))
            self._checked_copies[bucket.index] = copy_in
        return copy_in

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
        # the process group's own call: dist.all_reduce's Python checks and logging wrappers cost ~12 us a
        # bucket on the host, which is what a small GPU step is made of (docs/benchmarks.md)
        return self.group.allreduce([storage], self._sum)

    def _wait(self, handle, what: str) -> None:
        self.guard.wait_work(handle, what)  # a timed wait in C++: no Python callback per bucket

    def _finish(self, bucket: Bucket, kind: str = "the gradient all-reduce") -> torch.Tensor | None:
        """Wait for the bucket's all-reduce and check its step tag; returns a sparse bucket's sum."""
        what = f"{kind} of bucket {bucket.index}"
        handle = self._handles.pop(bucket.index)
        if bucket.sparse:
            return self.guard.wait(handle, what)[0]  # a sparse sum is a new tensor, not written in place
        self._wait(handle, what)
        if self.guard.reads_back(bucket.storage.device):
            self._check_tag(bucket, bucket.tag_slot.item(), what)
        return None
