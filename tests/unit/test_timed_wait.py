"""A bounded wait on a collective (world/generations/waits.py timed_wait): a wait that runs out is "not yet", also when
the collective completes between the wait giving up and the check; a collective that failed raises its own error."""

from __future__ import annotations

import pytest

from phalanx.world.generation import timed_wait


class _Work:
    """A collective's work as Gloo's behaves: a timed wait raises "Operation timed out!" when it runs out."""

    def __init__(self, completes_after_timeout: bool = False, error: str | None = None):
        self.completed, self.completes_after_timeout, self.error = False, completes_after_timeout, error

    def wait(self, timeout=None):
        if self.completed:
            if self.error:
                raise RuntimeError(self.error)
            return True
        if timeout is None:
            raise AssertionError("an unbounded wait on a collective that never completes")
        if self.completes_after_timeout:
            self.completed = True  # the peer's data arrives just after the wait gave up
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return self.completed


def test_a_wait_that_runs_out_says_not_yet():
    assert timed_wait(_Work())(0.01) is False


def test_a_collective_that_completes_as_the_wait_gives_up_counts_as_done():
    assert timed_wait(_Work(completes_after_timeout=True))(0.01) is True


def test_a_collective_that_failed_as_the_wait_gave_up_raises_its_own_error():
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        timed_wait(_Work(completes_after_timeout=True, error="Connection closed by peer"))(0.01)


def test_a_collective_that_timed_out_itself_raises():
    work = _Work(error="[gloo] Timed out waiting 1800000ms for recv operation to complete")
    work.completed = True
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        timed_wait(work)(0.01)
