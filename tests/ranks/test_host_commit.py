"""Live recovery's per-step commit speaks for a host: its ranks agree in shared memory and one of them, the host's
leader, goes to the store (world/generations/commit.py, host_board.py).

World size 4 on this machine, hosts emulated (tests/helpers/emulated_hosts.py): 2 hosts of 2 ranks, or 1 host of 4.
The commits run back to back (generation.commit_step, as a global-batch step calls it), each rank's store operations
counted; on 2 hosts one rank never says who it is, and no commit waits for it. Then a host's leader
is SIGKILLed inside a commit, before its add to the store or right after it: the ranks left (its host's follower and
the other host) read the same outcome for that step, within a bounded time: not applied when the leader's add never
came, applied when the add filled the step's counter. On one host, whose board decides without the store, a follower
behind a leader that still runs but says nothing stops with a typed error, bounded.
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
    if rank == doomed:
        adds = []

        def die(add):
            adds.append(1)
            if len(adds) == steps:  # the last commit: dies in it
                if when == "after":
                    time.sleep(0.5)  # the other host added first: this add fills the counter
                    add()
                os.kill(os.getpid(), signal.SIGKILL)
        counting.before_add = die
    dist.barrier()  # every rank set up its watch: the first commit's time is its own
    store, world.store = world.store, lambda: counting
    try:
        applied, took = [], []
        for number in range(steps):
            started = time.monotonic()
            applied.append(generation.commit_step())
            took.append(time.monotonic() - started)
            if number == 0:  # a follower maps its host's board in its first commit: once per generation
                counting.ops.clear()
        return {"applied": applied, "ops": dict(counting.ops), "first": took[0], "last": took[-1]}
    finally:
        world.store = store


@pytest.mark.parametrize("per_host", [2, 4], ids=["2-hosts-of-2", "1-host-of-4"])
def test_a_commit_costs_the_store_a_few_operations_per_host_not_per_rank(per_host):
    """Store operations per rank and step, after the first commit: none for a follower, at most 3 for a leader, none
    at all on one host. With 2 hosts, rank 2 (the second host's first) never says who it is: the watches that read
    it wait for it in vain (up to WHO_WAIT, 30 s), and no commit waits for them, the first included."""
    silent = 2 if per_host == 2 else None
    results = run_ranks(_commits, 4, (per_host, STEPS, None, "", silent), min_world_size=2, timeout=120)
    for rank, result in enumerate(results):
        assert result["applied"] == [True] * STEPS, f"rank {rank}: {result['applied']}"
        assert result["first"] < 10, f"rank {rank}'s first commit took {result['first']:.1f} s"
        ops = sum(result["ops"].values())
        if rank % per_host or per_host == 4:  # a follower (its leader speaks for it), or one host (its board decides)
            assert ops == 0, f"rank {rank} sent the store {result['ops']} in {STEPS - 1} steps"
        else:  # an add, then a wait and a read (or, the last host to add, a set and a delete)
            assert ops <= 3 * STEPS, f"rank {rank} (its host's leader) sent the store {result['ops']} in {STEPS} steps"
    per_rank = sum(sum(r["ops"].values()) for r in results) / (4 * (STEPS - 1))
    assert per_rank <= 3 / per_host, f"{per_rank:.2f} store operations per rank and step"


@pytest.mark.parametrize("when", ["before", "after"], ids=["before-its-add", "after-its-add"])
def test_a_host_leader_lost_in_its_commit_leaves_the_others_one_outcome(when):
    """Rank 2 leads the second host (ranks 2 and 3); it dies in the third commit. Before its add the step cannot be
    applied anywhere; after it (the last host to add: the counter full), the step is applied everywhere."""
    steps = 3
    results = run_ranks(_commits, 4, (2, steps, 2, when), min_world_size=2, timeout=120,
                        env={"PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    assert results[2] is None, "rank 2 was expected to die"
    outcomes = {rank: results[rank]["applied"] for rank in (0, 1, 3)}
    assert len({tuple(o) for o in outcomes.values()}) == 1, f"the ranks left disagree: {outcomes}"
    last = outcomes[0][-1]
    assert outcomes[0][:-1] == [True] * (steps - 1)
    assert last is (when == "after"), f"the step's outcome, the leader dead {when} its add: {last}"
    for rank in (0, 1, 3):  # found by the pid on its host, by its watcher's kept connection on the other
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
