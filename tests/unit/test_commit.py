"""The per-step commit of live recovery (world/generations/commit.py): the members of a generation, as threads on one
store, apply a step only all together; a step given up (an exchange that failed, a peer gone) is applied by none of
them, unless every member had said ready first, and then by all of them."""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager

import pytest
import torch.distributed as dist

from phalanx.world import generation
from phalanx.world.generation import COMMIT_SLOTS, Generation


class _Watch:
    """A generation's watch (watch.py) as the test makes it: the members found gone are the test's, a step given up
    counts as trouble for every member, and a member blocked on a commit's outcome is woken once one is found gone."""

    def __init__(self, found: set[int], trouble: list, store):
        self.found, self.trouble, self.store = found, trouble, store

    def board(self, wait: bool = True):
        """No host board: each member commits for itself in the store (the protocol a board's leader speaks)."""
        return None

    @contextmanager
    def awaiting(self, key: str, seconds: float):
        waiting = threading.Event()
        waiting.set()

        def wake_when_found():
            deadline = time.monotonic() + seconds
            while waiting.is_set():
                if self.found or time.monotonic() > deadline:
                    self.store.set(key, "0")
                    return
                time.sleep(0.005)

        threading.Thread(target=wake_when_found, daemon=True).start()
        try:
            yield
        finally:
            waiting.clear()

    def troubled(self) -> bool:
        return bool(self.found) or bool(self.trouble)

    def gone(self) -> set[int]:
        return set(self.found)

    def say_trouble(self) -> None:
        self.trouble.append(1)


@pytest.fixture
def gone(monkeypatch):
    """The members a waiting member finds gone (the watch's answer, made by the test)."""
    found: set[int] = set()
    trouble: list = []
    monkeypatch.setattr(Generation, "watch", lambda self, store: _Watch(found, trouble, store))
    monkeypatch.setenv(generation.MEMBERSHIP_TIMEOUT_ENV, "20")
    return found


def _given_up(members: Generation, store, number: int) -> bool:
    return store.add(members._counter(number)[0], 0) < 0


def _members(world_size: int, act) -> list:
    """Run `act(member, generation, store)` for every member, each in its own thread; their results in order."""
    store, results = dist.HashStore(), [None] * world_size
    members = Generation(3, tuple(range(world_size)), group=None)

    def run(member: int) -> None:
        results[member] = act(member, members, store)

    threads = [threading.Thread(target=run, args=(m,)) for m in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a member never returned from the commit"
    return results


def test_healthy_steps_commit_on_every_member_and_keep_no_key_per_step(gone):
    store_keys = []

    def steps(member, members, store):
        committed = [members.commit(store, number) for number in range(4 * COMMIT_SLOTS + 1)]
        store_keys.append(store.num_keys())
        return committed

    assert _members(3, steps) == [[True] * (4 * COMMIT_SLOTS + 1)] * 3
    # one counter per slot, and the done keys of the last two steps at most: nothing piles up per step
    assert max(store_keys) <= COMMIT_SLOTS + 2


def test_a_member_whose_exchange_failed_makes_every_member_redo_the_step(gone):
    def step(member, members, store):
        members.commit(store, 0)
        return members.fail_commit(store, 1) if member == 2 else members.commit(store, 1)

    assert _members(3, step) == [False, False, False]


def test_a_member_that_adds_after_the_step_was_given_up_does_not_apply_it(gone):
    store, members = dist.HashStore(), Generation(0, (0, 1), group=None)
    assert not members.fail_commit(store, 0)  # member 1 gives up first
    assert _given_up(members, store, 0)
    assert not members.commit(store, 0)  # member 0 says ready after: no commit


def test_a_peer_lost_after_every_member_said_ready_leaves_the_step_applied(gone):
    store, members = dist.HashStore(), Generation(0, (0, 1, 2), group=None)
    store.add(members._counter(0)[0], 2)  # members 1 and 2 said ready (and 1 applied it, then was lost)
    assert members.commit(store, 0)  # member 0 completes it: applied
    assert members.fail_commit(store, 0)  # a waiter that found member 1 gone after that applies it too
    assert not _given_up(members, store, 0)


def test_a_waiter_that_finds_a_peer_gone_gives_the_step_up_for_everyone(gone):
    def step(member, members, store):
        if member == 2:  # lost before it said ready
            gone.add(2)
            return None
        return members.commit(store, 0)

    assert _members(3, step)[:2] == [False, False]


def test_members_racing_to_commit_and_to_give_up_all_read_the_same_outcome(gone):
    rng = random.Random(7)
    seen = set()
    for trial in range(60):
        gone.clear()
        said_ready = rng.random() < 0.5

        def step(member, members, store, said_ready=said_ready):
            if member == 3:  # lost at a moment of its own, before or after it said ready
                if said_ready:
                    store.add(members._counter(0)[0], 1)
                gone.add(3)
                return None
            if member == 2 and rng.random() < 0.3:
                return members.fail_commit(store, 0)  # its exchange failed too
            return members.commit(store, 0)

        outcomes = _members(4, step)[:3]
        assert len(set(outcomes)) == 1, f"trial {trial}: members disagree: {outcomes}"
        seen.add(outcomes[0])
    assert seen == {True, False}  # both outcomes were reached
