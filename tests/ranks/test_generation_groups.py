"""A generation's Gloo groups (generation_group) are lazy: a rank reads from the store the addresses of the few
peers its collectives use, not every member's, and a member missing while they are made is a named error in time.

World size 8: the addresses each rank reads (the 2 of a ring all-reduce and those of a broadcast from rank 0, at
most 2 + log2(8) = 5; a full mesh reads all 8), counted by a store that wraps the run's; then a group that rank 7
never makes, with a membership timeout of 2 s.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from phalanx.errors import MembershipError
from phalanx.testing import run_ranks
from phalanx.world import joining
from phalanx.world.generations.current import generation_group

DONE = "test-generation-groups/done"


class CountingStore(dist.Store):
    """The run's store, counting the reads of each operation (Gloo's rendezvous reads a peer's address by `get`)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.ops = inner, Counter()

    def set(self, key, value):
        return self.inner.set(key, value)

    def get(self, key):
        self.ops["get"] += 1
        return self.inner.get(key)

    def add(self, key, value):
        return self.inner.add(key, value)

    def check(self, keys):
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)


def _regroups(rank: int) -> dict:
    """The store reads of a lazy generation group and of a full-mesh one; then a group that rank 7 never makes."""
    default = dist.distributed_c10d._get_default_group()
    backend, store = dist.distributed_c10d._world.pg_map[default]
    counting = CountingStore(store)
    dist.distributed_c10d._world.pg_map[default] = (backend, counting)
    try:
        members = list(range(dist.get_world_size()))
        lazy = generation_group(members, "test/lazy", backend="gloo")  # connected in it: nothing read later
        reads = {"lazy": counting.ops["get"]}
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=lazy)
        reads["later"] = counting.ops["get"] - reads["lazy"]
        eager = joining.make_group(members, "test/eager", timedelta(seconds=30), "gloo")
        reads["eager"] = counting.ops["get"] - reads["lazy"] - reads["later"]
        dist.all_reduce(total, group=eager)
    finally:
        dist.distributed_c10d._world.pg_map[default] = (backend, store)
    if rank == 7:  # never makes the next group; waits to be let go
        store.wait([DONE], timedelta(seconds=60))
        return {**reads, "total": float(total)}
    started = time.monotonic()
    try:
        generation_group(members, "test/missing")
        said = "made"
    except MembershipError as error:
        said = str(error)
    if store.add("test-generation-groups/failed", 1) == 7:
        store.set(DONE, "1")
    return {**reads, "total": float(total), "said": said, "seconds": time.monotonic() - started}


@pytest.mark.waiting(seconds=12)  # a bound on how long the others wait for a member that never makes the group
def test_a_generation_group_reads_a_few_peers_addresses_and_a_missing_member_is_named_within_the_connect_time():
    results = run_ranks(_regroups, 8, timeout=120, env={"PHALANX_MEMBERSHIP_TIMEOUT": "2"})
    assert all(r["total"] == 8 * 28 for r in results), results  # both groups all-reduce right
    assert all(r["eager"] == 8 for r in results), results  # a full mesh: every member's address (the count works)
    assert max(r["lazy"] for r in results) <= 5, results  # ring (2) + broadcast tree (log2 8)
    assert all(r["later"] == 0 for r in results), results  # the all-reduce found its pairs connected
    assert sum(r["lazy"] for r in results) < sum(r["eager"] for r in results) / 2, results
    for rank, result in enumerate(results[:7]):
        assert f"[rank {rank}] could not connect the process group test/missing" in result["said"], result
        assert "within 2 s" in result["said"], result
        assert result["seconds"] < 10, result
