"""What a launcher says while it waits for the other nodes: one line every PROGRESS_EVERY seconds.

A node waits for node 0's store to answer, for the fixed --nnodes N to register (roll_call.py), or for an
elastic round to fill or to take it in (membership.py). A silent wait cannot be told from a hang, so each
says how many nodes it has of how many, which are missing, the store's address and the seconds left of
--rdzv-timeout. The lines are pure text; `Ticker` says when the next one is due.
"""

from __future__ import annotations

import sys
import time

PROGRESS_EVERY = 10.0  # seconds between two waiting lines
LISTED = 12  # ranges of node ranks named in a line at most; the others are counted


def say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


def rank_ranges(ranks, limit: int = LISTED) -> str:
    """Node ranks as ranges, at most `limit` of them named.

    >>> rank_ranges([9, 1, 3, 4, 5])
    '1, 3-5, 9'
    >>> rank_ranges(range(0, 40, 2), limit=3)
    '0, 2, 4 and 17 more'
    """
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    named = [f"{low}" if low == high else f"{low}-{high}" for low, high in spans[:limit]]
    rest = sum(high - low + 1 for low, high in spans[limit:])
    return ", ".join(named) + (f" and {rest} more" if rest else "")


def _time_left(left: float, timeout: float) -> str:
    return f"{max(0.0, left):.0f} s left of --rdzv-timeout {timeout:g} s"


def fixed_line(present: int, nnodes: int, missing, where: str, left: float, timeout: float) -> str:
    """A node of `--nnodes N` whose roll call is not complete.

    >>> fixed_line(1, 2, [1], "10.0.0.1:29500", 589.6, 600)[:66]
    'waiting for the other nodes: 1 of 2 in, missing node rank 1; store'
    """
    missing = list(missing)
    named = f"node rank{'s' if len(missing) > 1 else ''} {rank_ranges(missing)}"
    return (f"waiting for the other nodes: {present} of {nnodes} in, missing {named}; store at {where}; "
            f"{_time_left(left, timeout)}.")


def store_line(whose: str, where: str, context: str, left: float, timeout: float) -> str:
    """A node dialling the store of `whose` node (node 0, the master's), which does not answer yet.

    >>> store_line("node 0", "10.0.0.1:29500", "this is node 1 of --nnodes 2", 30, 60)[:66]
    'waiting for node 0: its store at 10.0.0.1:29500 does not answer ye'
    """
    return f"waiting for {whose}: its store at {where} does not answer yet ({context}); {_time_left(left, timeout)}."


def elastic_line(round_number: int, participants: int, waiting: int, joining: bool, min_nodes: int, max_nodes: int,
                 where: str, left: float, timeout: float) -> str:
    """A node of `--nnodes MIN:MAX` in a round not yet complete (`joining` False), or waiting for the run in
    progress to take it in (`joining` True). A run full at MAX takes it in when a node leaves, with no deadline.

    >>> elastic_line(0, 1, 0, False, 2, 3, "10.0.0.1:29500", 50, 60)[:74]
    'waiting for the other nodes: 1 node(s) in round 0, which starts with 2 (--'
    """
    nnodes = f"--nnodes {min_nodes}:{max_nodes}"
    if joining and participants >= max_nodes:
        return (f"waiting to join the run in progress: it is full ({participants} node(s) in its round "
                f"{round_number}, {nnodes}), this node takes the place of one that leaves; store at {where}.")
    if joining:
        state = (f"waiting to join the run in progress: {participants} node(s) in its round {round_number} "
                 f"({nnodes}), {waiting} waiting to join")
    else:
        state = (f"waiting for the other nodes: {participants} node(s) in round {round_number}, which starts with "
                 f"{min_nodes} ({nnodes})")
    return f"{state}; store at {where}; {_time_left(left, timeout)}."


class Ticker:
    """The clock of one wait: `due()` is True once every `every` seconds (not at the start: most waits last
    milliseconds), `left()` the seconds to the wait's end."""

    def __init__(self, timeout: float, every: float = PROGRESS_EVERY, clock=time.monotonic):
        self.clock, self.every = clock, every
        self.deadline = clock() + timeout
        self._next = clock() + every

    def left(self) -> float:
        return self.deadline - self.clock()

    def due(self) -> bool:
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.every
        return True
