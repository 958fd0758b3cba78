"""Each bucket's path across hosts (phalanx/exchange/hierarchical.py): two levels, or the flat all-reduce.
Single process, pure: the exchange's plan is built with a stand-in communicator, no process group."""

from types import SimpleNamespace

import pytest
import torch

from phalanx.exchange.hierarchical import MEASURED, HierarchicalExchange, path_seconds, two_level
from phalanx.shm.reduce import chunk_bounds


def test_a_tiny_bucket_goes_flat_and_a_large_one_in_two_levels():
    """At the measured constants: a 4 KB bias is cheaper flat (the shared-memory phases' fixed 0.42 ms
    outweigh the bytes saved); a 4 MiB bucket saves more bytes than the memory phases cost."""
    for hosts, local in ((2, 2), (4, 2), (2, 8)):
        assert not two_level(4096, hosts, local)
        assert two_level(4 * 2**20, hosts, local)
    cost = path_seconds(4096, 2, 2, MEASURED)
    assert cost["flat"] < cost["hier"]


def test_the_choice_is_a_size_threshold():
    """Once a size goes in two levels, every larger size does too (no flip-flopping between sizes)."""
    sizes = [2**k for k in range(6, 26)]
    choices = [two_level(size, 2, 2) for size in sizes]
    first = choices.index(True)
    assert not any(choices[:first]) and all(choices[first:])


def _exchange(local_rank: int, local: int, hosts: int, per_bucket: bool) -> HierarchicalExchange:
    """An exchange as rank `local_rank` of its host builds it (no process group: only what prepare() reads)."""
    exchange = HierarchicalExchange.__new__(HierarchicalExchange)
    exchange.comm = SimpleNamespace(rank=local_rank, world_size=local,
                                    chunk_bounds=lambda numel, size: chunk_bounds(numel, size, local))
    exchange.hosts, exchange.per_bucket, exchange._plans = hosts, per_bucket, {}
    return exchange


def _buckets(numels: list[int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(index=i, sparse=False, numel=n, storage=torch.zeros(n + 1)) for i, n in enumerate(numels)]


@pytest.mark.parametrize("per_bucket", [True, False])
def test_every_rank_plans_the_same_paths(per_bucket):
    """Every local rank (and every host: the plan reads only sizes and the topology) sends the same buckets
    flat, so all ranks issue the same collectives in the same order; PHALANX_XHOST=hier (per_bucket=False)
    sends every bucket in two levels."""
    numels = [1024, 2**20, 16, 256 * 256, 8]  # 4 KB, 4 MiB, 64 B, 256 KB, 32 B
    buckets = _buckets(numels)
    paths = set()
    for local_rank in range(2):
        exchange = _exchange(local_rank, local=2, hosts=2, per_bucket=per_bucket)
        exchange.prepare(buckets)
        paths.add(tuple(exchange._flat(b) for b in buckets))
    assert len(paths) == 1
    flat = paths.pop()
    assert flat == ((True, False, True, False, True) if per_bucket else (False,) * 5)
