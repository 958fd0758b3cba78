"""The ranks of one host agreeing on a step's commit in shared memory, so that one of them speaks for all of them in
the store (commit.py): the store's work per step grows with the hosts, not with the ranks.

A board is a small segment per host and generation: one cache line per member of the host's block (host_block: the
members its launcher started there, known without asking anyone), each written by its member only. Its first member, the
leader, creates it and names it in the store as its generation starts; the others map it at their first commit, by
when the leader, whose exchange they just shared, has named it. A follower writes its vote on step n in its line, the
leader the host's outcome in its own, both as one 32-bit word: 2 (n + 1) + 1 for "ready" / "applied", 2 (n + 1) for
"not". One word is one store, so nothing else needs ordering. A waiter spins a moment (the others finish the same
exchange within microseconds), then sleeps in futex(2) on the word it waits for, and between sleeps checks that the
member it waits for still runs and its own deadline. No wait reads another host's member: a host lost as a generation
starts costs no commit anything.
"""

from __future__ import annotations

import ctypes
import threading
import time

from ...log import logger
from ...shm.barrier import LINE_BYTES, futex_wait, futex_wake
from ...shm.segment import Segment
from ..liveness import same_host_gone
from ..topology import host_key

ATTACHED = 1  # a follower's word once it mapped the board (below every vote: the leader may unlink the name)
SPIN = 20e-6  # seconds of polling before a wait sleeps
LOOK_EVERY = 0.1  # seconds between a sleeping waiter's looks at the member it waits for and at its deadline
NAME_POLL = 0.002  # seconds before a follower reads its board's name again (then twice that, up to LOOK_EVERY)


class _Word(ctypes.Structure):
    _fields_ = [("value", ctypes.c_uint32), ("_pad", ctypes.c_uint32 * (LINE_BYTES // 4 - 1))]


def _said(number: int, yes: bool) -> int:
    return 2 * (number + 1) + int(yes)


def launched_here(me: int, local_rank: int, local_world_size: int, slurm_gtids: str | None = None) -> set[int]:
    """The launch ranks started on `me`'s host: under srun as slurmstepd lists them (SLURM_GTIDS, whatever srun's
    distribution); else the `local_world_size` from `me - local_rank` on (phalanx run and torchrun number a node's
    workers so, and a joining node's ranks are drawn so).

    >>> sorted(launched_here(4, 1, 3)), sorted(launched_here(5, 1, 2, "1,5"))
    ([3, 4, 5], [1, 5])
    """
    if slurm_gtids:
        return {int(rank) for rank in slurm_gtids.split(",")}
    return set(range(me - local_rank, me - local_rank + local_world_size))


def host_block(members: tuple[int, ...], here: set[int]) -> tuple[int, ...]:
    """The members on this host (`here`: launched_here), in rank order: the first leads.

    >>> host_block((0, 1, 3, 4, 5), {3, 4, 5}), host_block((0, 1, 2), {1})
    ((3, 4, 5), (1,))
    """
    return tuple(member for member in members if member in here)


class HostBoard:
    """One host's board in one generation: `block`, the generation's members on this host (the leader first);
    `who(member)`, a member's identity (liveness.identity) or None if not said yet, to tell a slow member from one
    gone."""

    def __init__(self, segment: Segment, block: tuple[int, ...], me: int, who):
        self.segment, self.block, self.who = segment, block, who
        self.index = block.index(me)
        self._words = [_Word.from_buffer(segment.memory, j * LINE_BYTES) for j in range(len(block))]
        self._named = self.index == 0  # the leader's segment still has its name in /dev/shm
        self._lock = threading.Lock()

    @property
    def leads(self) -> bool:
        """Whether this rank speaks for its host in the store."""
        return self.index == 0

    @property
    def weight(self) -> int:
        """What the leader adds to a step's counter: one per member of its host."""
        return len(self.block)

    def say(self, number: int, yes: bool) -> None:
        """A follower's vote on step `number` (ready or not), or the leader's outcome for its host."""
        self._write(_said(number, yes))

    def _write(self, value: int) -> None:
        word = self._words[self.index]
        word.value = value
        futex_wake(ctypes.addressof(word))

    def hear(self, j: int, number: int, deadline: float, give_up=lambda: False) -> bool | None:
        """Member j's word on step `number` (True: ready or applied); None when its process ended, `deadline`
        (time.monotonic) passed, or `give_up()`, asked between sleeps, said so first."""
        word, wanted = self._words[j], _said(number, False)
        spin_end = time.perf_counter() + SPIN
        while time.perf_counter() < spin_end:
            if word.value >= wanted:
                return word.value == wanted + 1
        looked = time.monotonic()  # the first look comes after a sleep: a healthy step asks nobody anything
        while True:
            value = word.value
            if value >= wanted:
                return value == wanted + 1
            now = time.monotonic()
            if now >= deadline or (now - looked >= LOOK_EVERY and self._look_says_stop(j, give_up)):
                value = word.value  # what it said just before it ended stands: the others may have read it
                return value == wanted + 1 if value >= wanted else None
            if now - looked >= LOOK_EVERY:
                looked = now
            futex_wait(ctypes.addressof(word), value, max(0.001, min(LOOK_EVERY, deadline - now)))

    def ended(self, j: int) -> bool:
        """Whether member j's process ended (one that never said who it is never reached a commit: not ended)."""
        who = self.who(self.block[j])
        return who is not None and same_host_gone(who)

    def _look_says_stop(self, j: int, give_up) -> bool:
        return self.ended(j) or give_up()

    def votes(self, number: int, deadline: float, give_up) -> list[bool | None]:
        """The leader: every follower's vote on step `number` (see hear). Once all voted, the board's name goes
        from /dev/shm: every follower mapped it."""
        heard = [self.hear(j, number, deadline, give_up) for j in range(1, len(self.block))]
        if self._named and all(vote is not None for vote in heard):
            self._named = False
            self.segment.unlink()
        return heard

    def close(self) -> None:
        """Unmap (and unlink, on the leader): the generation ended."""
        with self._lock:
            if self._named:
                self._named = False
                self.segment.unlink()
            words, self._words = self._words, []
            del words
            try:
                self.segment.memory.close()
            except (BufferError, ValueError):  # a wait still holds a word: the mapping goes with the process
                pass


def create_board(key, block: tuple[int, ...], me: int, who, store) -> HostBoard | None:
    """The leader (block[0]), as its generation starts: its host's board, made and named in the store under
    `key("board", me)`. It always names one, or none (""), so that no follower waits on it."""
    segment = None
    try:
        segment = Segment.create(LINE_BYTES * len(block), host_key())
    except (OSError, ValueError) as exc:
        logger.debug("rank %d made no host board (its host's ranks commit one by one): %s", me, exc)
    try:
        store.set(key("board", me), segment.name if segment is not None else "")
    except Exception:  # the store gone with the run: leave no segment behind
        if segment is not None:
            segment.unlink()
        raise
    return HostBoard(segment, block, me, who) if segment is not None else None


def attach_board(key, block: tuple[int, ...], me: int, who, store, deadline: float, give_up) -> HostBoard | None:
    """A follower, at its first commit: its leader's board, mapped. None (the rank then commits for itself alone):
    the leader named none, or ended, or `give_up()` (asked between looks) or `deadline` (time.monotonic) came first
    (the leader's first commit then waits for this rank's vote in vain and gives the step up, bounded)."""
    leader, name_key = block[0], key("board", block[0])
    looked, pause = time.monotonic(), NAME_POLL
    while not store.check([name_key]):  # named as the leader's generation started: found at once when healthy
        now = time.monotonic()
        if now - looked >= LOOK_EVERY:
            looked = now
            leader_who = who(leader)
            why = ("its process ended" if leader_who is not None and same_host_gone(leader_who) else
                   "the membership timeout passed" if now >= deadline else
                   "the generation is ending" if give_up() else None)
            if why is not None:
                logger.warning("rank %d: rank %d, which speaks for this host in the per-step commit, named no board "
                               "(%s): this rank commits for itself", me, leader, why)
                return None
        time.sleep(pause)
        pause = min(LOOK_EVERY, 2 * pause)
    name = store.get(name_key).decode()
    if not name:
        return None
    try:
        board = HostBoard(Segment.attach(name, LINE_BYTES * len(block)), block, me, who)
    except (OSError, ValueError) as exc:  # its leader's votes then wait in vain: that step fails, bounded
        logger.warning("rank %d could not map its host's board %s: %s", me, name, exc)
        return None
    board._write(ATTACHED)
    return board
