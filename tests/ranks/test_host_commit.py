"""Live recovery's per-step commit speaks for a host: its ranks agree in shared memory and one of them, the host's
leader, goes to the store (world/generations/commit.py, host_board.py).

World size 4 on this machine, hosts emulated by each rank's identity (what liveness.identity() says of its host, which
the generation's watch groups the members by): 2 hosts of 2 ranks, or 1 host of 4. The commits run back to back
(generation.commit_step, as a global-batch step calls it), each rank's store operations counted. Then a host's leader
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

from phalanx.errors import MembershipError
from phalanx.testing import run_ranks
from phalanx.world import generation, liveness
from phalanx.world import group as world
from phalanx.world.generations.host_board import HostBoard

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


def _commits(rank: int, per_host: int, steps: int, doomed: int | None = None, when: str = "") -> dict:
    liveness._host = lambda: f"emulated-host-{rank // per_host}"  # before this rank says who it is
    generation.announce()
    generation.current().watch(world.store()).board()  # set up, as by a first step's time
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
    store, world.store = world.store, lambda: counting
    try:
        applied, started = [], time.monotonic()
        for _ in range(steps):
            started = time.monotonic()
            applied.append(generation.commit_step())
        return {"applied": applied, "ops": dict(counting.ops), "last": time.monotonic() - started}
    finally:
        world.store = store


@pytest.mark.parametrize("per_host", [2, 4], ids=["2-hosts-of-2", "1-host-of-4"])
def test_a_commit_costs_the_store_a_few_operations_per_host_not_per_rank(per_host):
    results = run_ranks(_commits, 4, (per_host, STEPS), min_world_size=2, timeout=120)
    for rank, result in enumerate(results):
        assert result["applied"] == [True] * STEPS, f"rank {rank}: {result['applied']}"
        ops = sum(result["ops"].values())
        if rank % per_host:  # a follower: its leader speaks for it
            assert ops == 0, f"rank {rank} (a follower) sent the store {result['ops']}"
        else:  # an add, then a wait and a read (or, the last host to add, a set and a delete)
            assert ops <= 3 * STEPS, f"rank {rank} (its host's leader) sent the store {result['ops']} in {STEPS} steps"
    per_rank = sum(sum(r["ops"].values()) for r in results) / (4 * STEPS)
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
    liveness._host = lambda: "emulated-host-0"  # one host: its board decides without the store
    generation.announce()
    board = generation.current().watch(world.store()).board()
    if rank == 0:  # stopped as it is about to tell its follower the outcome (rank 1 ends it)
        HostBoard.say = lambda self, number, yes: os.kill(os.getpid(), signal.SIGSTOP)
    started = time.monotonic()
    try:
        generation.commit_step()
        return "applied"
    except MembershipError as error:
        os.kill(int(board.who[0].split()[1]), signal.SIGKILL)
        return f"{time.monotonic() - started:.1f} s: {error}"


def test_a_follower_behind_a_leader_that_still_runs_but_says_nothing_stops_with_a_typed_error():
    """One host of 2: its leader decides without the store, so a follower cannot read the outcome elsewhere while the
    leader runs: it waits twice the membership timeout (1 s here), then raises MembershipError naming the leader."""
    results = run_ranks(_behind_a_stuck_leader, 2, min_world_size=1, timeout=60,
                        env={"PHALANX_MEMBERSHIP_TIMEOUT": "1"})
    assert results[0] is None
    assert "rank 0, which speaks for this host" in results[1] and "still running after 2 s" in results[1], results[1]
    assert float(results[1].split(" s:")[0]) < 10, results[1]
