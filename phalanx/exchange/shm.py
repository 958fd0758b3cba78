"""The shared-memory exchange: phalanx DDP's default when every rank is on this host with CPU gradients.

Buckets live in shared memory (the communicator's `alloc`), so the bytes never cross a socket.
Each bucket is averaged in one of three ways, chosen once per bucket plan:
- posted (2-3 ranks): a full bucket is only published; at the end of backward each rank sums every
  rank's copy, in rank order, straight into its gradients (no write-back pass, one barrier);
- split (posted, buckets of few large fp32/fp64 gradients): each rank publishes only the parts the
  others sum, sums its own chunk into its gradients, then fetches the other chunks from their owners;
- all-reduce (4+ ranks, or gradient_as_bucket_view): the communicator's two-phase all-reduce of the
  bucket where it lies, then a write-back, as the process group's exchange does.
Every way sums in rank order, so every rank gets the same bits.
"""

from __future__ import annotations

from functools import partial

import torch

from ..bucket.buckets import Bucket
from ..bucket.step_guard import StepGuard
from ..diagnose import step_clock
from ..shm import ShmCommunicator
from ..shm.reduce import kernel_serves, streams
from .all_reduce import AllReduceExchange
from .shm_copy_in import BucketCopyIn, gradient_addresses

ALL_REDUCE, POSTED, SPLIT = "all-reduce", "posted", "split"


class ShmExchange(AllReduceExchange):
    """Average buckets through a ShmCommunicator that allocated them (see the module docstring)."""

    def __init__(self, comm: ShmCommunicator, guard: StepGuard):
        super().__init__(comm.group, guard)
        self.comm = comm
        self.modes: list[str] = []  # per bucket index
        self._pieces: dict = {}  # split bucket index -> (own pieces, fetched pieces)
        self._tickets: dict[int, int] = {}
        self._totals: dict = {}  # without the kernel: posted bucket of small gradients -> (private sum, its views)
        self._tag_total = torch.zeros(1, dtype=torch.float64)  # the summed step tag of a posted bucket
        self._copy_ins: dict[int, BucketCopyIn] = {}  # posted or split bucket index -> its copy-in
        self._sums: dict[int, list[int]] = {}  # posted bucket index -> its sum's segments (see prepare)

    # -- storage and plan -------------------------------------------------------------------------

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.alloc(numel, dtype)

    def release(self, storage: torch.Tensor) -> None:
        self.comm.release(storage)

    def prepare(self, buckets: list[Bucket]) -> None:
        self.modes = [self._mode_for(bucket) for bucket in buckets]
        self.settles_alike = not any(bucket.sparse for bucket in buckets)  # a sparse bucket goes through Gloo
        self._pieces = {b.index: self._plan_pieces(b) for b in buckets if self.modes[b.index] == SPLIT}
        self._totals = {}
        self._copy_ins = {b.index: self._copy_in_for(b) for b in buckets
                          if self.modes[b.index] != ALL_REDUCE and kernel_serves(b.storage.dtype)}
        # A posted bucket's sum as the kernel takes it, (gradient address, bucket offset, count) per gradient:
        # each step only refreshes the addresses (a Python pass per gradient costs more than a small sum).
        self._sums = {b.index: [value for start, p in zip(b.offsets, b.params) for value in (0, start, p.numel())]
                      for b in buckets if self.modes[b.index] == POSTED and kernel_serves(b.storage.dtype)}

    def _copy_in_for(self, bucket: Bucket) -> BucketCopyIn:
        """A posted bucket takes every gradient whole; a split one the parts in other ranks' chunks."""
        if self.modes[bucket.index] == POSTED:
            return BucketCopyIn.whole_gradients(bucket, streams(bucket.storage))
        segments = [[] for _ in bucket.params]
        for _, k, lo, hi in self._pieces[bucket.index][1]:
            segments[k].append((bucket.offsets[k] + lo, lo, hi - lo))
        return BucketCopyIn(bucket, segments, streams(bucket.storage))

    def buffers(self) -> list[torch.Tensor]:
        return [total for total, _ in self._totals.values()] + [self._tag_total]

    def _mode_for(self, bucket: Bucket) -> str:
        # Views (gradient_as_bucket_view) need the result in the bucket itself: only the all-reduce puts it there.
        # A sparse gradient has no place in shared memory: its all-reduce is the process group's.
        if bucket.sparse or bucket.as_view or not self.comm.posted_exchange_pays():
            return ALL_REDUCE
        # Few large gradients only: per-piece calls would cost more than they save on many small ones.
        if (bucket.large_tensors and self.comm.split_exchange_pays(bucket.storage.dtype)
                and all(p.is_contiguous() for p in bucket.params)):
            return SPLIT
        return POSTED

    def _plan_pieces(self, bucket: Bucket):
        """The part of each gradient in this rank's chunk, and the parts it fetches from the chunks' owners:
        (k, lo, hi) and (owner, k, lo, hi), with lo and hi inside gradient k."""
        bounds = self.comm.chunk_bounds(bucket.numel, bucket.storage.element_size())
        own, fetched = [], []
        for k, (start, p) in enumerate(zip(bucket.offsets, bucket.params)):
            for owner in range(len(bounds) - 1):
                lo, hi = max(start, bounds[owner]), min(start + p.numel(), bounds[owner + 1])
                if hi > lo:
                    if owner == self.comm.rank:
                        own.append((k, lo - start, hi - start))
                    else:
                        fetched.append((owner, k, lo - start, hi - start))
        return own, fetched

    def settle(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:  # our copies may still be read by a peer: wait before anything rewrites them
            if self.modes[bucket.index] != ALL_REDUCE:
                self.comm.claim(bucket.storage)

    # -- the all-reduce way: the process group's exchange over the communicator ------------------

    def _start(self, storage: torch.Tensor):
        return self.comm.allreduce_(storage, average=False)

    def _wait(self, handle, what: str) -> None:
        self.guard.wait(handle, what)

    # -- one backward ----------------------------------------------------------------------------

    def launch(self, bucket: Bucket) -> None:
        mode = self.modes[bucket.index]
        if mode == ALL_REDUCE:
            super().launch(bucket)
            return
        with self.timer("wait", bucket.index):
            started = step_clock.now_ns()  # until every peer has read this bucket's last step
            self.comm.claim(bucket.storage)
            step_clock.add_exchange_wait(step_clock.now_ns() - started)
        copy_in = self._copy_ins.get(bucket.index)
        with self.timer("copy_in", bucket.index):
            if copy_in is not None:  # the non-finite check rides along (split: its own chunk when it is summed)
                self._copy_in_checking(bucket, copy_in, in_buffer=False)
            else:  # a dtype the kernel does not take (a split bucket always has a copy-in)
                bucket.fill_(self.scale)
                self._check_local(bucket)
        if mode == POSTED:  # this rank's verdict is known: its tag carries it (a split bucket's, after its sum)
            self._fill_tag(bucket)
        else:
            bucket.tag_slot.fill_(self.guard.tag_for(bucket.storage.dtype))
        self._tickets[bucket.index] = self.comm.post(bucket.storage)

    def deliver(self, bucket: Bucket, used: list[int] | None) -> None:
        mode = self.modes[bucket.index]
        if mode == ALL_REDUCE:
            super().deliver(bucket, used)
        elif mode == POSTED:
            self._gather(bucket, used)
        else:
            self._split_collect(bucket, used)

    def discard(self, bucket: Bucket) -> None:
        mode = self.modes[bucket.index]
        if mode == ALL_REDUCE:
            super().discard(bucket)
            return
        ticket, what = self._tickets.pop(bucket.index), f"the gradient exchange of bucket {bucket.index}"
        if mode == POSTED:
            self._await(ticket, what, bucket.index)
            self.comm.gather_sum(bucket.storage, ticket, [])
            return
        # This rank's chunk of the sum is still its job (the peers fetch it): sum it out of the gradients.
        own, _ = self._pieces[bucket.index]
        pieces = []
        for k, lo, hi in own:
            grad = bucket.params[k].grad
            values = (torch.zeros(hi - lo, dtype=bucket.storage.dtype) if grad is None
                      else grad.reshape(-1)[lo:hi].clone())
            pieces.append((bucket.offsets[k] + lo, values))
        self._split_exchange(bucket, ticket, what, self.scale or 1.0, pieces, [])

    def shadow(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            if self.modes[bucket.index] == ALL_REDUCE:
                self._launch_shadow(bucket)
                continue
            bucket.detach_gradient_views()
            self.comm.claim(bucket.storage)
            bucket.storage.zero_()
            self._tickets[bucket.index] = self.comm.post(bucket.storage)
        for bucket in buckets:
            mode, what = self.modes[bucket.index], f"the shadow exchange of bucket {bucket.index}"
            if mode == ALL_REDUCE:
                self._finish(bucket, "the shadow all-reduce")
                continue
            ticket = self._tickets.pop(bucket.index)
            if mode == POSTED:
                self._await(ticket, what, bucket.index)
                self.comm.gather_sum(bucket.storage, ticket, [])
                continue
            # This rank's chunk of the sum is still its job: its own terms are the zeros it posted.
            bounds = self.comm.chunk_bounds(bucket.numel, bucket.storage.element_size())
            lo, hi = bounds[self.comm.rank], bounds[self.comm.rank + 1]
            self._split_exchange(bucket, ticket, what, 1.0, [(lo, bucket.storage[lo:hi])], [])

    # -- posted ------------------------------------------------------------------------------------

    def _await(self, ticket: int, what: str, bucket: int) -> None:
        """Return once every rank has posted `ticket`, within the guard's bounds, like any other wait."""
        with self.timer("wait", bucket):
            self.guard.wait_until(partial(self.comm.posted_ready, ticket), what)

    def _gather(self, bucket: Bucket, used: list[int] | None) -> None:
        """Every rank's copy of the bucket summed straight into the gradients."""
        ticket, what = self._tickets.pop(bucket.index), f"the gradient exchange of bucket {bucket.index}"
        segments = self._sums.get(bucket.index)
        addresses = gradient_addresses(bucket.params) if segments is not None and used is None else None
        if addresses is not None:
            segments[0::3] = addresses  # the usual step: only the addresses change
            self._await(ticket, what, bucket.index)
            with self.timer("reduce", bucket.index):
                self.comm.gather_sum(bucket.storage, ticket, [(bucket.numel, self._tag_total)], segments)
            tag = self._tag_total
        else:
            tag = self._gather_each(bucket, ticket, what, used)
        if self.guard.enabled:
            self._check_tag(bucket, tag.item(), what)

    def _gather_each(self, bucket: Bucket, ticket: int, what: str, used: list[int] | None) -> torch.Tensor:
        """_gather() gradient by gradient: some unused, missing or strided. Returns the summed tag."""
        grads, chosen = [], []  # (offset in the bucket, where the sum goes), and which parameter
        for k, (i, p, start) in enumerate(zip(bucket.indices, bucket.params, bucket.offsets)):
            if used is not None and not used[i]:
                continue  # unused on every rank: its gradient stays as it is (None stays None)
            if p.grad is None:  # unused here only
                p.grad = torch.empty(p.shape, dtype=bucket.storage.dtype, device=bucket.storage.device)
            grads.append((start, p.grad))
            chosen.append(k)
        self._await(ticket, what, bucket.index)
        if bucket.large_tensors or kernel_serves(bucket.storage.dtype):  # straight into them, one call
            with self.timer("reduce", bucket.index):
                self.comm.gather_sum(bucket.storage, ticket, grads + [(bucket.numel, self._tag_total)])
            return self._tag_total
        # many small ones without the kernel: a single sum into a private buffer, then one batched copy
        total, views = self._private_total(bucket)
        with self.timer("reduce", bucket.index):
            self.comm.gather_sum(bucket.storage, ticket, [(0, total)])
        with self.timer("copy_out", bucket.index):
            if len(grads) == len(bucket.params):
                torch._foreach_copy_([grad for _, grad in grads], views)
            else:
                for k, (_, grad) in zip(chosen, grads):
                    grad.copy_(views[k])
        return total[bucket.numel:]

    def _private_total(self, bucket: Bucket):
        found = self._totals.get(bucket.index)
        if found is None:
            total = torch.empty_like(bucket.storage)
            views = [piece.view(p.shape) for piece, p in
                     zip(total[:bucket.numel].split([p.numel() for p in bucket.params]), bucket.params)]
            found = self._totals[bucket.index] = (total, views)
        return found

    # -- split -------------------------------------------------------------------------------------

    def _split_collect(self, bucket: Bucket, used: list[int] | None) -> None:
        """Sum this rank's chunk straight into the gradients (and the bucket, for the peers), then fetch
        the other chunks from their owners."""
        ticket, what = self._tickets.pop(bucket.index), f"the gradient exchange of bucket {bucket.index}"
        own, fetched = self._pieces[bucket.index]
        flats, copy_back = {}, []  # gradient k as one contiguous row, and strided ones to write back
        for k, (i, p) in enumerate(zip(bucket.indices, bucket.params)):
            if used is not None and not used[i]:
                continue  # unused on every rank: its gradient stays as it is (None stays None)
            if p.grad is None:  # unused here only: this rank adds zeros
                p.grad = torch.zeros(p.shape, dtype=bucket.storage.dtype, device=bucket.storage.device)
            grad = p.grad
            if grad.is_contiguous():
                flats[k] = grad.view(-1)
            else:
                flats[k] = grad.contiguous().view(-1)
                copy_back.append((grad, flats[k]))
        start, check = bucket.offsets, self.check
        # The non-finite check: this rank's verdict (its copy-in's, then its own chunk's as it is summed) goes into
        # its stamp before the barrier the fetch waits on, and every rank reads every rank's after it.
        finite = None if check is None else [check.finite_here(bucket)]
        nonfinite = [] if check is not None and check.folds(self.guard, bucket.storage.device) else None
        self._split_exchange(bucket, ticket, what, 1.0 / self.divisor,
                             [(start[k] + lo, flats[k][lo:hi]) for k, lo, hi in own if k in flats],
                             [(owner, start[k] + lo, flats[k][lo:hi]) for owner, k, lo, hi in fetched if k in flats],
                             sums=[(bucket.numel, self._tag_total)], finite=finite, nonfinite=nonfinite)
        if check is not None:
            check.seen(bucket, all(finite))
        if nonfinite is not None:
            check.folded(bucket, bool(nonfinite))
        with self.timer("copy_out", bucket.index):
            for grad, flat in copy_back:
                grad.copy_(flat.view(grad.shape))
        if self.guard.enabled:
            self.guard.check_tag_sum(self._tag_total.item(), bucket.storage.dtype, what)

    def _split_exchange(self, bucket: Bucket, ticket: int, what: str, scale: float, own: list, fetched: list,
                        sums=(), finite: list | None = None, nonfinite: list | None = None) -> None:
        """reduce_own_chunk() then fetch_chunks(), each once every rank is ready."""
        self._await(ticket, what, bucket.index)
        with self.timer("reduce", bucket.index):
            results = self.comm.reduce_own_chunk(bucket.storage, ticket, own, scale, sums, finite)
        self._await(results, what, bucket.index)
        with self.timer("copy_out", bucket.index):
            self.comm.fetch_chunks(bucket.storage, results, fetched, nonfinite)
