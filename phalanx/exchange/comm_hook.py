"""`CommHookExchange`: a user's comm hook (torch's contract) averages each bucket.

The hook receives a `GradBucket` (torch's view of a bucket) and returns a future whose value is the
averaged buffer; torch's stock hooks and users' own run here unchanged.
"""

from __future__ import annotations

import torch

from ..bucket.buckets import Bucket, GradBucket
from ..bucket.step_guard import StepGuard
from .base import BucketExchange


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
        self._check_local(bucket)
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
