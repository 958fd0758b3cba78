"""The per-step commit, through the store: no member applies a step that another does not.

After each step's exchange, every rank adds 1 to the step's counter; the step is applied only if the counter reaches
the world size. A rank whose exchange failed, or that found a peer gone while waiting, gives the step up by setting
the counter negative, with a compare-and-set from the value it read: once full the counter cannot be given up, once
given up it cannot fill, so every rank reads the same outcome. The last rank to add knows at once and sets the step's
`done` key; the others block on that key in the store (no polling) and read the counter once woken. Whatever can end
a step wakes them too: a rank that gives it up sets the key, a watcher that finds a member gone sets the keys of the
steps in flight, and a rank's own watch sets its key when a peer on its host ends or the membership timeout passes
(watch.py). Healthy, that is three store round trips per rank and step (an add, the wait, a read; the last rank: an
add, a set, a delete), whatever the world. The counters are reused every COMMIT_SLOTS steps (they add up); one given
up ends the generation, never reused.
"""

from __future__ import annotations

from .settings import membership_timeout

COMMIT_SLOTS = 4  # the per-step commit's counters, reused: step n's is slot n % 4's (a member is at most 1 step ahead)
GIVEN_UP = -(1 << 40)  # what a commit counter is set to when its step is given up: later adds leave it negative


class StepCommit:
    """The commit protocol of a generation (current.py's Generation): its `_key`, `world_size` and `watch`."""

    def commit(self, store, number: int) -> bool:
        """Collective over the members, through the store: True if every member is ready to apply step
        `number` of this generation, False if the step failed somewhere and is to be redone."""
        counter, full = self._counter(number)
        count = store.add(counter, 1)
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
