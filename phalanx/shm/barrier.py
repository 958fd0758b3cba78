"""Phase barriers between processes through shared memory: one cache line per rank, futex wake-ups.

Each rank only ever writes its own line (a phase counter, an abort flag and a description of the
operation it is in), so no atomic read-modify-write is needed: x86-64 keeps each rank's stores in
order (glibc's non-temporal copies end with a fence), so a peer that sees the new phase also sees
the data and description written before it. Other architectures are refused (futex_supported).
Waiters spin briefly, then sleep in futex(2) with a short timeout: asleep they cost no CPU, and
between sleeps they check that the peer they wait for is alive and that the deadline has not passed.
"""

from __future__ import annotations

import ctypes
import os
import time

from ..errors import CollectiveMismatchError, PeerDiedError, PeerFailedError, RanksTimedOutError, explain
from .segment import process_alive

LINE_BYTES = 64  # one cache line per rank: a rank's stores never invalidate a line another rank writes
_SYS_FUTEX = {"x86_64": 202, "amd64": 202}.get(os.uname().machine.lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the word is shared between processes
_WAKE_ALL = 2**31 - 1
LIVENESS_INTERVAL = 0.1  # seconds between checks that the awaited peer still runs


class Line(ctypes.Structure):
    """One rank's control line. `phase` first: its address is the futex word."""

    _fields_ = [("phase", ctypes.c_uint32), ("abort", ctypes.c_uint32), ("op", ctypes.c_uint64),
                ("alloc_id", ctypes.c_uint32), ("dtype", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("numel", ctypes.c_uint64), ("mode", ctypes.c_uint32), ("_pad", ctypes.c_uint32 * 5)]


assert ctypes.sizeof(Line) == LINE_BYTES

_DESCRIPTION = ("op", "alloc_id", "dtype", "offset", "numel", "mode")
# What an operation does with the bytes, in a line's `mode`: ranks must agree on it too.
MODE_SUM, MODE_AVERAGE, MODE_POST = 0, 1, 2


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = None
if _SYS_FUTEX is not None:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall  # ctypes releases the GIL during the call
    _syscall.restype = ctypes.c_long


def futex_supported() -> bool:
    return _syscall is not None


def futex_wait(address: int, expected: int, seconds: float) -> None:
    """Sleep while the shared 32-bit word at `address` holds `expected`, at most `seconds`."""
    # Returns at once if the word no longer holds `expected` (so a wake-up between our check and
    # the sleep cannot be lost), on a wake-up, or after `seconds`; the caller re-checks in every case.
    timeout = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT),
             ctypes.c_uint32(expected), ctypes.byref(timeout), None, ctypes.c_int(0))


def futex_wake(address: int) -> None:
    """Wake every process sleeping on the shared word at `address`."""
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
             ctypes.c_int(_WAKE_ALL), None, None, ctypes.c_int(0))


def _reached(value: int, phase: int) -> bool:
    # Phases are 32-bit and wrap: compare by distance, as TCP does with sequence numbers.
    return (value - phase) & 0xFFFFFFFF < 0x80000000


class PhaseBarrier:
    """The control lines of one communicator: `arrive()` then `wait_all()`, once per phase.

    `peers[j]` is rank j's (pid, start time), to tell a slow peer from a dead one.
    """

    def __init__(self, memory, offset: int, rank: int, peers: list[tuple[int, int]], timeout: float):
        self.rank = rank
        self.size = len(peers)
        self.peers = peers
        self.timeout = timeout
        self.lines = [Line.from_buffer(memory, offset + j * LINE_BYTES) for j in range(self.size)]
        self.addresses = [ctypes.addressof(line) for line in self.lines]
        self.own = self.lines[rank]
        self.phase = self.own.phase

    def arrive(self, description: tuple | None = None) -> int:
        """Publish this rank's next phase (and what it is doing), wake its waiters; return the phase."""
        if description is not None:
            for name, value in zip(_DESCRIPTION, description):
                setattr(self.own, name, value)
        self.phase = (self.phase + 1) & 0xFFFFFFFF
        self.own.phase = self.phase  # after the data and the description: TSO keeps this order
        futex_wake(self.addresses[self.rank])
        return self.phase

    def wait_all(self, phase: int, what: str, spin: float = 0.0, timeout: float | None = None) -> None:
        """Return once every rank reached `phase`; raise a typed error if a peer died, gave up, or the time
        (`timeout`, else the communicator's) ran out.

        `spin` seconds of polling come first: a peer already in the exchange answers within microseconds.
        """
        start = time.monotonic()
        timeout = self.timeout if timeout is None else timeout
        for j in range(self.size):
            if j != self.rank and not _reached(self.lines[j].phase, phase):
                self._wait_for(j, phase, start, what, spin, timeout)

    def _wait_for(self, j: int, phase: int, start: float, what: str, spin: float, timeout: float) -> None:
        line, address = self.lines[j], self.addresses[j]
        if spin > 0:
            spin_end = time.perf_counter() + spin
            while time.perf_counter() < spin_end:
                if _reached(line.phase, phase):
                    return
        checked = time.monotonic()
        while True:
            value = line.phase
            if _reached(value, phase):  # before the abort flags: a peer may arrive, then give up
                return
            self._check_aborts(j, what)  # cheap, and an aborting peer wakes us: notice at once
            now = time.monotonic()
            if now - checked >= LIVENESS_INTERVAL:
                checked = now
                self._check_alive(j, what)
                if now - start > timeout:
                    self._raise_timeout(phase, what, timeout)
            futex_wait(address, value, min(LIVENESS_INTERVAL, max(0.001, start + timeout - now)))

    def _check_aborts(self, awaited: int, what: str) -> None:
        for j, line in enumerate(self.lines):
            if j != self.rank and line.abort:
                self._check_alive(awaited, what)  # a peer gave up because ours died: say so
                raise PeerFailedError(explain(
                    f"rank {j} abandoned the shared-memory {what}", rank=self.rank, seen="its abort flag set",
                    expected="every rank to finish the exchange",
                    fix=f"Rank {j}'s own error explains why: see its log."),
                    peer_rank=j)

    def _check_alive(self, awaited: int, what: str) -> None:
        pid, start_time = self.peers[awaited]
        if not process_alive(pid, start_time):
            raise PeerDiedError(explain(
                f"rank {awaited} died during the shared-memory {what}", rank=self.rank,
                seen=f"process {pid} gone", expected="it to reach the same exchange",
                fix=f"Rank {awaited} crashed or was killed (out of memory? see its log or the launcher's exit codes)."),
                peer_rank=awaited)

    def _raise_timeout(self, phase: int, what: str, timeout: float) -> None:
        missing = [j for j, line in enumerate(self.lines) if not _reached(line.phase, phase)]
        raise RanksTimedOutError(explain(
            f"the shared-memory {what} timed out after {timeout:.0f}s", rank=self.rank,
            seen=f"ranks {missing} did not arrive", expected="every rank within the process group's timeout",
            fix="Those ranks are stuck elsewhere or skipped this all-reduce: every rank must issue the same "
                "all-reduces in the same order."), missing_ranks=missing)

    def check_same_operation(self) -> None:
        """After a wait: every rank must be in the same operation, on the same numbers and dtype."""
        mine = tuple(getattr(self.own, name) for name in _DESCRIPTION)
        for j, line in enumerate(self.lines):
            theirs = tuple(getattr(line, name) for name in _DESCRIPTION)
            if theirs != mine:
                seen = ", ".join(f"{n}={a}" for n, a, b in zip(_DESCRIPTION, theirs, mine) if a != b)
                wanted = ", ".join(f"{n}={b}" for n, a, b in zip(_DESCRIPTION, theirs, mine) if a != b)
                self.abort()
                raise CollectiveMismatchError(explain(
                    f"rank {j} is in a different shared-memory all-reduce than this rank", rank=self.rank,
                    seen=f"rank {j}: {seen}", expected=f"this rank's {wanted}",
                    fix="Every rank must all-reduce tensors of the same size and dtype in the same order."),
                    peer_rank=j)

    def abort(self) -> None:
        """Tell the peers this rank gives up, and wake every waiter so they notice at once."""
        self.own.abort = 1
        for address in self.addresses:
            futex_wake(address)
