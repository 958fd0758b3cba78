"""The per-step commit, through the store: no member applies a step that another does not.

After each step's exchange, each host's ranks agree in shared memory (host_board.py: each follower votes, its leader
collects) and the leader adds its host's ranks to the step's counter (a rank alone on its host, or without a board,
adds itself); the step is applied only if the counter reaches the world size, and the leader tells its followers.
A rank whose exchange failed, or that found a peer gone while waiting, gives the step up by setting the counter
negative, with a compare-and-set from the value it read: once full the counter cannot be given up, once given up it
cannot fill, so every rank reads the same outcome; a follower whose leader is gone reads it so too. The last leader to
add knows at once and sets the step's `done` key; the others block on that key in the store (no polling) and read the
counter once woken. Whatever can end a step wakes them too: a rank that gives it up sets the key, a watcher that finds
a member gone sets the keys of the steps in flight, and a rank's own watch sets its key when a peer on its host ends
or the membership timeout passes (watch.py). Healthy, that is three store round trips per host and step (an add, the
wait, a read; the last host: an add, a set, a delete), whatever the world, none for a follower, and none at all when
one host holds the whole generation (its board's outcome is the step's: over Gloo on one host). The counters are
reused every COMMIT_SLOTS steps (they add up); one given up ends the generation, never reused.
"""

from __future__ import annotations

import time

from ...errors import MembershipError, explain
from .settings import membership_timeout

COMMIT_SLOTS = 4  # the per-step commit's counters, reused: step n's is slot n % 4's (a member is at most 1 step ahead)
GIVEN_UP = -(1 << 40)  # what a commit counter is set to when its step is given up: later adds leave it negative


class StepCommit:
    """The commit protocol of a generation (current.py's Generation): its `_key`, `world_size` and `watch`."""

    def commit(self, store, number: int) -> bool:
        """Collective over the members, through the store: True if every member is ready to apply step
        `number` of this generation, False if the step failed somewhere and is to be redone."""
        board = self.watch(store).board()
        if board is None:
            return self._commit_for(store, number, 1)
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
            return applied if applied is not None else self.fail_commit(store, number)
        deadline, watch = time.monotonic() + membership_timeout(), self.watch(store)
        votes = board.votes(number, deadline, lambda: watch.troubled())
        if all(votes):  # a host alone is the whole generation: what its ranks agreed is the outcome
            applied = board.weight == self.world_size or self._commit_for(store, number, board.weight)
        else:  # a follower that could not apply the step gave it up in the store itself; one gone did not
            applied = False if False in votes else self.fail_commit(store, number)
        board.say(number, applied)
        return applied

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
        """Give step `number` up: this rank cannot apply it (its exchange failed), or a peer is gone while this
        rank waits. Returns whether the step is applied after all: every member was ready before it was given up
        (a peer lost after it said ready), which only a rank that said ready itself can find."""
        counter, full = self._counter(number)
        count = store.add(counter, 0)
        while 0 <= count < full:  # others may add meanwhile: then try again from what they made it
            count = int(store.compare_set(counter, str(count), str(GIVEN_UP)))
        if count != full:
            store.set(self._done(number), "0")  # the others' waits for the outcome end now
        self.watch(store).say_trouble()  # the others' waits on their peers end at their next look
        return count == full

    def fail_step(self, store, number: int) -> None:
        """This rank's exchange of step `number` failed: given up in the store, and said on its host's board (its
        leader waits for its vote; the followers that said ready wait for their leader's word)."""
        self.fail_commit(store, number)
        board = self.watch(store).board(wait=False)  # a leader waiting on a vote that never comes sees the trouble
        if board is not None:
            board.say(number, False)
