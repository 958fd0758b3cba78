"""The step the run is at, as the checkpoints see it: the one answer to "at which step" that the StepLog follows.

`Checkpointer.restore()` says which step it restored (and a joiner's restore, which step it was taken in at);
`Checkpointer.save()` says a checkpoint is taken at the current step. Every StepLog of the process follows both,
whether or not it is in the checkpoint's state: it counts on from the restored step, and ends its window at each
save, so that a run resumed from any checkpoint logs every step in exactly one record. A StepLog made after the
restore reads `restored()`.
"""

from __future__ import annotations

import weakref
from typing import Protocol


class Follower(Protocol):
    def follow_restore(self, step: int) -> None:
        """The run was restored at `step` (its optimizer steps done so far)."""

    def follow_save(self) -> None:
        """A checkpoint is taken now, at the same step on every rank that trains."""


# (the step the last restore of this process brought it to, the Checkpointer that restored it): the step holds while
# that Checkpointer lives (a process that starts another run, with no shutdown between, was not restored).
_restored: tuple[int, weakref.ref] | None = None
_followers: weakref.WeakSet = weakref.WeakSet()


def follow(follower: Follower) -> None:
    """Tell `follower` of every restore and save from now on (held weakly)."""
    _followers.add(follower)


def restored() -> int | None:
    """The step the last restore of this process brought it to, while the Checkpointer that restored it lives; else
    None (no checkpoint restored yet)."""
    if _restored is None or _restored[1]() is None:
        return None
    return _restored[0]


def say_restored(step: int, by) -> None:
    """Checkpointer `by`'s: the state of step `step` was restored (or handed to a joiner)."""
    global _restored
    _restored = (int(step), weakref.ref(by))
    for follower in list(_followers):
        follower.follow_restore(int(step))


def say_saving() -> None:
    """The Checkpointer's: a checkpoint is taken now (on every rank that trains, at the same step)."""
    for follower in list(_followers):
        follower.follow_save()


def forget() -> None:
    """A new run in this process (after shutdown()): nothing restored yet."""
    global _restored
    _restored = None
