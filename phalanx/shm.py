"""All-reduce through shared memory between the ranks of one host: a memory copy instead of loopback TCP.

Every rank owns a slot in a shared segment. An all-reduce is two phases: each rank puts its tensor
in its slot and arrives; then rank r sums chunk r of every slot in rank order (one computation per
element, so every rank gets the same bits), averages it and writes it back into every slot, and
arrives again. Tensors from `alloc()` already live in a slot, so they skip the copies in and out.

For two or three ranks a posted exchange moves fewer bytes when the result is wanted elsewhere
(DDP's gradients): each rank `post()`s its part where it lies, then `gather_sum()` has every rank
add up all ranks' copies (in rank order, so the bits agree) straight into its own outputs, with no
second phase and no write-back of a result into the slots.
"""

from __future__ import annotations

import os
import queue
import threading

import torch
import torch.distributed as dist

from .errors import CollectiveMismatchError, RanksTimedOutError, ShmUnavailableError, explain
from .hooks import prescaled
from .shm_segment import PAGE, SHM_DIR, Segment, host_identity, process_start_time, sweep_stale_segments
from .shm_reduce import (BLOCK_BYTES, DTYPE_CODES, KERNEL_DTYPES, WIDENED, chunk_bounds, kernel_available,
                         reduce_chunk, round_up, sum_own_chunk)
from .shm_sync import LINE_BYTES, STAMP_FIELDS, PhaseBarrier, Stamp, futex_supported

_DEFAULT_TIMEOUT = 600.0
_DEFAULT_STAGING_BYTES = 32 * 2**20
# Up to this many ranks, a posted exchange (each rank reads every copy once) moves no more bytes than
# the two-phase all-reduce followed by a copy of the result to where it is wanted; beyond, it moves more.
POSTED_MAX_RANKS = 3
_POSTED = 2  # the "average" field of a line's description, for posts


def shm_enabled() -> bool:
    """False when the environment turns the shared-memory transport off (`PHALANX_SHM=0`)."""
    return os.environ.get("PHALANX_SHM", "1").strip().lower() not in ("0", "false", "no", "off")


def _group_timeout(group) -> float:
    """The process group's collective timeout, which bounds our waits too."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # private API: fall back to phalanx's setting
        return float(os.environ.get("PHALANX_TIMEOUT", _DEFAULT_TIMEOUT))


def _local_facts() -> dict:
    facts = host_identity()
    facts.update(pid=os.getpid(), start_time=process_start_time(os.getpid()), enabled=shm_enabled(),
                 shm_dir=os.access(SHM_DIR, os.W_OK), futex=futex_supported())
    try:
        usage = os.statvfs(SHM_DIR)
        facts["shm_free"] = usage.f_bavail * usage.f_frsize
    except OSError:
        facts["shm_free"] = 0
    return facts


def _staging_bytes(requested_mb: float | None, facts: list[dict]) -> int:
    """Slot size: as asked, or 32 MB (a default 25 MB DDP bucket in one round) capped at a quarter of
    the free /dev/shm (a container's is often 64 MB), from numbers every rank shares so all agree."""
    if requested_mb is not None:
        wanted = int(requested_mb * 2**20)
    else:
        room = min(f["shm_free"] for f in facts) // (4 * len(facts))
        wanted = min(_DEFAULT_STAGING_BYTES, room)
    return round_up(max(wanted, PAGE), PAGE)


def _unusable_reason(facts: list[dict]) -> str | None:
    """Why these ranks cannot share memory, or None. Every rank sees the same list, so all agree."""
    off = [j for j, f in enumerate(facts) if not f["enabled"]]
    if off:
        return f"PHALANX_SHM=0 on ranks {off}"
    for key in ("hostname", "boot_id", "pid_ns", "mnt_ns", "ipc_ns", "uid"):
        values = {f[key] for f in facts}
        if len(values) > 1 or None in values:
            return f"ranks differ in {key} ({sorted(map(str, values))}): not one host"
    unable = [j for j, f in enumerate(facts) if not (f["shm_dir"] and f["futex"])]
    if unable:
        return f"ranks {unable} have no writable {SHM_DIR} or no futex on {facts[unable[0]]['machine']} (x86-64 Linux only)"
    return None


class _Allocation:
    """A tensor per rank from `alloc()`, all in one segment; ours is `slots[rank]`, followed by our stamp."""

    def __init__(self, ident: int, segment: Segment, slots: list[torch.Tensor], stamps: list[Stamp], rank: int):
        self.ident = ident
        self.segment = segment
        self.slots = slots
        self.stamps = stamps
        self.start = slots[rank].data_ptr()
        self.end = self.start + slots[rank].numel()
        self.posts = 0
        self.read_phase: int | None = None  # peers may read our slot until they all reach this phase


class ShmCommunicator:
    """All-reduce over shared memory for a process group whose ranks all run on this host.

    Collective: every rank of `process_group` constructs it together. Raises ShmUnavailableError
    (on every rank alike) when the ranks span hosts or `PHALANX_SHM=0`; `shm_communicator()`
    returns None instead. Ops must be issued in the same order on every rank, from one thread.

    >>> comm = ShmCommunicator()                    # doctest: +SKIP
    >>> grads = comm.alloc(1 << 20)                 # lives in shared memory: no copy in or out
    >>> comm.allreduce_(grads).wait()               # averaged in place, same bits on every rank
    """

    def __init__(self, process_group=None, *, staging_mb: float | None = None, timeout: float | None = None,
                 threaded: bool = True, spin_us: float = 10.0):
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = float(timeout) if timeout is not None else _group_timeout(self.group)
        try:
            facts = _local_facts()
        except Exception as exc:  # still join the gather below, or the peers would wait for us
            facts = {"enabled": False, "error": repr(exc)}
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, facts, group=self.group)
        reason = _unusable_reason(gathered) if all("error" not in f for f in gathered) else \
            f"a rank could not describe its host: {[f.get('error') for f in gathered]}"
        if reason:
            raise ShmUnavailableError(explain("the shared-memory transport cannot serve this process group",
                                              rank=self.rank, seen=reason, expected="every rank on one host, enabled",
                                              fix="Nothing to do: use the process group's all-reduce instead."))
        sweep_stale_segments()
        self.segment_names: list[str] = []
        self._pid = os.getpid()
        self._staging_bytes = _staging_bytes(staging_mb, gathered)
        control_bytes = round_up(self.world_size * LINE_BYTES, PAGE)
        segment = self._create_shared(control_bytes + self.world_size * self._staging_bytes)
        peers = [(f["pid"], f["start_time"]) for f in gathered]
        self._barrier = PhaseBarrier(segment.memory, 0, self.rank, peers, self.timeout)
        memory = torch.frombuffer(segment.memory, dtype=torch.uint8)
        self._staging = [memory[control_bytes + j * self._staging_bytes:][:self._staging_bytes]
                         for j in range(self.world_size)]
        self._segment = segment
        self._allocations: list[_Allocation] = []
        self._next_ident = 0
        self._spin = spin_us * 1e-6
        self._scratch: torch.Tensor | None = None
        self._ops = 0
        self._error: BaseException | None = None
        self._pending = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        if threaded and self.world_size > 1:
            self._queue = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._serve, name=f"phalanx-shm-rank{self.rank}", daemon=True)
            self._worker.start()

    # -- segments ---------------------------------------------------------------------------------

    def _create_shared(self, size: int, signature=None) -> Segment:
        """Collective: group rank 0 creates a segment, every rank maps it, then the name is unlinked."""
        segment, problem = None, None
        if self.rank == 0:
            try:
                segment = Segment.create(size)
            except OSError as exc:
                problem = f"creating {size} bytes in {SHM_DIR} failed: {exc}"
        names = [segment.name if segment else None]
        dist.broadcast_object_list(names, src=dist.get_global_rank(self.group, 0), group=self.group)
        if self.rank != 0 and names[0] is not None:
            try:
                segment = Segment.attach(names[0], size)
            except (OSError, ValueError) as exc:
                problem = f"mapping {names[0]} failed: {exc}"
        outcomes = [None] * self.world_size
        dist.all_gather_object(outcomes, (problem, signature), group=self.group)
        if segment is not None and self.rank == 0:
            segment.unlink()  # every rank has mapped it or given up: from now on no crash leaves a file
        failed = [(j, p) for j, (p, _) in enumerate(outcomes) if p]
        if failed:
            raise ShmUnavailableError(explain("could not set up shared memory", rank=self.rank, seen=f"{failed}",
                                              expected="every rank mapping the segment",
                                              fix=f"Check free space in {SHM_DIR} (`df -h {SHM_DIR}`)."))
        differing = [(j, s) for j, (_, s) in enumerate(outcomes) if s != signature]
        if differing:
            raise CollectiveMismatchError(explain(
                "ranks asked for different shared allocations", rank=self.rank, seen=f"(rank, request): {differing}",
                expected=f"{signature} on every rank", fix="Call alloc() with the same numel and dtype on every rank."),
                peer_rank=differing[0][0])
        self.segment_names.append(names[0])
        return segment

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a zero-filled 1-D tensor in shared memory; all-reducing it (or a slice) skips two copies.

        >>> bucket = comm.alloc(6_250_000)    # doctest: +SKIP  (25 MB of fp32 gradients)
        """
        element_size = torch.empty((), dtype=dtype).element_size()
        data_bytes = round_up(max(numel * element_size, 1), LINE_BYTES)
        slot_bytes = round_up(data_bytes + LINE_BYTES, PAGE)  # the data, then the slot's stamp
        segment = self._create_shared(self.world_size * slot_bytes, signature=(int(numel), str(dtype)))
        memory = torch.frombuffer(segment.memory, dtype=torch.uint8)
        slots = [memory[j * slot_bytes:][:data_bytes] for j in range(self.world_size)]
        stamps = [Stamp.from_buffer(segment.memory, j * slot_bytes + data_bytes) for j in range(self.world_size)]
        self._next_ident += 1
        allocation = _Allocation(self._next_ident, segment, slots, stamps, self.rank)
        self._allocations.append(allocation)
        return slots[self.rank][:numel * element_size].view(dtype)

    def release(self, tensor: torch.Tensor) -> None:
        """Forget the allocation `tensor` came from (e.g. when DDP rebuilds its buckets); not collective.

        Its memory is freed once no tensor uses it; until then it is an ordinary tensor to `allreduce_`.
        """
        found = self._locate(tensor)
        if found is not None:
            self._allocations.remove(found[0])

    # -- all-reduce -------------------------------------------------------------------------------

    def allreduce_(self, tensor: torch.Tensor, average: bool = True, async_op: bool = True):
        """Sum (and by default average) `tensor` across ranks, in place.

        Returns a torch.futures.Future holding `tensor` (async_op=True: the caller may go on and
        `.wait()` later; the tensor must not be touched meanwhile), or the tensor itself.

        >>> comm.allreduce_(grads).wait()               # doctest: +SKIP
        >>> comm.allreduce_(loss, async_op=False)       # doctest: +SKIP
        """
        self._check_tensor(tensor, average)
        if not async_op:
            if self._queue is None or self._pending == 0:
                return self._run(tensor, average)
            return self.allreduce_(tensor, average).wait()  # behind queued ops: keep the order
        future = torch.futures.Future()
        if self._queue is None:
            try:
                future.set_result(self._run(tensor, average))
            except Exception as exc:  # noqa: BLE001 - delivered through the future, as the threaded path does
                future.set_exception(exc)
            return future
        with self._lock:
            self._pending += 1
        self._queue.put((future, tensor, average))
        return future

    def _check_tensor(self, tensor: torch.Tensor, average: bool) -> None:
        if os.getpid() != self._pid:
            raise ShmUnavailableError(explain("a ShmCommunicator was used in a forked child", rank=self.rank,
                                              seen=f"pid {os.getpid()}", expected=f"its creator, pid {self._pid}",
                                              fix="Create communicators in the process that uses them."))
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise TypeError(explain("shared-memory all-reduce takes CPU tensors", rank=self.rank,
                                    seen=getattr(tensor, "device", type(tensor).__name__), expected="device cpu",
                                    fix="Use the process group for GPU tensors."))
        if tensor.dtype not in DTYPE_CODES or (average and not tensor.dtype.is_floating_point):
            wanted = "a floating dtype (average=True)" if average else f"one of {sorted(map(str, DTYPE_CODES))}"
            raise TypeError(explain("tensor.dtype cannot be all-reduced here", rank=self.rank, seen=tensor.dtype,
                                    expected=wanted, fix="Convert the tensor, or pass average=False for integers."))

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, tensor, average = item
            try:
                result = self._run(tensor, average)
            except BaseException as exc:  # noqa: B902 - the waiter must get every failure
                with self._lock:
                    self._pending -= 1
                future.set_exception(exc)
                continue
            with self._lock:
                self._pending -= 1
            future.set_result(result)

    def _run(self, tensor: torch.Tensor, average: bool) -> torch.Tensor:
        self._guarded(self._allreduce_now, tensor, average)
        return tensor

    def _allreduce_now(self, tensor: torch.Tensor, average: bool) -> None:
        if self.world_size == 1 or tensor.numel() == 0:
            return
        code, element_size = DTYPE_CODES[tensor.dtype], tensor.element_size()
        found = self._locate(tensor)
        if found is not None:
            allocation, offset = found
            nbytes = tensor.numel() * element_size
            slots = [slot[offset:offset + nbytes].view(tensor.dtype) for slot in allocation.slots]
            self._exchange(tensor.view(-1), slots, (allocation.ident, code, offset, average), copy=False)
            return
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        piece = self._staging_bytes // element_size  # larger tensors go through the slots in rounds
        for start in range(0, flat.numel(), piece):
            part = flat[start:start + piece]
            slots = [slot[:part.numel() * element_size].view(tensor.dtype) for slot in self._staging]
            self._exchange(part, slots, (0, code, start, average), copy=True)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))

    def _locate(self, tensor: torch.Tensor):
        """(allocation, byte offset) if `tensor` is a contiguous piece of one of our allocations."""
        if not self._allocations or not tensor.is_contiguous():
            return None
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for allocation in self._allocations:
            if allocation.start <= start and end <= allocation.end:
                return allocation, start - allocation.start
        return None

    def _exchange(self, own: torch.Tensor, slots: list[torch.Tensor], what: tuple, copy: bool) -> None:
        """One all-reduce round of `own` through `slots` (slots[rank] is own when `copy` is False)."""
        ident, code, offset, average = what
        rank, bounds = self.rank, chunk_bounds(own.numel(), own.element_size(), self.world_size)
        chunks = [(bounds[j], bounds[j + 1]) for j in range(self.world_size)]
        if copy:  # our own chunk is read straight from `own`; the peers read the rest from our slot
            for j, (lo, hi) in enumerate(chunks):
                if j != rank and hi > lo:
                    slots[rank][lo:hi].copy_(own[lo:hi])
        self._ops += 1
        phase = self._barrier.arrive((self._ops, ident, code, offset, own.numel(), int(average)))
        self._barrier.wait_all(phase, "all-reduce", self._spin)
        self._barrier.check_same_operation()
        lo, hi = chunks[rank]
        if hi > lo:
            parts = [own[lo:hi] if j == rank else slots[j][lo:hi] for j in range(self.world_size)]
            reduce_chunk(parts, average, self._scratch_for(own.dtype))
        # The second phase: once every rank is here, every chunk of every slot holds the result,
        # and no peer touches our slot again before we arrive at the next exchange.
        phase = self._barrier.arrive()
        self._barrier.wait_all(phase, "all-reduce", self._spin)
        if copy:
            for j, (lo, hi) in enumerate(chunks):
                if j != rank and hi > lo:
                    own[lo:hi].copy_(slots[rank][lo:hi])

    # -- posted exchange ----------------------------------------------------------------------------

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
        description = (self._ops, allocation.ident, DTYPE_CODES[tensor.dtype], offset, tensor.numel(), _POSTED)
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

    def gather_sum(self, tensor: torch.Tensor, ticket: int, outputs: list[tuple[int, torch.Tensor]]) -> None:
        """Collective, after post(tensor): wait for every rank's post, then write the sum over ranks (in
        rank order: the same bits everywhere) of `tensor.view(-1)[start:start + out.numel()]` into each
        `(start, out)` of `outputs` (any shapes and strides). Our copy stays readable until we return."""
        allocation, offset = self._posted_piece(tensor, "gather_sum")
        self._guarded(self._gather_sum, allocation, offset, tensor, ticket, outputs)

    def _gather_sum(self, allocation: _Allocation, offset: int, tensor: torch.Tensor, ticket: int, outputs) -> None:
        self._barrier.wait_all(ticket, "exchange", self._spin)
        self._check_same_post(allocation)
        self._sum_into(self._copies(allocation, offset, tensor), outputs)
        allocation.read_phase = self._barrier.arrive()  # done reading: peers may claim their copies

    def _copies(self, allocation: _Allocation, offset: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of `tensor`, a piece of `allocation` at byte `offset`."""
        nbytes = tensor.numel() * tensor.element_size()
        return [slot[offset:offset + nbytes].view(tensor.dtype) for slot in allocation.slots]

    @staticmethod
    def _sum_into(copies: list[torch.Tensor], outputs) -> None:
        widen = copies[0].dtype in WIDENED and len(copies) > 2  # n half-precision terms: sum in fp32
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

    # -- split exchange: each rank sums one chunk, then fetches the others' -------------------------

    def split_exchange_pays(self, dtype: torch.dtype) -> bool:
        """Whether the split exchange can serve `dtype` here (its kernel does float32 and float64)."""
        return self.world_size > 1 and dtype in KERNEL_DTYPES and kernel_available()

    def chunk_bounds(self, numel: int, element_size: int) -> list[int]:
        """Where the chunks of a tensor of `numel` elements begin and end: rank j sums chunk j."""
        return chunk_bounds(numel, element_size, self.world_size)

    def reduce_own_chunk(self, tensor: torch.Tensor, ticket: int, pieces: list[tuple[int, torch.Tensor]],
                         scale: float, sums: list[tuple[int, torch.Tensor]] = ()) -> int:
        """Split exchange, after every rank's post(tensor) (see posted_ready): each `(start, out)` of
        `pieces` lies in this rank's chunk, and `out` (contiguous) holds this rank's values for
        tensor[start:start + out.numel()]; the sum in rank order of `out * scale` and the other ranks'
        posted copies goes into `out` and into this rank's copy, for the peers to fetch. Each
        `(start, out)` of `sums` (outside every rank's chunk: chunks are being rewritten meanwhile)
        gets the plain sum, as in gather_sum(). Returns the ticket of fetch_chunks()."""
        allocation, offset = self._posted_piece(tensor, "reduce_own_chunk")
        return self._guarded(self._reduce_own_chunk, allocation, offset, tensor, ticket, pieces, scale, sums)

    def _reduce_own_chunk(self, allocation, offset, tensor, ticket, pieces, scale, sums) -> int:
        self._barrier.wait_all(ticket, "exchange", self._spin)
        self._check_same_post(allocation)
        copies = self._copies(allocation, offset, tensor)
        self._sum_into(copies, sums)
        code = KERNEL_DTYPES[tensor.dtype]
        for start, out in pieces:
            count = out.numel()
            if not out.is_contiguous() or out.dtype != tensor.dtype:
                raise ValueError(explain("reduce_own_chunk() writes contiguous pieces of the tensor's dtype",
                                         rank=self.rank, seen=f"{out.dtype}, strides {out.stride()}",
                                         expected=f"contiguous {tensor.dtype}", fix="Pass a contiguous view."))
            if count:
                addresses = tuple(copy[start:start + count].data_ptr() for copy in copies)
                sum_own_chunk(out.data_ptr(), addresses[self.rank], out.data_ptr(), addresses, count, code, scale,
                              self.rank)
        return self._barrier.arrive()  # this rank's chunk of the result is in its copy

    def fetch_chunks(self, tensor: torch.Tensor, ticket: int, pieces: list[tuple[int, int, torch.Tensor]]) -> None:
        """Split exchange, after every rank's reduce_own_chunk() (see posted_ready): copy each
        `(owner, start, out)` of `pieces` from rank `owner`'s result; then this rank is done reading."""
        allocation, offset = self._posted_piece(tensor, "fetch_chunks")
        self._guarded(self._fetch_chunks, allocation, offset, tensor, ticket, pieces)

    def _fetch_chunks(self, allocation, offset, tensor, ticket, pieces) -> None:
        self._barrier.wait_all(ticket, "exchange", self._spin)
        copies = self._copies(allocation, offset, tensor)
        for owner, start, out in pieces:
            out.copy_(copies[owner][start:start + out.numel()].view(out.shape))
        allocation.read_phase = self._barrier.arrive()  # done reading: peers may claim their copies

    def _posted_piece(self, tensor: torch.Tensor, what: str):
        found = self._locate(tensor)
        if found is None:
            raise TypeError(explain(f"{what}() takes a tensor from this communicator's alloc()", rank=self.rank,
                                    seen="a tensor outside its allocations (or not contiguous)",
                                    expected="a contiguous piece of an alloc() tensor",
                                    fix="Allocate the tensor with comm.alloc(), or use allreduce_()."))
        if self._pending:  # the worker thread would arrive at the same barrier concurrently
            self.allreduce_(torch.zeros(0), average=False, async_op=False)  # drain it (keeps the order)
        return found

    def _check_same_post(self, allocation: _Allocation) -> None:
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

    def _guarded(self, operation, *args):
        """Run one step of an exchange on this thread; a failure leaves the slots unknown: stay failed."""
        if self._error is not None:
            raise self._error
        try:
            return operation(*args)
        except BaseException as exc:
            self._error = exc
            self._barrier.abort()
            raise

    def _scratch_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        if dtype not in WIDENED:
            return None
        if self._scratch is None:
            self._scratch = torch.empty(BLOCK_BYTES // 2, dtype=torch.float32)
        return self._scratch

    def close(self) -> None:
        """Stop the worker thread. Not collective; memory is freed once no tensor of ours is left."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=5.0)
            self._worker = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def shm_communicator(process_group=None, **options) -> ShmCommunicator | None:
    """Collective: a ShmCommunicator when every rank of the group is on this host and enabled, else None.

    >>> comm = shm_communicator()                          # doctest: +SKIP
    >>> hook = shm_allreduce_hook if comm else None
    """
    try:
        return ShmCommunicator(process_group, **options)
    except ShmUnavailableError as exc:
        from .world import logger

        logger.info("shared-memory all-reduce off: %s", exc)
        return None


@prescaled
def shm_sum_prescaled_hook(state, bucket):  # unannotated, as below
    """phalanx DDP's default on one host: sum the pre-divided bucket and its step tag through shared memory.

    When the bucket's storage came from `state.alloc()` (DDP allocates it so) nothing is copied in or out.
    """
    return state.allreduce_(bucket.storage(), average=False)


# phalanx DDP may run this hook as a posted exchange on its state (post, then gather_sum straight into
# the gradients) when that moves fewer bytes: the same sums, the same bits on every rank.
shm_sum_prescaled_hook._phalanx_posted = True


def shm_allreduce_hook(state, bucket):  # unannotated: torch DDP rejects the string annotations of this module
    """DDP comm hook: average `bucket.buffer()` across ranks through shared memory.

    `state` is a ShmCommunicator; returns a torch.futures.Future holding the averaged buffer.

    >>> model.register_comm_hook(shm_communicator(), shm_allreduce_hook)   # doctest: +SKIP
    """
    return state.allreduce_(bucket.buffer())
