"""The seam between the reducer and the transports: how one full bucket becomes its average.

The reducer decides *when* a bucket is ready and launches buckets in index order; an exchange
decides *how* the bucket's gradients are averaged and delivered into `param.grad`. Nothing else
crosses this seam. Here: the interface; each implementation is a module of its own beside this one,
and choose.py picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from ..bucket.buckets import Bucket
from ..bucket.step_guard import StepGuard
from .phase_timer import PhaseTimer


class GradientCheck(Protocol):
    """What the reducer runs on this rank's gradients of a bucket as they leave the rank (the non-finite check,
    engine/replicas/nonfinite.py): the exchange calls it between its copy-in and its collective."""

    def local(self, bucket: Bucket, flat: torch.Tensor | None) -> None:
        """`flat`: this rank's gradients of `bucket`, flat (scaled or not); None: read them from `.grad`."""

    def seen(self, bucket: Bucket, finite: bool) -> None:
        """The exchange looked itself, on the way (its copy-in): whether this rank's gradients of `bucket`, or
        a part of them, were all finite (parts: every one must be)."""

    def folds(self, guard: StepGuard, device: torch.device) -> bool:
        """Whether the exchange may carry every rank's verdict on a bucket: in its summed step tag (see
        BucketExchange._fill_tag), or the shared-memory split exchange's stamps (shm/posted.py)."""

    def finite_here(self, bucket: Bucket) -> bool:
        """Whether this rank's gradients of `bucket` were all finite (after `local` or `seen`)."""

    def folded(self, bucket: Bucket, nonfinite: bool) -> None:
        """Every rank's verdict on `bucket`, as the exchange carried it: whether any rank's were not finite."""


class BucketExchange(ABC):
    """How a bucket of gradients becomes its average across ranks, delivered into each `param.grad`.

    Per synchronized backward the reducer calls `launch(bucket)` for every bucket, in index order,
    each as soon as its gradients are ready (the exchange starts and returns at once, so it overlaps
    the rest of backward); then at the end of backward `deliver(bucket, used)` for every bucket, in
    index order (the exchange waits, within the step guard's bounds, and writes the result).

    The exchange owns its buckets' storage (`allocate`: shared memory for the shared-memory
    exchange) and is told the plan each time it changes (`prepare`). It holds the step guard it was
    built with, so its waits are bounded and name the ranks that are missing.

    A sharded exchange (sharded.py) fits the same calls: `launch` reduce-scatters the bucket
    and `deliver` hands the chunk this rank owns to the optimizer; its all-gather of the updated
    parameters after the optimizer step works over the same bucket layout.
    """

    keeps_plan = False  # True: the bucket plan must not change once built (the one-time rebuild is skipped)
    # True: a step's exchange ends the same way on every rank, done on all or failed on all (shared memory: a
    # phase every rank reached stays reached), so live recovery needs no per-step commit (world/generation.py).
    # Not a Gloo all-reduce, which one rank may finish while another gives it up.
    settles_alike = False
    closing = None  # a weakref.finalize that closes what the exchange holds beyond tensors (choose.py)
    check: GradientCheck | None = None  # set by the reducer: run on each bucket before it leaves the rank

    def __init__(self, guard: StepGuard):
        self.guard = guard
        self.divisor = guard.world_size  # averaged over this many ranks (join may change it)
        self.timer = PhaseTimer()  # off unless a profiler (phalanx bench --profile) turns it on

    def close(self) -> None:
        """Release what this exchange holds besides its tensors (a shared-memory worker thread), before the
        engine is rebuilt on another process group; not collective. It is not used again."""
        if self.closing is not None:
            self.closing()

    # -- storage and plan -------------------------------------------------------------------------

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Storage for a bucket: a zero-filled 1-D tensor. Collective for exchanges that share memory."""
        return torch.zeros(numel, dtype=dtype, device=device)

    def allocate_plan(self, sizes: list) -> list:
        """Storage for every bucket of a plan: `sizes` holds (numel, dtype, device) per bucket, None for a
        sparse one (no storage). An exchange may give more elements than asked, or views of shared buffers."""
        return [None if size is None else self.allocate(*size) for size in sizes]

    def bucket_caps(self, cap_bytes: int, first_cap_bytes: int) -> tuple[int, int]:
        """The bucket caps to plan with, given DDP's defaults (asked only when the user set no bucket_cap_mb):
        an exchange whose transport pipelines better with other sizes says so here."""
        return cap_bytes, first_cap_bytes

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

    def _check_local(self, bucket: Bucket, in_buffer: bool = True) -> None:
        """After the copy-in, before the collective: the check (if any) sees this rank's gradients of `bucket`,
        in its buffer (`in_buffer`), or in `.grad` (a sparse bucket, or a copy-in that leaves some out)."""
        if self.check is not None:
            self.check.local(bucket, bucket.buffer if in_buffer and not bucket.sparse else None)

    def _copy_in_checking(self, bucket: Bucket, copy_in, in_buffer: bool = True) -> None:
        """`copy_in` (shm_copy_in.BucketCopyIn) copies this rank's gradients into `bucket`; under the non-finite
        check its kernel says on the way whether every element it read was finite. A kernel built before it could
        say leaves a sum to the check: of the buffer (`in_buffer`), or of `.grad` (a copy that leaves parts out)."""
        finite = copy_in.copy(self.scale, check=self.check is not None)
        if finite is not None:
            self.check.seen(bucket, finite)
        elif self.check is not None:
            self._check_local(bucket, in_buffer)

    def _fill_tag(self, bucket: Bucket) -> None:
        """This step's tag into `bucket`'s last slot. Under the non-finite check, a rank whose gradients of the
        bucket hold a NaN or an Inf writes NaN there instead: the slot's sum over the ranks is then NaN on every
        rank, and the check needs no collective of its own (replicas/nonfinite.py). Only exchanges whose every
        rank reads the summed slot fold so (not the reduce-scatter, whose tag lands on one rank)."""
        bucket.tag_slot.fill_(self.guard.tag_for(bucket.storage.dtype))
        check = self.check
        if check is not None and check.folds(self.guard, bucket.storage.device) and not check.finite_here(bucket):
            bucket.tag_slot.fill_(float("nan"))

    def _check_tag(self, bucket: Bucket, seen: float, what: str) -> None:
        """The summed tag of `bucket` (filled by _fill_tag): NaN says a rank's gradients were not finite, to the
        check (the tags are then not compared); else it must hold every rank's tag."""
        check = self.check
        if check is not None and check.folds(self.guard, bucket.storage.device):
            nonfinite = seen != seen
            check.folded(bucket, nonfinite)
            if nonfinite:
                return
        self.guard.check_tag_sum(seen, bucket.storage.dtype, what)

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
