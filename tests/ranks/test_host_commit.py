"""Live recovery's per-step commit speaks for a host: its ranks agree in shared memory and one of them, the host's
leader, speaks for them: in the store at a generation's first step, along the speakers' tree after it, whose root
decides each step without the store (world/generations/commit.py, commit_tree.py, host_board.py).

World size 4 on this machine, hosts emulated (tests/helpers/emulated_hosts.py): 2 hosts of 2 ranks, or 1 host of 4.
The commits run back to back (generation.commit_step, as a global-batch step calls it), each rank's store operations
counted; on 2 hosts one rank never says who it is, and no commit waits for it. Then a host's leader is SIGKILLed
inside a commit, first at the first step (store alone), before its add to the store or right after it, then at a
later step (the tree), before its vote goes up or right after: the ranks left (its host's follower and the other
host) read the same outcome for that step, within a bounded time: not applied when the leader never said ready,
applied when its word completed the step; the root's leader lost once it sent "applied" to the other host and before
its own follower heard it leaves the step applied everywhere (the follower, in doubt, hears it from the others). On
one host, whose board decides without the store, a follower behind a leader that still runs but says nothing stops
with a typed error, bounded. Last, a waiting rank's looks for a step given up read nothing from the store (its
watch's alarm thread listens), and hear one given up on another host.
"""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest
import torch.distributed as dist

from phalanx.errors import MembershipError
from phalanx.testing import run_ranks
from phalanx.world import generation
from phalanx.world import group as world
from phalanx.world.generations import commit_tree
from phalanx.world.generations.host_board import HostBoard
from tests.helpers.emulated_hosts import emulate_host

STEPS = 20


class CountingStore:
    """The store, its operations counted (the commit's: the watch's threads use a connection of their own)."""

    def __init__(self, store, before_add=None):
        self.store, self.ops, self.before_add = store, collections.Counter(), before_add

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops[name] += 1
            if name == "add" and self.before_add is not None and args[1] > 0:
                self.before_add(lambda: method(*args, **kwargs))
            return method(*args, **kwargs)
        return counted


def _commits(rank: int, per_host: int, steps: int, doomed: int | None = None, when: str = "",
             silent: int | None = None) -> dict:
    emulate_host(rank, per_host)
    if rank == silent:  # never says who it is, as a member lost as a generation starts: the others' watches wait
        generation.current().watch(world.store())
    else:
        generation.announce()
    counting = CountingStore(world.store())
    if rank == doomed and steps == 1:  # the first step: through the store alone

        def die_adding(add):
            if when == "after":
                time.sleep(0.5)  # the other host added first: this add fills the counter
                add()
            os.kill(os.getpid(), signal.SIGKILL)
        counting.before_add = die_adding
    elif rank == doomed and when == "decided":  # the root, lost between the tree's word and its board's
        say = HostBoard.say

        def die_telling(board, number, yes):
            if number == steps - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            say(board, number, yes)
        HostBoard.say = die_telling
    elif rank == doomed:  # a later step: along the speakers' tree
        send = commit_tree.SocketLinks.send

        def die_voting(links, peer, tag, number, value):
            if number == steps - 1:
                if when == "after":
                    send(links, peer, tag, number, value)
                    time.sleep(0.5)  # the root decides the step meanwhile
                os.kill(os.getpid(), signal.SIGKILL)
            send(links, peer, tag, number, value)
        commit_tree.SocketLinks.send = die_voting
    dist.barrier()  # every rank set up its watch: the first commit's time is its own
    store, world.store = world.store, lambda: counting
    try:
        applied, took = [], []
        for number in range(steps):
            started = time.monotonic()
            applied.append(generation.commit_step())
            took.append(time.monotonic() - started)
            if number == 1:  # a follower maps its host's board in its first commit, a speaker reads the tree's
                counting.ops.clear()  # speakers in its second: once per generation
        if doomed is not None:  # each rank left meets the loss at its next collective and says this, first thing
            generation.current().say_applied(world.store())
        return {"applied": applied, "ops": dict(counting.ops), "first": took[0], "last": took[-1]}
    finally:
        world.store = store


@pytest.mark.parametrize("per_host", [2, 4], ids=["2-hosts-of-2", "1-host-of-4"])
def test_a_commit_costs_the_store_nothing_a_step_whatever_the_hosts(per_host):
    """Store operations per rank and step, after the second commit: none for a follower (its leader speaks for it),
    none for a speaker (the tree's root decides alone), none on one host (its board decides).
    With 2 hosts, rank 2 (the second host's first) never says who it is: the watches that read it wait for it in vain
    (up to WHO_WAIT, 30 s), and no commit waits for them, the first included."""
    silent = 2 if per_host == 2 else None
    results = run_ranks(_commits, 4, (per_host, STEPS, None, "", silent), min_world_size=2, timeout=120)
    for rank, result in enumerate(results):
        assert result["applied"] == [True] * STEPS, f"rank {rank}: {result['applied']}"
        assert result["first"] < 10, f"rank {rank}'s first commit took {result['first']:.1f} s"
        ops = sum(result["ops"].values())
        assert ops == 0, f"rank {rank} sent the store {result['ops']} in {STEPS - 2} steps"


@pytest.mark.parametrize("steps", [1, 3], ids=["first-step", "tree-step"])
@pytest.mark.parametrize("when", ["before", "after"], ids=["before-it-said-ready", "after-it-said-ready"])
def test_a_host_leader_lost_in_its_commit_leaves_the_others_one_outcome(when, steps):
    """Rank 2 leads the second host (ranks 2 and 3); it dies in the last commit. Before it said ready (its add to the
    store, or its vote up the tree) the step cannot be applied anywhere; after (the last host to add: the counter
    full; or its vote up and the root's decision), the step is applied everywhere (its follower, in doubt, hears it
    from the ranks left)."""
    results = run_ranks(_commits, 4, (2, steps, 2, when), min_world_size=2, timeout=120,
                        env={"PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    assert results[2] is None, "rank 2 was expected to die"
    outcomes = {rank: results[rank]["applied"] for rank in (0, 1, 3)}
    assert len({tuple(o) for o in outcomes.values()}) == 1, f"the ranks left disagree: {outcomes}"
    last = outcomes[0][-1]
    assert outcomes[0][:-1] == [True] * (steps - 1)
    assert last is (when == "after"), f"the step's outcome, the leader dead {when} it said ready: {last}"
    for rank in (0, 1, 3):  # found by the pid on its host, by its watcher's kept connection on the other
        assert results[rank]["last"] < 10, f"rank {rank} took {results[rank]['last']:.1f} s to learn the outcome"


def test_a_root_lost_after_its_word_went_to_the_other_host_leaves_the_step_applied_everywhere():
    """Rank 0 leads the first host and is the tree's root: it decides the last step, sends "applied" to the other
    host's leader, and is SIGKILLed before it tells its own follower. The other host applies the step; rank 1, in
    doubt (its leader ended silent), applies it too once they say so, within a bounded time."""
    results = run_ranks(_commits, 4, (2, 3, 0, "decided"), min_world_size=2, timeout=120,
                        env={"PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    assert results[0] is None, "rank 0 was expected to die"
    for rank in (1, 2, 3):
        assert results[rank]["applied"] == [True] * 3, f"rank {rank}: {results[rank]['applied']}"
        assert results[rank]["last"] < 10, f"rank {rank} took {results[rank]['last']:.1f} s to learn the outcome"


def _behind_a_stuck_leader(rank: int) -> str:
    emulate_host(rank, 2)  # one host: its board decides without the store
    generation.announce()
    board = generation.current().watch(world.store()).board()
    if rank == 0:  # stopped as it is about to tell its follower the outcome (rank 1 ends it)
        HostBoard.say = lambda self, number, yes: os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    try:
        generation.commit_step()
        return "applied"
    except MembershipError as error:
        os.kill(int(board.who(board.block[0]).split()[1]), signal.SIGKILL)
        return f"{time.monotonic() - started:.1f} s: {error}"


def test_a_follower_behind_a_leader_that_still_runs_but_says_nothing_stops_with_a_typed_error():
    """One host of 2: its leader decides without the store, so a follower cannot read the outcome elsewhere while the
    leader runs: it waits twice the membership timeout (1 s here), then raises MembershipError naming the leader."""
    results = run_ranks(_behind_a_stuck_leader, 2, min_world_size=1, timeout=60,
                        env={"PHALANX_MEMBERSHIP_TIMEOUT": "1"})
    assert results[0] is None
    assert "rank 0, which speaks for this host" in results[1] and "still running after 2 s" in results[1], results[1]
    assert float(results[1].split(" s:")[0]) < 10, results[1]


def _looks(rank: int) -> dict:
    emulate_host(rank, 1)
    generation.announce()
    watch = generation.current().watch(world.store())
    deadline = time.monotonic() + 10
    while not watch._listening and time.monotonic() < deadline:  # its alarm thread's wait is on its way
        time.sleep(0.01)
    counting = CountingStore(watch.store)
    watch.store = counting
    dist.barrier()
    quiet = [watch.troubled() for _ in range(50)]  # a rank waiting on its peers looks so every 0.1 s
    quiet_ops = sum(counting.ops.values())
    dist.barrier()
    if rank == 0:
        watch.say_trouble()
        return {"quiet": quiet, "quiet_ops": quiet_ops}
    started = time.monotonic()
    while not watch.troubled() and time.monotonic() < started + 10:
        time.sleep(0.01)
    return {"quiet": quiet, "quiet_ops": quiet_ops, "heard": time.monotonic() - started,
            "heard_ops": sum(counting.ops.values()) - quiet_ops}


def test_a_waiting_ranks_looks_ask_the_store_nothing_and_hear_a_step_given_up_at_once():
    """Two hosts of one rank: fifty looks of a healthy generation read nothing from the store (the watch's alarm
    thread listens for it), and a step given up on the other host is heard within a moment, still reading nothing."""
    results = run_ranks(_looks, 2, min_world_size=1, timeout=60)
    for rank, result in enumerate(results):
        assert result["quiet"] == [False] * 50 and result["quiet_ops"] == 0, f"rank {rank}: {result}"
    assert results[1]["heard"] < 1.0 and results[1]["heard_ops"] == 0, results[1]
