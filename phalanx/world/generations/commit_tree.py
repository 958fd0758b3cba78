"""The per-step commit among hosts along a tree, so that the store takes one operation per step whatever the world.

A generation's first commit goes through the store alone (commit.py), and each rank that speaks in it for its host
(a board's leader, or a rank alone on its host) writes its rank and weight (the ranks it speaks for) to the
generation's `speakers` key first: once that commit is applied, every speaker's line is there. From the second step
on, the speakers, in rank order, form a tree of fan-out FANOUT. Each one waits for its children's votes (the ranks
ready in their subtrees), sends the sum with its own host's to its parent, and waits for the outcome to come down;
the root, once the whole world said ready, claims the step in the store with one compare-and-set and sends the
outcome down. Healthy, a speaker sends and receives at most FANOUT + 1 small messages a step, over pairs of the
generation's control group that stay connected; the store serves one operation a step.

The store stays what decides. A rank that cannot learn the outcome from the tree (a peer gone, a wait outlasting the
membership timeout) gives the step up there, with a compare-and-set from the same previous value: a step the root
claimed first stays applied, one given up first can no longer be claimed, so every member reads one outcome. Each
speaker sends exactly one message a step up to its parent and one down to each child, whichever way the step ends
(a vote or NOT_READY up, the outcome down), and receives one from each: no receive is left waiting on a peer still
alive. A member one step ahead of another is the most there can be, so a step's outcome shares one of COMMIT_SLOTS
keys with the steps COMMIT_SLOTS apart, its value naming the step.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ...errors import MembershipError, PeerDiedError, explain
from .settings import membership_timeout

FANOUT = 8  # children per speaker: a speaker's messages per step stay at most 2 (FANOUT + 1) whatever the world
NOT_READY = -1  # the vote of a subtree in which some rank cannot apply the step
_UP, _DOWN = 0x434D01, 0x434D02  # point-to-point tags on the control group: votes up, outcomes down


def tree_place(count: int, index: int) -> tuple[int | None, list[int]]:
    """(the parent, the children) of speaker `index` of `count`, as positions in rank order: a tree of fan-out
    FANOUT rooted at the first speaker.

    >>> tree_place(20, 0), tree_place(20, 1), tree_place(20, 2)
    ((None, [1, 2, 3, 4, 5, 6, 7, 8]), (0, [9, 10, 11, 12, 13, 14, 15, 16]), (0, [17, 18, 19]))
    """
    parent = None if index == 0 else (index - 1) // FANOUT
    return parent, list(range(FANOUT * index + 1, min(FANOUT * index + FANOUT + 1, count)))


def read_speakers(text: str) -> dict[int, int]:
    """The `speakers` key's lines, "rank:weight," each: {rank: weight}.

    >>> read_speakers("4:2,0:4,")
    {0: 4, 4: 2}
    """
    pairs = (line.split(":") for line in text.split(",") if line)
    return dict(sorted((int(rank), int(weight)) for rank, weight in pairs))


def outcome_value(number: int, applied: bool) -> str:
    return f"{number}:{int(applied)}"


class GlooLinks:
    """The tree's messages over point-to-point pairs of a Gloo group of the generation's `members` (group rank =
    position in `members`). A Gloo send completes once its receiver posted the receive, and a timed wait on either
    closes its pair or unbinds its buffer: a daemon thread of these links waits for each send, and for each receive
    once the commit waits for it, in turn, bounded only by twice the membership timeout (by when the commit, whose
    own wait is bounded and watched, gave the step up in the store: the generation is over). A receive posted a step
    ahead and never waited for (the run's last step) holds no thread."""

    def __init__(self, group, members: tuple[int, ...]):
        self.group, self.position = group, {member: index for index, member in enumerate(members)}
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._finish_in_turn, name="phalanx-commit-links", daemon=True).start()

    def receive(self, peer: int, tag: int):
        arriving = _Arriving(torch.zeros(2, dtype=torch.int64), self._posted)
        try:
            arriving.work = self.group.recv([arriving.values], self.position[peer], tag)
        except RuntimeError as exc:  # its pair already closed by a peer gone: waiting for it fails at once
            arriving.end(exc)
        return arriving

    def send(self, peer: int, tag: int, number: int, value: int) -> None:
        try:
            work = self.group.send([torch.tensor([number, value], dtype=torch.int64)], self.position[peer], tag)
        except RuntimeError:  # a peer already gone: the others learn the outcome from the store
            return
        self._posted.put((work, None))

    def close(self) -> None:
        self._posted.put((None, None))

    def _finish_in_turn(self) -> None:
        limit = timedelta(seconds=2 * membership_timeout())
        while True:
            work, arriving = self._posted.get()
            if work is None:
                return
            try:
                work.wait(limit)
                failed = None
            except RuntimeError as exc:
                failed = exc
            if arriving is not None:
                arriving.end(failed)


class _Arriving:
    """A message on its way: wait(seconds) until it arrived (raises what its receive raised), then value()."""

    def __init__(self, values, waiter: queue.SimpleQueue):
        self.values, self.work, self._waiter = values, None, waiter
        self._arrived, self._failed, self._asked = threading.Event(), None, False

    def end(self, failed: RuntimeError | None) -> None:
        self._failed = failed
        self._arrived.set()

    def wait(self, seconds: float) -> bool:
        if not self._asked and not self._arrived.is_set():
            self._asked = True
            self._waiter.put((self.work, self))
        if not self._arrived.wait(seconds):
            return False
        if self._failed is not None:
            raise self._failed
        return True

    def value(self) -> tuple[int, int]:
        number, value = self.values.tolist()
        return number, value


@dataclass
class CommitTree:
    """This speaker's place in the tree of a generation's speakers ({rank: weight}, in rank order)."""

    speakers: dict[int, int]
    me: int
    links: object  # GlooLinks, or a test's
    parent: int | None = field(init=False)
    children: list[int] = field(init=False)
    _posted: tuple | None = field(init=False, default=None)  # (its step, its receives): posted a step ahead

    def __post_init__(self):
        order = list(self.speakers)
        parent, children = tree_place(len(order), order.index(self.me))
        self.parent = None if parent is None else order[parent]
        self.children = [order[child] for child in children]

    def _receives(self, number: int) -> tuple[list, object]:
        """Step `number`'s receives (the children's votes, the parent's outcome), posted as the step before ended:
        a Gloo receive posted before its message is sent tells the sender so at once, and the message then goes in
        one piece, where one sent first waits for the receive to be posted, a round trip more."""
        if self._posted is not None and self._posted[0] == number:
            return self._posted[1]
        votes = [(child, self.links.receive(child, _UP)) for child in self.children]
        return votes, (self.links.receive(self.parent, _DOWN) if self.parent is not None else None)

    def settle(self, number: int, weight: int | None, world_size: int, claim, give_up, watched_wait) -> bool:
        """Step `number`'s outcome, through the tree: `weight` ranks of this speaker's host are ready (None: this
        host gave the step up in the store already). `claim()`: the root's compare-and-set of "applied" (True if it
        holds); `give_up()`: the store's give-up (True if the step was claimed first); `watched_wait(arriving)`:
        waits for a message, raising PeerDiedError once the step is given up or a member found gone, False past
        the membership timeout."""
        votes, heard = self._receives(number)
        total, sent_up = (weight if weight is not None else NOT_READY), False
        try:
            for child, arriving in votes:
                if total == NOT_READY:
                    break
                vote = self._heard(arriving, number, child, watched_wait)
                total = NOT_READY if vote == NOT_READY else total + vote
            if self.parent is None:
                applied = total == world_size and claim()
                if total not in (NOT_READY, world_size):
                    raise MembershipError(explain(
                        f"the per-step commit of step {number} counted {total} ranks ready", rank=self.me,
                        seen=f"speakers {self.speakers}", expected=f"{world_size}, the generation's members",
                        fix="This is a bug in phalanx: please report it with the run's log."))
            else:
                self.links.send(self.parent, _UP, number, total)
                sent_up = True
                applied = total != NOT_READY and self._heard(heard, number, self.parent, watched_wait) == 1
        except PeerDiedError:
            applied = give_up()
            if self.parent is not None and not sent_up:
                self.links.send(self.parent, _UP, number, NOT_READY)
        for child in self.children:
            self.links.send(child, _DOWN, number, int(applied))
        self._posted = (number + 1, self._receives(number + 1)) if applied else None  # else the generation ends
        return applied

    def _heard(self, arriving, number: int, peer: int, watched_wait) -> int:
        if not watched_wait(arriving):
            raise PeerDiedError(f"rank {peer} said nothing of step {number} within the membership timeout")
        said, value = arriving.value()
        if said != number:
            raise MembershipError(explain(
                f"rank {peer}'s word in the per-step commit was about step {said}", rank=self.me,
                seen=f"step {said}", expected=f"step {number}",
                fix="This is a bug in phalanx: please report it with the run's log."))
        return value
