"""Stall detection over a run directory's rings, and the report that follows a stall or a failure.

A rank makes progress when its ring changes: a collective entered or left, a phase changed, a
batch arrived. The group is stalled when no rank of this host made progress for the stall timeout.
The default, 300 s, is 6x below NCCL's 30-minute watchdog and Gloo's timeout yet above a slow first
step (torch.compile, cold caches) and the collectives of a large checkpoint; a rank in the
checkpoint phase gets CHECKPOINT_GRACE times longer, since writing a large file makes no record.
"""

from __future__ import annotations

import os
import time

from ..errors import seconds_setting
from . import stacks
from .record import H_EXITED, H_PHASE, H_PID, H_PROGRESS, H_STEP, PHASE, read_header, read_rings, ring_path
from .verdict import Verdict, judge

DEFAULT_STALL_TIMEOUT = 300.0
DDP_STALL_ENV = "PHALANX_DDP_STALL_TIMEOUT"
DEFAULT_DDP_STALL_SECONDS = 300.0  # a rank this late in DDP's collectives is reported (bucket/step_guard.py)
CHECKPOINT_GRACE = 4.0
# A rank that has not reached its first step (no ring before init(); then building the model, loading a
# checkpoint, fetching the first batch: user code that leaves no record) is starting, not stuck, while its
# process uses the CPU (importing torch on a busy machine), for up to this long after the attempt began.
STARTUP_CPU_WINDOW = 600.0
ON_STALL = ("restart", "stop", "wait")


def stall_timeout(value: float | str | None = None) -> float:
    """The stall timeout in seconds: `value`, else PHALANX_STALL_TIMEOUT, else 300 (0 turns detection off)."""
    raw = value if value is not None else os.environ.get("PHALANX_STALL_TIMEOUT", DEFAULT_STALL_TIMEOUT)
    return seconds_setting(raw, "the stall timeout is not a number of seconds",
                           expected="seconds >= 0 (0 turns stall detection off), e.g. 300",
                           fix="Fix --stall-timeout or PHALANX_STALL_TIMEOUT.")


def ddp_stall_seconds() -> float:
    """How long a rank waits in one of DDP's collectives before it reports the stall (PHALANX_DDP_STALL_TIMEOUT)."""
    return float(os.environ.get(DDP_STALL_ENV, DEFAULT_DDP_STALL_SECONDS))


class StallWatch:
    """Polls the rings of ranks `expected` in `directory`; `poll()` is True once per stall."""

    def __init__(self, directory: str, timeout: float, expected: list[int], pids: dict[int, int] | None = None):
        self.directory, self.timeout, self.expected = directory, timeout, list(expected)
        self.starting_pids = dict(pids or {})  # rank -> pid, where the launcher knows it before the ring exists
        self._progress: tuple | None = None
        self._changed = self._began = time.monotonic()
        self.fired = False

    def silent_for(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self._changed

    def poll(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        heads = [read_header(ring_path(self.directory, rank)) for rank in self.expected]
        starting = now - self._began < STARTUP_CPU_WINDOW
        progress = tuple(self._progress_of(rank, h, starting) for rank, h in zip(self.expected, heads))
        if progress != self._progress:
            self._progress, self._changed, self.fired = progress, now, False
            return False
        if self.timeout <= 0 or self.fired or all(h is not None and h[H_EXITED] for h in heads):
            return False
        saving = any(h is not None and h[H_PHASE] == PHASE["checkpoint"] for h in heads)
        if now - self._changed < self.timeout * (CHECKPOINT_GRACE if saving else 1.0):
            return False
        self.fired = True
        return True

    def _progress_of(self, rank: int, head, starting: bool):
        """What moves while `rank` makes progress: its ring's counter, and in its start-up its CPU time (not
        while it waits at init()'s rendezvous, which polls the store)."""
        if head is None:
            return _cpu_ticks(self.starting_pids.get(rank)) if starting else -1
        if starting and head[H_STEP] == 0 and head[H_PHASE] == PHASE["data"]:  # past init(), before step 1
            return head[H_PROGRESS], _cpu_ticks(head[H_PID])
        return head[H_PROGRESS]

    @property
    def stall_key(self) -> str:
        """Names the current stall (the progress counters it froze at)."""
        return repr(self._progress)

    def pids(self) -> dict[int, int]:
        found = {}
        for rank in self.expected:
            head = read_header(ring_path(self.directory, rank))
            if head is not None:
                found[rank] = head[H_PID]
        return found


def _cpu_ticks(pid: int | None) -> int:
    """CPU time the process has used so far (user + system, in clock ticks); -1 when unknown."""
    fields = stacks.stat_fields(pid) if pid is not None else None
    if not fields or len(fields) < 13:
        return -1
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)


def collect(directory: str, expected: list[int], *, pids: dict[int, int] | None = None,
            dead: dict[int, str] | None = None, elsewhere: list[int] | None = None,
            with_stacks: bool = True) -> Verdict:
    """Read the rings, ask every live rank for its stack, and judge."""
    pids = dict(pids or {})
    rings = read_rings(directory)
    for rank, snap in rings.items():
        pids.setdefault(rank, snap.pid)
    texts = {}
    if with_stacks:
        alive = {r: (pid, stacks.stack_path(directory, r)) for r, pid in pids.items()
                 if r in expected and not (dead and r in dead)}
        texts = stacks.request(alive)
    return judge(rings, expected, texts, time.monotonic_ns(), dead=dead, pids=pids, elsewhere=elsewhere)
