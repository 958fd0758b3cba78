"""All-reduce through shared memory between the ranks of one host: a memory copy instead of loopback TCP.

Every rank owns a slot in a shared segment. An all-reduce is two phases: each rank puts its tensor
in its slot and arrives; then rank r sums chunk r of every slot in rank order (one computation per
element, so every rank gets the same bits), averages it and writes it back into every slot, and
arrives again. Tensors from `alloc()` already live in a slot, so they skip the copies in and out.
The posted and split exchanges on the same allocations are in posted.py.
"""

from __future__ import annotations

import os
import queue
import threading
import traceback

import torch
import torch.distributed as dist

from .. import log
from ..errors import CollectiveMismatchError, ShmUnavailableError, explain
from .barrier import LINE_BYTES, MODE_AVERAGE, MODE_SUM, PhaseBarrier, futex_supported
from .posted import PostedExchanges, Stamp
from .reduce import BLOCK_BYTES, DTYPE_CODES, WIDENED, chunk_bounds, reduce_chunk, round_up
from .segment import PAGE, SHM_DIR, Segment, host_identity, process_start_time, sweep_stale_segments

_DEFAULT_TIMEOUT = 600.0
_DEFAULT_STAGING_BYTES = 32 * 2**20


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
        machine = facts[unable[0]]["machine"]
        return f"ranks {unable} have no writable {SHM_DIR} or no futex on {machine} (x86-64 Linux only)"
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


class ShmCommunicator(PostedExchanges):
    """All-reduce over shared memory for a process group whose ranks all run on this host.

    Collective: every rank of `process_group` constructs it together. Raises ShmUnavailableError
    (on every rank alike) when the ranks span hosts or `PHALANX_SHM=0`; `shm_communicator()`
    returns None instead. Ops must be issued in the same order on every rank, from one thread.

    >>> comm = ShmCommunicator()                    # doctest: +SKIP
    >>> grads = comm.alloc(1 << 20)                 # lives in shared memory: no copy in or out
    >>> comm.allreduce_(grads).wait()               # averaged in place, same bits on every rank
    """

    def __init__(self, process_group=None, *, staging_mb: float | None = None, timeout: float | None = None,
                 threaded: bool = True, spin_us: float = 10.0, host: str | None = None):
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.host = host  # the launcher's node these ranks run on: it names every segment
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
                segment = Segment.create(size, self.host)
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
            except Exception as exc:
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
        phase = self._barrier.arrive((self._ops, ident, code, offset, own.numel(),
                                      MODE_AVERAGE if average else MODE_SUM))
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
        """Stop the worker thread. Not collective; memory is freed once no tensor of ours is left. An all-reduce
        still in flight (one the ranks gave up after a loss, while a peer waits for ranks that left it) is
        abandoned: the peers' waits end at once, rather than at the group's timeout with this communicator, its
        memory and its process group held until then."""
        if self._worker is not None:
            with self._lock:
                in_flight = self._pending > 0
            if in_flight:
                self._barrier.abort()
            self._queue.put(None)
            self._worker.join(timeout=5.0)
            self._worker = None
        # Not used again. Its failure's traceback holds the worker's frames, and they this communicator: a cycle the
        # collector left (the failure is held outside it, by a torch Future it seems), with the segment (world size
        # x the staging slot, 128 MB at 4 ranks) mapped to the process's end. Their locals go; so does the group.
        error, self._error = self._error, None
        if error is not None:
            traceback.clear_frames(error.__traceback__)
        self.group = None

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
        log.logger.info("shared-memory all-reduce off: %s", exc)
        return None
