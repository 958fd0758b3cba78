"""The ranks of one host agreeing on a step's commit in shared memory, so that one of them speaks for all of them in
the store (commit.py): the store's work per step grows with the hosts, not with the ranks.

A board is a small segment per host and generation: one cache line per member of the host's block (watch.py), each
written by its member only. Its first member, the leader, creates it and names it in the store; the others map it.
A follower writes its vote on step n in its line, the leader the host's outcome in its own, both as one 32-bit word:
2 (n + 1) + 1 for "ready" / "applied", 2 (n + 1) for "not". One word is one store, so nothing else needs ordering.
A waiter spins a moment (the others finish the same exchange within microseconds), then sleeps in futex(2) on the
word it waits for, and between sleeps checks that the member it waits for still runs and its own deadline.
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
BOARD_WAIT = 60.0  # seconds a follower waits for its leader to name the board (it names one, or none, at its set-up)


class _Word(ctypes.Structure):
    _fields_ = [("value", ctypes.c_uint32), ("_pad", ctypes.c_uint32 * (LINE_BYTES // 4 - 1))]


def _said(number: int, yes: bool) -> int:
    return 2 * (number + 1) + int(yes)


class HostBoard:
    """One host's board in one generation: `block`, the generation's members on this host (the leader first);
    `who`, their identities (liveness.identity), to tell a slow member from one gone."""

    def __init__(self, segment: Segment, block: tuple[int, ...], me: int, who: dict[int, str]):
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
        """Whether member j's process ended."""
        return same_host_gone(self.who[self.block[j]])

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


def open_board(key, block: tuple[int, ...], me: int, who: dict[int, str], store, stop) -> HostBoard | None:
    """This host's board in the generation whose keys `key(*parts)` names: made and named in the store by the
    leader (block[0]), mapped by the others. None: one rank on its host, or no board (the leader could not make one,
    or is gone, or `stop()` said so first): the rank then commits for itself alone. The leader always names one,
    or none, so that its followers do not wait on it."""
    if len(block) < 2:
        return None
    name_key, size = key("board", block[0]), LINE_BYTES * len(block)
    if me == block[0]:
        segment = None
        try:
            if not stop():
                segment = Segment.create(size, host_key())
        except (OSError, ValueError) as exc:
            logger.debug("rank %d made no host board (its host's ranks commit one by one): %s", me, exc)
        finally:
            store.set(name_key, segment.name if segment is not None else "")
        return HostBoard(segment, block, me, who) if segment is not None else None
    deadline = time.monotonic() + BOARD_WAIT
    while not store.check([name_key]):
        if stop() or same_host_gone(who[block[0]]) or time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    name = store.get(name_key).decode()
    if not name or stop():
        return None
    try:
        board = HostBoard(Segment.attach(name, size), block, me, who)
    except (OSError, ValueError) as exc:  # its leader's votes then wait in vain: that step fails, bounded
        logger.warning("rank %d could not map its host's board %s: %s", me, name, exc)
        return None
    board._write(ATTACHED)
    return board
