"""The exchange across hosts in two levels: shared memory inside each host, Gloo between hosts.

For a bucket of S bytes on N hosts of L ranks each:
1. host phase: every local rank posts its scaled bucket in its shared-memory slot; local rank j sums
   chunk j of every slot (a reduce-scatter, in local rank order) into its own slot;
2. network phase: local rank j all-reduces that chunk, asynchronously, with local rank j of every
   other host (one Gloo group per local index: L flows in parallel, 2(N-1)/N * S/L bytes each);
3. host phase again: once its chunk is final, each rank posts it and copies the other chunks from
   their owners' slots, then writes the average into `.grad`.
Each host's link carries 2(N-1)/N * S per step where a flat ring over all N*L ranks carries
2(NL-1)/NL * S. Buckets pipeline: bucket b's network phase runs while autograd computes bucket b+1
and it is reduce-scattered. Every rank gets the same bits (same sums, same order; Gloo's ring
copies each reduced chunk). The recorder names the phase a rank waits in (host or network).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ..bucket.buckets import Bucket
from ..bucket.step_guard import StepGuard
from ..diagnose import recorder
from ..shm import ShmCommunicator
from .all_reduce import AllReduceExchange

# Buckets the hierarchical exchange plans when the user set no bucket_cap_mb. Measured (gpt, 2 hosts x 2 ranks,
# 300 Mbit/s links, one run each under load 7-11): step / torch DDP's 0.65 with 4 MB, 0.79 with 2 MB, 0.88 with 25 MB.
NETWORK_BUCKET_BYTES = 4 * 2**20


class HierarchicalExchange(AllReduceExchange):
    """Buckets averaged over every rank of every host: shared memory (`comm`, this host's ranks) around
    an all-reduce on `network` (this local index on every host). `group` is the whole world: a sparse
    bucket goes through its plain all-reduce."""

    def __init__(self, comm: ShmCommunicator, network, group, guard: StepGuard):
        super().__init__(group, guard)
        self.comm = comm
        self.network = network
        self.hosts = dist.get_world_size(network)
        self._plans: dict[int, tuple] = {}  # bucket index -> (own lo, own hi, fetched pieces)
        self._networks: dict[int, object] = {}  # bucket index -> the Gloo work of its network phase

    # -- storage and plan -------------------------------------------------------------------------

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.alloc(numel, dtype)

    def release(self, storage: torch.Tensor) -> None:
        self.comm.release(storage)

    def bucket_caps(self, cap_bytes: int, first_cap_bytes: int) -> tuple[int, int]:
        # The network phase of a bucket starts once it is full: smaller buckets start it earlier in backward.
        return min(cap_bytes, NETWORK_BUCKET_BYTES), first_cap_bytes

    def prepare(self, buckets: list[Bucket]) -> None:
        self._plans = {b.index: self._plan(b) for b in buckets if not b.sparse}

    def _plan(self, bucket: Bucket) -> tuple:
        """This rank's chunk of the bucket (gradients and step tag), and the others' chunks to fetch."""
        span = _span(bucket)
        bounds = self.comm.chunk_bounds(span.numel(), span.element_size())
        me = self.comm.rank
        fetched = [(owner, bounds[owner], span[bounds[owner]:bounds[owner + 1]])
                   for owner in range(len(bounds) - 1) if owner != me and bounds[owner + 1] > bounds[owner]]
        return bounds[me], bounds[me + 1], fetched

    def settle(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:  # peers may still fetch from our slots
            if not bucket.sparse:
                self.comm.claim(bucket.storage)

    # -- the three phases -------------------------------------------------------------------------

    def _host_reduce(self, bucket: Bucket, what: str) -> None:
        """Post this rank's bucket, reduce-scatter this host's copies, start the network phase of our chunk."""
        span, (lo, hi, _) = _span(bucket), self._plans[bucket.index]
        ticket = self.comm.post(span)
        entry = recorder.begin(recorder.HOST_PHASE, bucket.index, span.numel(), span.dtype)
        with self.timer("reduce", bucket.index):
            self.guard.wait_until(partial(self.comm.posted_ready, ticket), f"the host phase of {what}")
            self.comm.reduce_scatter(span, ticket, lo, span[lo:hi])
        recorder.done(entry)
        if hi > lo:  # the same on every host: the chunk of local index j has one size everywhere
            self._networks[bucket.index] = dist.all_reduce(span[lo:hi], group=self.network, async_op=True)

    def _host_gather(self, bucket: Bucket, what: str) -> None:
        """Wait for our chunk's network phase, publish it, and copy the other chunks from their owners."""
        span, (_, _, fetched) = _span(bucket), self._plans[bucket.index]
        work = self._networks.pop(bucket.index, None)
        if work is not None:
            entry = recorder.begin(recorder.NETWORK_PHASE, bucket.index, span.numel(), span.dtype)
            with self.timer("wait", bucket.index):
                self.guard.wait_work(work, f"the network phase of {what}")
            recorder.done(entry)
        # Posting again rewrites this rank's stamp: a peer still in its reduce-scatter checks it there.
        self.comm.claim(bucket.storage)
        ticket = self.comm.post(span)
        entry = recorder.begin(recorder.HOST_PHASE, bucket.index, span.numel(), span.dtype)
        with self.timer("copy_out", bucket.index):
            self.guard.wait_until(partial(self.comm.posted_ready, ticket), f"the host phase of {what}")
            self.comm.fetch_chunks(span, ticket, fetched)
        recorder.done(entry)

    # -- one backward ----------------------------------------------------------------------------

    def launch(self, bucket: Bucket) -> None:
        if bucket.sparse:
            super().launch(bucket)
            return
        with self.timer("wait", bucket.index):
            self.comm.claim(bucket.storage)  # no peer still fetches from the last step's copy
        with self.timer("copy_in", bucket.index):
            bucket.fill_(self.scale)
        bucket.tag_slot.fill_(self.guard.tag_for(bucket.storage.dtype))
        self._host_reduce(bucket, f"the gradient exchange of bucket {bucket.index}")

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        if bucket.sparse:
            super().deliver(bucket, used)
            return
        what = f"the gradient exchange of bucket {bucket.index}"
        self._host_gather(bucket, what)
        if self.guard.enabled:
            self.guard.check_tag_sum(bucket.tag_slot.item(), bucket.storage.dtype, what)
        self._write_back(bucket, used, None)

    def discard(self, bucket: Bucket) -> None:
        if bucket.sparse:
            super().discard(bucket)
            return
        self._host_gather(bucket, f"the gradient exchange of bucket {bucket.index}")  # the peers need our chunk

    def shadow(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            if bucket.sparse:
                self._launch_shadow(bucket)
                continue
            bucket.detach_gradient_views()
            self.comm.claim(bucket.storage)
            bucket.storage.zero_()
            self._host_reduce(bucket, f"the shadow exchange of bucket {bucket.index}")
        for bucket in buckets:
            if bucket.sparse:
                self._finish(bucket, "the shadow all-reduce")
            else:
                self._host_gather(bucket, f"the shadow exchange of bucket {bucket.index}")


def _span(bucket: Bucket) -> torch.Tensor:
    """What is summed: the bucket's gradients and its step tag (its storage may be longer)."""
    return bucket.storage[:bucket.numel + 1]
