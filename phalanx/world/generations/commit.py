"""The per-step commit: no member applies a step that another does not.

After each step's exchange, each host's ranks agree in shared memory (host_board.py: each follower votes, its leader
collects) and the leader speaks for its host's ranks (a rank alone on its host, or without a board, for itself): the
speaker. A host alone in the generation decides on its board, without the store (over Gloo on one host).

A generation's first step is committed through the store alone: each speaker adds its host's ranks to the step's
counter; the step is applied only if the counter reaches the world size, and the leader tells its followers. A rank
whose exchange failed, or that found a peer gone while waiting, gives the step up by setting the counter negative,
with a compare-and-set from the value it read: once full the counter cannot be given up, once given up it cannot fill,
so every rank reads the same outcome; a follower whose leader is gone reads it so too. The last speaker to add knows
at once and sets the step's `done` key; the others block on that key in the store (no polling) and read the counter
once woken. Whatever can end a step wakes them too: a rank that gives it up sets the key, a watcher that finds a
member gone sets the keys of the steps in flight, and a rank's own watch sets its key when a peer on its host ends or
the membership timeout passes (watch.py). Each speaker also writes its rank, its weight and its tree listener's
address to the generation's `speakers` key, before its add.

From the second step on, the speakers vote along a tree of fan-out 8 over connections of their own, and its root
decides alone and sends the outcome down (commit_tree.py): no store operation in a healthy step, whatever the world,
where the first step's protocol costs three a host (an add, the wait, a read). A speaker that said ready and then
cannot hear the outcome (its parent gone, or the root) is in doubt: the root may have decided "applied" and told
some of the others before it was lost. It asks the ranks left instead (_doubt): each rank that meets a loss says in
the store which step it applied last before it regroups (say_applied: agreement.py); an in-doubt rank applies the
step once any member says it applied it, and redoes it once every other member has said it did not or is known gone.
Whoever said "applied" first heard it from the tree, and a rank that said "not" changes its word only after someone
said "applied": so no two ranks left conclude apart. The ranks left compare their last applied step as they regroup
(resume_point.settle), and a difference, which only a member silent past the membership timeout can make, fails the
regroup on every rank. One step given up ends the generation; the first step's counters are reused every
COMMIT_SLOTS steps (they add up).
"""

from __future__ import annotations

import time

from ...errors import MembershipError, PeerDiedError, explain
from ...log import logger
from .. import group as world
from ..liveness import reachable_host
from .commit_tree import CommitTree, SocketLinks, read_speakers
from .settings import ORPHAN_AFTER, membership_timeout, wait_watching

COMMIT_SLOTS = 4  # the per-step commit's counters, reused: step n's is slot n % 4's (a member is at most 1 step ahead)
GIVEN_UP = -(1 << 40)  # what a commit counter is set to when its step is given up: later adds leave it negative
DOUBT_LOOK = 0.01  # seconds between an in-doubt rank's reads of the steps the others applied (after a loss only)


class StepCommit:
    """The commit protocol of a generation (current.py's Generation): its `_key`, `world_size` and `watch`."""

    def commit(self, store, number: int) -> bool:
        """Collective over the members: True if every member is ready to apply step `number` of this generation,
        False if the step failed somewhere and is to be redone."""
        applied = self._commit(store, number)
        if applied:
            self._watching["applied"] = number
        return applied

    def last_applied(self) -> int:
        """The last step of this generation this rank applied (-1: none)."""
        return self._watching.get("applied", -1)

    def say_applied(self, store) -> None:
        """Say in the store which step this rank applied last: a rank that met a loss, before it regroups, so that
        a rank in doubt about a step learns whether one left applied it (_doubt)."""
        self._say_applied(store, (self.watch(store).me,), self.last_applied())

    def _say_applied(self, store, ranks, last: int) -> None:
        store.append(self._key("applied"), "".join(f"{rank}:{last}," for rank in ranks))

    def _commit(self, store, number: int) -> bool:
        board = self.watch(store).board()
        if board is None:
            return self._speak(store, number, 1)
        if not board.leads:  # its leader speaks for it; should the leader be gone, the store says what it said
            board.say(number, True)
            waited = 2 * membership_timeout()  # the leader's own waits end within one each
            applied = board.hear(0, number, time.monotonic() + waited)
            if applied is None and board.weight == self.world_size and not board.ended(0):
                # One host decides without the store: a leader that still runs may yet say "applied"
                raise MembershipError(explain(
                    f"rank {board.block[0]}, which speaks for this host in the per-step commit, said nothing of "
                    f"step {number} of generation {self.number}", rank=board.block[board.index],
                    seen=f"its process still running after {waited:g} s", expected="its word within that time",
                    fix=f"Rank {board.block[0]} is stuck outside phalanx's bounded waits (a debugger, SIGSTOP?): "
                        "see its stack (py-spy dump). The run ends rather than guess the step's outcome."))
            if applied is not None:
                return applied
            return self._doubt(store, number) if self._tree_step(store, number) else self.fail_commit(store, number)
        deadline, watch = time.monotonic() + membership_timeout(), self.watch(store)
        votes = board.votes(number, deadline, lambda: watch.troubled())
        if all(votes):  # a host alone is the whole generation: what its ranks agreed is the outcome
            applied = board.weight == self.world_size or self._speak(store, number, board.weight)
        else:  # a follower that could not apply the step gave it up in the store itself; one gone did not
            applied = False if False in votes else self.fail_commit(store, number)
            if board.weight < self.world_size:
                self._speak(store, number, None)
        board.say(number, applied)
        return applied

    def _speak(self, store, number: int, weight: int | None) -> bool:
        """Say for `weight` ranks (this rank's host's, or its own) that they are ready to apply step `number` (None:
        they gave it up in the store already), and return the outcome: in the store at a generation's first step,
        along the speakers' tree after it."""
        tree = self._tree(store, number)
        if tree is None:
            if weight is None:
                return False
            if number == 0 and self._links() is not None:  # read by every speaker from the second step on
                store.append(self._key("speakers"), f"{self.watch(store).me}:{weight}:{self._links().address},")
            return self._commit_for(store, number, weight)
        return tree.settle(number, weight, self.world_size, lambda: self._doubt(store, number),
                           self.watch(store).say_trouble, self._tree_wait(store))

    def _tree(self, store, number: int) -> CommitTree | None:
        """This speaker's place in the tree of the generation's speakers (commit_tree.py); None at the first step,
        for a follower, or without a tree (_speakers)."""
        speakers = self._speakers(store, number)
        if speakers is None or self.watch(store).me not in speakers[0]:
            return None
        if "tree" not in self._watching:
            links = self._links()
            links.addresses = speakers[1]
            self._watching["tree"] = CommitTree(speakers[0], self.watch(store).me, links)
        return self._watching["tree"]

    def _speakers(self, store, number: int) -> tuple[dict[int, int], dict[int, str]] | None:
        """({rank: weight}, {rank: its listener's address}) of the generation's speakers, read once; None at the first
        step, or when nobody wrote the key (a world of one, one host holding the generation): then the store alone
        decides."""
        if number == 0:
            return None
        if "speakers" not in self._watching:
            key = self._key("speakers")
            self._watching["speakers"] = read_speakers(store.get(key).decode()) if store.check([key]) else None
        return self._watching["speakers"]

    def _links(self):
        """The tree's messages (commit_tree.SocketLinks: a listener of this rank's, made at its first ask); None in a
        world of one (no control group: nobody to speak to)."""
        if "links" not in self._watching:
            links = None
            if world.control_group() is not None:
                links = SocketLinks(reachable_host())
                links.me = self.watch(world.store()).me
            self._watching["links"] = links
        return self._watching["links"]

    def _tree_wait(self, store):
        deadline, troubled = time.monotonic() + membership_timeout(), self.watch(store).troubled

        def wait(arriving) -> bool:
            try:
                return wait_watching(arriving.wait, "the per-step commit", max(0.0, deadline - time.monotonic()),
                                     troubled)
            except RuntimeError as exc:  # the tree's connection to that peer ended: the store decides
                raise PeerDiedError(str(exc).splitlines()[0] if str(exc) else "a peer gone") from None
        return wait

    def _tree_step(self, store, number: int) -> bool:
        """Whether the speakers' tree decides step `number` (else the store does: a first step, one host)."""
        return self._speakers(store, number) is not None

    def _doubt(self, store, number: int) -> bool:
        """This rank (with its host's, when it speaks for them) said ready to tree step `number` and cannot hear the
        outcome: whether the step is applied, as the ranks left say (see the module docstring). Each look reads one
        key and the watch's verdicts; the members still silent are probed every ORPHAN_AFTER seconds (a member whose
        watcher was lost with it: the others say within their next collective). Past the membership timeout the step
        is redone (resume_point.settle then finds any rank that applied it and fails the regroup, never silently
        apart)."""
        watch, started = self.watch(store), time.monotonic()
        board = watch.board(wait=False)
        mine = board.block if board is not None and board.leads else (watch.me,)
        self._say_applied(store, mine, number - 1)
        watch.say_trouble()  # the others' waits on their peers end at their next look: they come to say theirs
        others, key, probed, probed_at = set(self.members) - set(mine), self._key("applied"), set(), started
        while True:
            said = _last_applied(store.get(key).decode())
            applied = any(last >= number for last in said.values())
            unknown = others - set(said) - watch.gone() - probed
            now = time.monotonic()
            if unknown and not applied and now - probed_at > ORPHAN_AFTER:
                probed_at = now
                probed |= watch.probe(unknown)
                unknown -= probed
            if applied or not unknown or now - started > membership_timeout():
                logger.warning("rank %d was in doubt about step %d of generation %d (its parent or leader lost after "
                               "its vote): %s, as the ranks left say (%.2f s)", watch.me, number, self.number,
                               "applied" if applied else "redone", now - started)
                return applied
            time.sleep(DOUBT_LOOK)

    def _commit_for(self, store, number: int, weight: int) -> bool:
        """Add `weight` ranks ready to step `number`'s counter (this rank's own, or its host's) and wait for the
        outcome."""
        counter, full = self._counter(number)
        count = store.add(counter, weight)
        if count == full:
            store.set(self._done(number), "1")  # wakes the others
            if number > 0:  # every member added to this step: each is past the wait of the one before
                store.delete_key(self._done(number - 1))
            return True
        return count > 0 and self._await_outcome(store, number)

    def _counter(self, number: int) -> tuple[str, int]:
        """Step `number`'s counter and the value that commits it: the slot's counter adds up, every step it served
        had all members in it."""
        return self._key("commit", number % COMMIT_SLOTS), self.world_size * (number // COMMIT_SLOTS + 1)

    def _done(self, number: int) -> str:
        """The key that ends the others' wait for step `number`'s outcome (set by the last member to add, or by
        whoever gives the step up)."""
        return self._key("done", number)

    def _await_outcome(self, store, number: int) -> bool:
        # One blocking wait, which the store answers when the key is set: a large world sends it no reads. The
        # watch (watch.py) sets the key from a thread of its own if this rank finds a peer gone or waits too long.
        counter, full = self._counter(number)
        with self.watch(store).awaiting(self._done(number), membership_timeout()):
            store.wait([self._done(number)])
        count = store.add(counter, 0)
        if count == full or count < 0:
            return count == full
        return self.fail_commit(store, number)

    def fail_commit(self, store, number: int) -> bool:
        """Give step `number` up: this rank cannot apply it (its exchange failed, or a member of its host is gone),
        or, at a step the store decides, a peer is gone while this rank waits. Returns whether the step is applied
        after all: every member was ready before it was given up (a peer lost after it said ready), which only a
        rank that said ready itself can find, at a step the store decides (at a tree step it is in doubt: _doubt)."""
        applied = False
        if not self._tree_step(store, number):
            applied = give_up_counter(store, *self._counter(number), self._done(number))
        self.watch(store).say_trouble()  # the others' waits on their peers end at their next look
        return applied

    def fail_step(self, store, number: int) -> None:
        """This rank's exchange of step `number` failed: given up in the store, and said on its host's board (its
        leader waits for its vote; the followers that said ready wait for their leader's word)."""
        self.fail_commit(store, number)
        board = self.watch(store).board(wait=False)  # a leader waiting on a vote that never comes sees the trouble
        if board is not None:
            board.say(number, False)
        if self._tree(store, number) is not None:  # a speaker: its tree's neighbours hear from it all the same
            self._speak(store, number, None)


def give_up_counter(store, counter: str, full: int, done: str) -> bool:
    """Give up a counter that its members each add to and that decides once full (a generation's first steps, a new
    generation's groups): set it to GIVEN_UP with a compare-and-set from the value read, unless it is full already,
    and end the others' waits on `done` if it is not. Once full it cannot be given up, once given up it cannot fill,
    so every member reads the same outcome. Returns whether it is full."""
    count = store.add(counter, 0)
    while 0 <= count < full:  # others may add meanwhile: then try again from what they made it
        count = int(store.compare_set(counter, str(count), str(GIVEN_UP)))
    if count != full:
        store.set(done, "0")  # the others' waits end now
    return count == full


def _last_applied(text: str) -> dict[int, int]:
    """The `applied` key's lines, "rank:step," each: {rank: the last step it said it applied} (a rank's word only
    grows).

    >>> _last_applied("3:4,5:3,3:5,")
    {3: 5, 5: 3}
    """
    said: dict[int, int] = {}
    for line in text.split(","):
        if line:
            rank, last = map(int, line.split(":"))
            said[rank] = max(last, said.get(rank, last))
    return said
