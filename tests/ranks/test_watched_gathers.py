"""generation.all_gather_objects (world/generations/waits.py) on 4 ranks over Gloo: every rank's object in rank order,
whatever its size, as dist.all_gather_object gives it; and under live recovery, ranks gathering with a peer that went
elsewhere when a rank was lost end the gather within seconds, with a loss they regroup from, where
dist.all_gather_object waits for the group's timeout (a sharded chaos run caught a rank so, minutes long, in a save)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.testing import run_ranks
from phalanx.world import generation
from phalanx.world import group as world


def _gathered(rank: int):
    mine = {"rank": rank, "words": "x" * (1000 * rank), "tensor": torch.arange(rank + 1)}
    everyone = generation.all_gather_objects(mine, None, "a test's objects")
    return [(entry["rank"], len(entry["words"]), entry["tensor"].tolist()) for entry in everyone]


def test_every_rank_gets_every_object_in_rank_order():
    expected = [(r, 1000 * r, list(range(r + 1))) for r in range(4)]
    assert run_ranks(_gathered, 4, timeout=60) == [expected] * 4


def _lost_while_others_gather(rank: int):
    """Ranks 0 and 1 gather on a group of 0, 1 and 2; rank 2 never comes (it went on to regroup, as a rank does that
    met the loss elsewhere), and rank 3 is SIGKILLed: nothing in the gather's own connections fails, only the watch
    can tell them the generation is ending."""
    generation.announce()
    trio = dist.new_group([0, 1, 2])
    dist.barrier()  # every rank said who it is: the watches can tell one gone
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    store = world.store()
    if rank == 2:  # away until the others are done (its exit would end their gather: at most 30 s)
        try:
            store.wait(["gathered/0", "gathered/1"], timedelta(seconds=30))
        except RuntimeError:
            pass
        return None
    started = time.monotonic()
    try:
        generation.all_gather_objects({"rank": rank}, trio, "a test's objects")
    except Exception as failure:  # which failure it is, is the test's to check
        got = {"loss": generation.is_loss(failure), "seconds": time.monotonic() - started, "what": repr(failure)}
    else:
        got = {"loss": False, "seconds": time.monotonic() - started, "what": "it completed"}
    store.set(f"gathered/{rank}", "1")
    return got


def test_ranks_gathering_when_a_peer_is_lost_elsewhere_end_with_a_loss_within_seconds():
    results = run_ranks(_lost_while_others_gather, 4, timeout=120, min_world_size=2,
                        env={"PHALANX_MEMBERSHIP_TIMEOUT": "60"})
    assert results[3] is None, "rank 3 was expected to die"
    for rank in (0, 1):
        got = results[rank]
        assert got["loss"], f"rank {rank}: {got}"
        assert got["seconds"] < 10, f"rank {rank} waited {got['seconds']:.1f} s: {got}"
