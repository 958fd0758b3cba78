"""The posted and split exchanges: sums over ranks of pieces of a communicator's allocations.

A rank `post()`s its part where it lies in its slot (a stamp and one barrier arrival, no wait).
`gather_sum()` then has every rank add up all ranks' copies, in rank order so that the bits agree,
straight into outputs of its own: no second phase and no result written back into the slots. The
split variant divides the work: each rank sums one chunk (`reduce_own_chunk`), then copies the
others' results (`fetch_chunks`). `claim()` keeps a rank from rewriting a copy a peer still reads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ..errors import CollectiveMismatchError, RanksTimedOutError, explain
from .barrier import LINE_BYTES, MODE_POST
from .reduce import (
    DTYPE_CODES,
    KERNEL_CHECKS,
    KERNEL_DTYPES,
    WIDENED,
    chunk_bounds,
    copy_pieces,
    kernel_serves,
    streams,
    sum_own_chunk,
    sum_pieces,
)

# Up to this many ranks, a posted exchange (each rank reads every copy once) moves no more bytes than
# the two-phase all-reduce followed by a copy of the result to where it is wanted; beyond, it moves more.
POSTED_MAX_RANKS = 3


class Stamp(ctypes.Structure):
    """What a rank last posted from one allocation (ShmCommunicator.post): at the end of its slot, so a
    peer reading the slot checks it against its own, however far ahead in other exchanges that rank is.
    `nonfinite`: whether the values of its last reduce_own_chunk() were not all finite (fetch_chunks() reads it)."""

    _fields_ = [("posts", ctypes.c_uint64), ("dtype", ctypes.c_uint32), ("nonfinite", ctypes.c_uint32),
                ("offset", ctypes.c_uint64), ("numel", ctypes.c_uint64), ("_pad", ctypes.c_uint64 * 4)]


assert ctypes.sizeof(Stamp) == LINE_BYTES
STAMP_FIELDS = ("posts", "dtype", "offset", "numel")


class PostedExchanges:
    """The posted and split exchanges of ShmCommunicator (a mixin: it works on the communicator's
    allocations, barrier and failure state). Every call is collective and in order, like allreduce_()."""

    def posted_exchange_pays(self) -> bool:
        """Whether post() + gather_sum() moves fewer bytes than allreduce_() plus copying the result out."""
        return self.world_size <= POSTED_MAX_RANKS

    def claim(self, tensor: torch.Tensor) -> None:
        """Wait until no peer reads this rank's copy of `tensor` for an earlier gather_sum(); call it
        before writing into a posted tensor again. Returns at once in the usual case (peers are done)."""
        allocation, _ = self._posted_piece(tensor, "claim")
        if allocation.read_phase is not None:
            self._guarded(self._barrier.wait_all, allocation.read_phase, "exchange", self._spin)
            allocation.read_phase = None

    def post(self, tensor: torch.Tensor) -> int:
        """Collective, in order: this rank's part is in `tensor` (a piece of an alloc() tensor); peers may
        read it from now on. Returns the ticket that gather_sum() takes. Nothing is waited for.

        >>> comm.claim(bucket); bucket.copy_(grads); ticket = comm.post(bucket)   # doctest: +SKIP
        >>> comm.gather_sum(bucket, ticket, [(0, grads)])                           # grads = sum over ranks
        """
        allocation, offset = self._posted_piece(tensor, "post")
        self._check_tensor(tensor, average=False)
        stamp = allocation.stamps[self.rank]
        allocation.posts += 1
        stamp.posts, stamp.dtype, stamp.offset, stamp.numel = (allocation.posts, DTYPE_CODES[tensor.dtype], offset,
                                                               tensor.numel())
        self._ops += 1
        description = (self._ops, allocation.ident, DTYPE_CODES[tensor.dtype], offset, tensor.numel(), MODE_POST)
        return self._guarded(self._barrier.arrive, description)  # after the data and the stamp (TSO)

    def posted_ready(self, ticket: int, timeout: float) -> bool:
        """Whether every rank has made the post of `ticket`, waiting up to `timeout` seconds for it. A
        dead or failed peer still raises; running out of time here leaves the communicator usable."""
        if self._error is not None:
            raise self._error
        try:
            self._barrier.wait_all(ticket, "exchange", self._spin, timeout)
        except RanksTimedOutError:
            return False  # nothing was read or written: the exchange can still go on
        except BaseException as exc:
            self._error = exc
            self._barrier.abort()
            raise
        return True

    def gather_sum(self, tensor: torch.Tensor, ticket: int, outputs: list[tuple[int, torch.Tensor]],
                   segments: Sequence[int] = ()) -> None:
        """Collective, after post(tensor): wait for every rank's post, then write the sum over ranks (in
        rank order: the same bits everywhere) of `tensor.view(-1)[start:start + out.numel()]` into each
        `(start, out)` of `outputs` (any shapes and strides). Our copy stays readable until we return.

        `segments` are more outputs, already as the kernel takes them (kernel_serves(tensor.dtype) only):
        flat (address, start, count) triples of contiguous memory of tensor's dtype, for a caller that
        keeps them from step to step and only refreshes the addresses."""
        allocation, offset = self._posted_piece(tensor, "gather_sum")
        if segments and not kernel_serves(tensor.dtype):
            raise ValueError(explain("gather_sum() takes segments only for the kernel's dtypes", rank=self.rank,
                                     seen=f"segments for a {tensor.dtype} tensor",
                                     expected="float32 or float64 (kernel_serves())",
                                     fix="Pass (start, tensor) outputs instead."))
        self._guarded(self._gather_sum, allocation, offset, tensor, ticket, outputs, segments)

    def _gather_sum(self, allocation, offset: int, tensor: torch.Tensor, ticket: int, outputs, segments) -> None:
        self._barrier.wait_all(ticket, "exchange", self._spin)
        self._check_same_post(allocation)
        self._sum_into(self._copies(allocation, offset, tensor), outputs, segments)
        allocation.read_phase = self._barrier.arrive()  # done reading: peers may claim their copies

    def _copies(self, allocation, offset: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of `tensor`, a piece of `allocation` at byte `offset`."""
        nbytes = tensor.numel() * tensor.element_size()
        return [slot[offset:offset + nbytes].view(tensor.dtype) for slot in allocation.slots]

    @staticmethod
    def _sum_into(copies: list[torch.Tensor], outputs, segments=()) -> None:
        dtype = copies[0].dtype
        if kernel_serves(dtype):  # one call for every contiguous output of the copies' dtype
            more, rest = [], []
            for start, out in outputs:
                if out.dtype == dtype and out.is_contiguous():
                    if out.numel():
                        more += (out.data_ptr(), start, out.numel())
                else:
                    rest.append((start, out))
            if more:
                segments = [*segments, *more]
            if segments:
                sum_pieces(tuple(copy.data_ptr() for copy in copies), segments, dtype,
                           streams(copies[0]))
            outputs = rest
        widen = dtype in WIDENED and len(copies) > 2  # n half-precision terms: sum in fp32
        for start, out in outputs:
            parts = [copy[start:start + out.numel()].view(out.shape) for copy in copies]
            if len(parts) == 1:
                out.copy_(parts[0])
            elif widen:
                total = parts[0].float()
                for part in parts[1:]:
                    total.add_(part)
                out.copy_(total)
            else:
                torch.add(parts[0], parts[1], out=out)
                for part in parts[2:]:
                    out.add_(part)

    # -- split exchange: each rank sums one chunk, then fetches the others -----------------------

    def split_exchange_pays(self, dtype: torch.dtype) -> bool:
        """Whether the split exchange can serve `dtype` here (its kernel does float32 and float64)."""
        return self.world_size > 1 and kernel_serves(dtype)

    def chunk_bounds(self, numel: int, element_size: int) -> list[int]:
        """Where the chunks of a tensor of `numel` elements begin and end: rank j sums chunk j."""
        return chunk_bounds(numel, element_size, self.world_size)

    def reduce_own_chunk(self, tensor: torch.Tensor, ticket: int, pieces: list[tuple[int, torch.Tensor]],
                         scale: float, sums: list[tuple[int, torch.Tensor]] = (), finite: list | None = None) -> int:
        """Split exchange, after every rank's post(tensor) (see posted_ready): each `(start, out)` of
        `pieces` lies in this rank's chunk, and `out` (contiguous) holds this rank's values for
        tensor[start:start + out.numel()]; the sum in rank order of `out * scale` and the other ranks'
        posted copies goes into `out` and into this rank's copy, for the peers to fetch. Each
        `(start, out)` of `sums` (outside every rank's chunk: chunks are being rewritten meanwhile)
        gets the plain sum, as in gather_sum(). Returns the ticket of fetch_chunks().

        With a list `finite` (the non-finite gradient check): the kernel appends whether every element of this
        rank's `out`s was finite as it read them (no extra pass), and whether all of `finite` then holds (the
        caller may put in first what it found of this rank's other values) is published in this rank's stamp,
        before the barrier every rank passes on its way into fetch_chunks(), which reads it (`nonfinite`)."""
        allocation, offset = self._posted_piece(tensor, "reduce_own_chunk")
        return self._guarded(self._reduce_own_chunk, allocation, offset, tensor, ticket, pieces, scale, sums, finite)

    def _reduce_own_chunk(self, allocation, offset, tensor, ticket, pieces, scale, sums, finite=None) -> int:
        self._barrier.wait_all(ticket, "exchange", self._spin)
        self._check_same_post(allocation)
        copies = self._copies(allocation, offset, tensor)
        self._sum_into(copies, sums)
        code, stream = KERNEL_DTYPES[tensor.dtype], streams(tensor)
        checks = finite is not None and KERNEL_CHECKS  # a kernel built before it could check: the caller did
        for start, out in pieces:
            count = out.numel()
            if not out.is_contiguous() or out.dtype != tensor.dtype:
                raise ValueError(explain("reduce_own_chunk() writes contiguous pieces of the tensor's dtype",
                                         rank=self.rank, seen=f"{out.dtype}, strides {out.stride()}",
                                         expected=f"contiguous {tensor.dtype}", fix="Pass a contiguous view."))
            if count:
                addresses = tuple(copy[start:start + count].data_ptr() for copy in copies)
                seen = sum_own_chunk(out.data_ptr(), addresses[self.rank], out.data_ptr(), addresses, count, code,
                                     scale, self.rank, stream, checks)
                if checks:
                    finite.append(seen)
        # Rewritten at every exchange of the allocation (discard and shadow say "finite"), so none reads a stale one.
        allocation.stamps[self.rank].nonfinite = finite is not None and not all(finite)
        return self._barrier.arrive()  # this rank's chunk of the result, and its verdict, are in its slot (TSO)

    def reduce_scatter(self, tensor: torch.Tensor, ticket: int, start: int, out: torch.Tensor) -> None:
        """A true reduce-scatter, after every rank's post(tensor) (see posted_ready): the sum in rank order
        of every rank's `tensor[start:start + out.numel()]` goes into `out` (contiguous; it may be this
        rank's own copy of those elements). Each rank reads only its own chunk of each peer's copy, once;
        then it is done reading, and peers may claim() their copies again."""
        allocation, offset = self._posted_piece(tensor, "reduce_scatter")
        allocation.read_phase = self._guarded(self._reduce_scatter, allocation, offset, tensor, ticket, start, out)

    def _reduce_scatter(self, allocation, offset, tensor, ticket, start, out) -> int:
        self._barrier.wait_all(ticket, "exchange", self._spin)
        self._check_same_post(allocation)
        copies = self._copies(allocation, offset, tensor)
        count = out.numel()
        if kernel_serves(tensor.dtype) and out.is_contiguous() and count:
            addresses = tuple(copy[start:start + count].data_ptr() for copy in copies)
            own = addresses[self.rank]  # its term is taken as it is (scale 1): peers read the same bits
            sum_own_chunk(out.data_ptr(), out.data_ptr(), own, addresses, count, KERNEL_DTYPES[tensor.dtype], 1.0,
                          self.rank, streams(tensor))
        else:  # torch's adds, into a total of its own: `out` may be one of the terms
            total = torch.empty_like(out)
            self._sum_into(copies, [(start, total)])
            out.copy_(total)
        return self._barrier.arrive()  # done reading the peers' copies

    def fetch_chunks(self, tensor: torch.Tensor, ticket: int, pieces: list[tuple[int, int, torch.Tensor]],
                     nonfinite: list | None = None) -> None:
        """Split exchange, after every rank's reduce_own_chunk() (see posted_ready): copy each
        `(owner, start, out)` of `pieces` from rank `owner`'s result; then this rank is done reading. With a
        list `nonfinite`, appends the ranks whose reduce_own_chunk() published values that were not all finite."""
        allocation, offset = self._posted_piece(tensor, "fetch_chunks")
        self._guarded(self._fetch_chunks, allocation, offset, tensor, ticket, pieces, nonfinite)

    def _fetch_chunks(self, allocation, offset, tensor, ticket, pieces, nonfinite=None) -> None:
        self._barrier.wait_all(ticket, "exchange", self._spin)
        if nonfinite is not None:
            # Read before this rank's arrival below: a peer rewrites its stamp only in a later exchange of this
            # allocation, after its claim() waited for that arrival.
            nonfinite += [j for j, stamp in enumerate(allocation.stamps) if stamp.nonfinite]
        copies = self._copies(allocation, offset, tensor)
        segments = []
        for owner, start, out in pieces:
            source = copies[owner][start:start + out.numel()]
            if kernel_serves(out.dtype) and out.dtype == source.dtype and out.is_contiguous():
                if out.numel():
                    segments += (out.data_ptr(), source.data_ptr(), out.numel())
            else:
                out.copy_(source.view(out.shape))
        if segments:
            copy_pieces(segments, tensor.dtype, None, streams(tensor))
        allocation.read_phase = self._barrier.arrive()  # done reading: peers may claim their copies

    def _posted_piece(self, tensor: torch.Tensor, what: str):
        """(allocation, byte offset) of `tensor`, after any queued all-reduce has run."""
        found = self._locate(tensor)
        if found is None:
            raise TypeError(explain(f"{what}() takes a tensor from this communicator's alloc()", rank=self.rank,
                                    seen="a tensor outside its allocations (or not contiguous)",
                                    expected="a contiguous piece of an alloc() tensor",
                                    fix="Allocate the tensor with comm.alloc(), or use allreduce_()."))
        if self._pending:  # the worker thread would arrive at the same barrier concurrently
            self.allreduce_(torch.zeros(0), average=False, async_op=False)  # drain it (keeps the order)
        return found

    def _check_same_post(self, allocation) -> None:
        mine = tuple(getattr(allocation.stamps[self.rank], name) for name in STAMP_FIELDS)
        for j, stamp in enumerate(allocation.stamps):
            theirs = tuple(getattr(stamp, name) for name in STAMP_FIELDS)
            if theirs != mine:
                self._barrier.abort()
                raise CollectiveMismatchError(explain(
                    f"rank {j} posted something else than this rank", rank=self.rank,
                    seen=f"rank {j}: " + ", ".join(f"{n}={v}" for n, v in zip(STAMP_FIELDS, theirs)),
                    expected=", ".join(f"{n}={v}" for n, v in zip(STAMP_FIELDS, mine)),
                    fix="Every rank must post the same pieces of the same allocations, in the same order."),
                    peer_rank=j)
