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

    def probe(self, members) -> set[int]:
        return set(members) & self.found


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

    _in_threads(world_size, run, 30)
    return results


def _in_threads(world_size: int, run, timeout: float) -> None:
    """run(member) for every member, each in its own thread, all of them returning within `timeout` seconds."""
    threads = [threading.Thread(target=run, args=(m,)) for m in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), "a member never returned from the commit"


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


# -- from the second step on: the speakers' tree (commit_tree.py) ----------------------------------------------------


class _Mail:
    """The tree's messages between member threads: each receive takes the next message of its (sender, tag) in the
    order it was posted, as Gloo's pairs match them."""

    def __init__(self):
        self.lock = threading.Condition()
        self.sent: dict[tuple, list] = {}  # (sender, receiver, tag) -> messages
        self.posted: dict[tuple, int] = {}  # (sender, receiver, tag) -> receives posted
        self.count: dict[int, int] = {}  # member -> messages it sent and received
        # (sender, tag) or (sender, tag, receiver) whose messages never leave (a member lost meanwhile)
        self.dropped: set[tuple] = set()

    def links(self, me: int):
        mail = self

        class Links:
            address, addresses = f"member-{me}:0", {}

            def receive(self, peer, tag):
                with mail.lock:
                    box = (peer, me, tag)
                    index = mail.posted[box] = mail.posted.get(box, 0) + 1
                    mail.count[me] = mail.count.get(me, 0) + 1
                return _Letter(mail, box, index - 1)

            def send(self, peer, tag, number, value):
                with mail.lock:
                    mail.count[me] = mail.count.get(me, 0) + 1
                    if (me, tag) not in mail.dropped and (me, tag, peer) not in mail.dropped:
                        mail.sent.setdefault((me, peer, tag), []).append((number, value))
                        mail.lock.notify_all()
        return Links()

    def unanswered(self, alive) -> list:
        """Receives posted by a member left alive from a sender left alive that no message answered."""
        return [(box, count) for box, count in self.posted.items()
                if box[0] in alive and box[1] in alive and len(self.sent.get(box, [])) < count]


class _Letter:
    def __init__(self, mail, box, index):
        self.mail, self.box, self.index = mail, box, index

    def wait(self, seconds):
        with self.mail.lock:
            return self.mail.lock.wait_for(lambda: len(self.mail.sent.get(self.box, [])) > self.index, seconds)

    def value(self):
        return self.mail.sent[self.box][self.index]


class _CountingStore:
    """A HashStore that counts the operations the members send it."""

    def __init__(self):
        self.store, self.ops = dist.HashStore(), 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args):
            self.ops += 1
            return method(*args)
        return counted


def _tree_members(monkeypatch, world_size: int, act, found: set[int], mail: _Mail, store=None) -> list:
    """Run `act(member, generation, store)` for every member, each with a generation object of its own and the
    tree's messages in `mail`; `found`: the members a waiting one finds gone."""
    trouble: list = []
    monkeypatch.setenv(generation.MEMBERSHIP_TIMEOUT_ENV, "20")

    def watch(self, store):
        if "watch" not in self._watching:
            self._watching["watch"] = _Watch(found, trouble, store)
            self._watching["watch"].me = self._watching["me"]
        return self._watching["watch"]
    monkeypatch.setattr(Generation, "watch", watch)
    store, results = store or dist.HashStore(), [None] * world_size

    def run(member: int) -> None:
        members = Generation(5, tuple(range(world_size)), group=None)
        members._watching.update(me=member, links=mail.links(member))
        results[member] = act(member, members, store)

    _in_threads(world_size, run, 60)
    return results


def test_after_the_first_step_the_store_serves_no_operation_a_step_and_a_speaker_a_few_messages(monkeypatch):
    from phalanx.world.generations.commit_tree import FANOUT

    store, mail, steps, ops = _CountingStore(), _Mail(), 12, {}

    def run(member, members, store):
        applied = []
        for number in range(steps):
            applied.append(members.commit(store, number))
            ops[number] = store.ops  # the last member to pass the step sets it: all of the step's ops are in
        return applied

    world = 3 * FANOUT  # a tree of depth 2: the root, FANOUT children, the rest their children
    assert _tree_members(monkeypatch, world, run, set(), mail, store) == [[True] * steps] * world
    per_step = [ops[n] - ops[n - 1] for n in range(3, steps)]  # from step 3: past the speakers' one read
    assert max(per_step) == 0, f"store operations per step: {per_step}"
    assert max(mail.count.values()) <= 2 * (FANOUT + 1) * (steps - 1)  # at most FANOUT + 1 out and in a step
    assert mail.unanswered(set(range(world))) == []


def test_a_tree_step_a_member_could_not_apply_is_redone_by_all_and_no_receive_is_left_waiting(monkeypatch):
    mail = _Mail()

    def run(member, members, store):
        members.commit(store, 0)
        if member == 13:  # a leaf, deep in the tree
            members.fail_step(store, 1)
            return False
        return members.commit(store, 1)

    assert _tree_members(monkeypatch, 20, run, set(), mail) == [False] * 20
    assert mail.unanswered(set(range(20))) == []


def test_a_speaker_lost_before_its_vote_leaves_the_others_redoing_the_step(monkeypatch):
    found: set[int] = set()

    def run(member, members, store):
        members.commit(store, 0)
        if member == 1:  # the parent of members 9 to 16: they are in doubt, their votes went up to it
            found.add(1)
            return None
        return _then_regroup(members, store, members.commit(store, 1))

    outcomes = _tree_members(monkeypatch, 20, run, found, _Mail())
    assert outcomes[:1] + outcomes[2:] == [False] * 19


def _then_regroup(members, store, applied):
    """What a member does after the commit once a peer is lost: it meets the loss at its next collective and says,
    before it regroups, which step it applied last (agreement.py), which a member in doubt reads."""
    members.say_applied(store)
    return applied


@pytest.mark.parametrize("told", [(1,), (), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_a_root_lost_as_it_sends_its_decision_down_leaves_one_outcome_on_the_ranks_left(monkeypatch, told):
    """The root decides "applied" alone and is lost while its word goes down: it reached `told` of its children.
    The ranks it reached apply the step; the others are in doubt and apply it too once one of those says so before
    regrouping; when it reached nobody, nobody left applied it and every rank left redoes it."""
    from phalanx.world.generations.commit_tree import FANOUT

    found: set[int] = set()
    mail = _Mail()
    for child in range(1, FANOUT + 1):
        if child not in told:
            mail.dropped.add((0, "down", child))

    def run(member, members, store):
        members.commit(store, 0)
        if member == 0:
            threading.Timer(0.05, found.add, (0,)).start()  # found gone once its word went down to `told`
            return members.commit(store, 1)
        return _then_regroup(members, store, members.commit(store, 1))

    outcomes = _tree_members(monkeypatch, 20, run, found, mail)
    assert outcomes[1:] == [bool(told)] * 19


def test_tree_members_racing_to_decide_and_to_give_up_all_read_the_same_outcome(monkeypatch):
    rng = random.Random(11)
    seen = set()
    for trial in range(16):
        found: set[int] = set()
        lost, moment = rng.randrange(20), rng.choice(["before", "after"])
        failing = rng.choice([None, rng.randrange(20)])

        mail = _Mail()

        def run(member, members, store, lost=lost, moment=moment, failing=failing, found=found, mail=mail):
            members.commit(store, 0)
            if member == lost:
                if moment == "after":  # it votes, then is lost before it passes the outcome down (to some)
                    for child in rng.sample(range(20), 10):
                        mail.dropped.add((member, "down", child))
                    threading.Timer(0.01, found.add, (member,)).start()
                    return members.commit(store, 1)
                found.add(member)
                return None
            if member == failing:
                members.fail_step(store, 1)
                return _then_regroup(members, store, False)
            return _then_regroup(members, store, members.commit(store, 1))

        outcomes = _tree_members(monkeypatch, 20, run, found, mail)
        survivors = [outcome for member, outcome in enumerate(outcomes) if member != lost]
        assert len(set(survivors)) == 1, f"trial {trial} ({lost} lost {moment}, {failing} failing): {outcomes}"
        seen.add(survivors[0])
    assert seen == {True, False}


def test_a_parent_lost_after_its_vote_went_up_leaves_its_children_applying_the_step_the_root_decided(monkeypatch):
    found: set[int] = set()
    mail = _Mail()
    mail.dropped.add((1, "down"))  # member 1, the parent of 9 to 16, passes no outcome down

    def run(member, members, store):
        members.commit(store, 0)
        if member == 1:
            threading.Timer(0.05, found.add, (1,)).start()  # found gone once its vote is up
        return _then_regroup(members, store, members.commit(store, 1))

    outcomes = _tree_members(monkeypatch, 20, run, found, mail)
    assert outcomes[:1] + outcomes[2:] == [True] * 19


def test_a_rank_in_doubt_waits_for_a_member_neither_gone_nor_heard_from():
    """A member alive that has not said which step it applied holds a rank in doubt (it may have applied the step):
    the doubt ends when it says, not before."""
    store = dist.HashStore()
    members = Generation(7, (0, 1, 2), group=None)
    found: set[int] = {2}
    members._watching.update(watch=_Watch(found, [], store))
    members._watching["watch"].me = 0
    members._watching["speakers"] = ({0: 1, 1: 1, 2: 1}, {})
    said = threading.Timer(0.3, lambda: store.append(members._key("applied"), "1:4,"))
    said.start()
    started = time.monotonic()
    assert members._doubt(store, 4) is True
    assert time.monotonic() - started >= 0.25
    assert members._doubt(store, 5) is False  # member 1 applied 4, not 5; member 2 is gone
