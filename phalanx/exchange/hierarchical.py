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

Per bucket: a small bucket costs the shared-memory phases' fixed latency for few bytes saved, so each
bucket whose flat all-reduce over the whole world is predicted cheaper (`two_level`, the alpha-beta
formulas below, which tools/cost_model.py uses too) takes that path instead. The choice depends only on
the bucket's size, the topology and fixed constants: the same on every rank. `PHALANX_XHOST=hier` sends
every bucket through the two levels.
"""

from __future__ import annotations

from dataclasses import dataclass
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


# -- the cost of each path (alpha + bytes / beta per phase; docs/hosts.md) --------------------------------

@dataclass(frozen=True)
class Calibration:
    net_alpha: float  # seconds per ring step (one message across a link)
    link_bytes_per_s: float  # one host's link
    shm_alpha: float  # seconds per shared-memory all-reduce, whatever its size
    shm_bytes_per_s: float  # bytes of a bucket per second through the host's shared memory


# What the per-bucket choice assumes: the calibration of benchmarks/results/xhost-n2-100mbit.json (this 2-core
# machine, 2 hosts x 2 ranks on 100 Mbit/s links: no measurable ring latency, 98 Mbit/s, 0.42 ms + 7.74 GB/s).
# With them a bucket goes flat below ~10 KB at 2 x 2 ranks (~20 KB at 4 x 2, ~6 KB at 2 x 8).
MEASURED = Calibration(net_alpha=0.0, link_bytes_per_s=12.26e6, shm_alpha=0.42e-3, shm_bytes_per_s=7.74e9)


def shm_seconds(nbytes: float, cal: Calibration) -> float:
    """Both shared-memory phases of a bucket of `nbytes` (reduce-scatter and all-gather, half each)."""
    return cal.shm_alpha + nbytes / cal.shm_bytes_per_s


def ring_seconds(nbytes: float, members: int, cal: Calibration) -> float:
    """A ring all-reduce of `nbytes` over `members`, each host's link carrying 2(n-1)/n of them."""
    if members <= 1:
        return 0.0
    return 2 * (members - 1) * (cal.net_alpha + nbytes / members / cal.link_bytes_per_s)


def path_seconds(nbytes: float, hosts: int, local: int, cal: Calibration) -> dict[str, float]:
    """Seconds of one all-reduce of `nbytes` (no overlap): flat ring, and hierarchical."""
    return {"flat": ring_seconds(nbytes, hosts * local, cal),
            "hier": shm_seconds(nbytes, cal) + ring_seconds(nbytes, hosts, cal)}


def two_level(nbytes: float, hosts: int, local: int, cal: Calibration = MEASURED) -> bool:
    """Whether a bucket of `nbytes` on `hosts` x `local` ranks goes through the two levels (else flat).

    >>> two_level(4 * 2**20, 2, 2), two_level(4096, 2, 2)
    (True, False)
    """
    cost = path_seconds(nbytes, hosts, local, cal)
    return cost["hier"] <= cost["flat"]


class HierarchicalExchange(AllReduceExchange):
    """Buckets averaged over every rank of every host: shared memory (`comm`, this host's ranks) around
    an all-reduce on `network` (this local index on every host). `group` is the whole world: a sparse
    bucket, and with `per_bucket` a dense one that `two_level` sends flat, go through its plain all-reduce."""

    def __init__(self, comm: ShmCommunicator, network, group, guard: StepGuard, per_bucket: bool = True):
        super().__init__(group, guard)
        self.comm = comm
        self.network = network
        self.hosts = dist.get_world_size(network)
        self.per_bucket = per_bucket
        self._plans: dict[int, tuple] = {}  # bucket index -> (own lo, own hi, fetched pieces): two-level buckets
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
        self._plans = {b.index: self._plan(b) for b in buckets if not b.sparse and self._two_level(b)}

    def _two_level(self, bucket: Bucket) -> bool:
        """From the bucket's size and the topology only: every rank decides alike."""
        span = _span(bucket)
        return not self.per_bucket or two_level(span.numel() * span.element_size(), self.hosts, self.comm.world_size)

    def _flat(self, bucket: Bucket) -> bool:
        """Sparse, or sent flat: the whole world's all-reduce (AllReduceExchange) carries it."""
        return bucket.index not in self._plans

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
            if not self._flat(bucket):
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
        if self._flat(bucket):
            super().launch(bucket)
            return
        with self.timer("wait", bucket.index):
            self.comm.claim(bucket.storage)  # no peer still fetches from the last step's copy
        with self.timer("copy_in", bucket.index):
            bucket.fill_(self.scale)
        self._check_local(bucket)
        self._fill_tag(bucket)
        self._host_reduce(bucket, f"the gradient exchange of bucket {bucket.index}")

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        if self._flat(bucket):
            super().deliver(bucket, used)
            return
        what = f"the gradient exchange of bucket {bucket.index}"
        self._host_gather(bucket, what)
        if self.guard.enabled:
            self._check_tag(bucket, bucket.tag_slot.item(), what)
        self._write_back(bucket, used, None)

    def discard(self, bucket: Bucket) -> None:
        if self._flat(bucket):
            super().discard(bucket)
            return
        self._host_gather(bucket, f"the gradient exchange of bucket {bucket.index}")  # the peers need our chunk

    def shadow(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            if self._flat(bucket):
                self._launch_shadow(bucket)
                continue
            bucket.detach_gradient_views()
            self.comm.claim(bucket.storage)
            bucket.storage.zero_()
            self._host_reduce(bucket, f"the shadow exchange of bucket {bucket.index}")
        for bucket in buckets:
            if self._flat(bucket):
                self._finish(bucket, "the shadow all-reduce")
            else:
                self._host_gather(bucket, f"the shadow exchange of bucket {bucket.index}")


def _span(bucket: Bucket) -> torch.Tensor:
    """What is summed: the bucket's gradients and its step tag (its storage may be longer)."""
    return bucket.storage[:bucket.numel + 1]
