"""phalanx.spawn starts its ranks with the allocator phalanx chose (the shipped mimalloc on a machine without the
system's tcmalloc), tells them so, and with PHALANX_ALLOCATOR=system keeps glibc's malloc, where shard="parameters"
is warned about once on rank 0. World size 2."""

import logging
import os

import torch

import phalanx as px
from phalanx import allocator
from phalanx.log import logger
from phalanx.testing import run_ranks

NO_SYSTEM_LIBRARIES = {"PHALANX_ALLOCATOR_SEARCH": ""}  # as on a fresh machine: no tcmalloc installed


def _what_the_rank_has(rank):
    return allocator.current(), os.environ.get(allocator.CHOSEN_BY_LAUNCHER), os.environ.get("LD_PRELOAD", "")


def test_spawned_ranks_start_with_the_shipped_allocator():
    """World size 2: each rank's malloc is the library phalanx chose; a library that cannot load is not chosen."""
    chosen = allocator.choose(NO_SYSTEM_LIBRARIES)
    assert allocator.preloadable(chosen.path) if chosen else allocator.shipped_mimalloc() is None
    for have, marked, preload in run_ranks(_what_the_rank_has, 2, env=NO_SYSTEM_LIBRARIES):
        if chosen is None:  # no wheel for this platform: the system's malloc, said so
            assert marked == "system", marked
            continue
        assert (have, marked.split()[0], preload.split()[0]) == ("mimalloc", chosen.path, chosen.path)
    assert not allocator.preloadable(__file__)  # not a library: the loader would ignore it on every start


def _wrap_sharded_twice(rank):
    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger.addHandler(handler)
    os.environ.pop("PHALANX_ALLOCATOR")  # not "system" on purpose any more: as a torchrun user's process
    for _ in range(2):
        model = px.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                                           shard="parameters")
        model(torch.randn(4, 8)).sum().backward()
    return allocator.current(), [r.getMessage() for r in records if "glibc" in r.getMessage()]


def test_a_sharded_level_on_glibc_is_warned_once_on_rank_0():
    """World size 2, started on glibc's malloc (PHALANX_ALLOCATOR=system): rank 0 warns once over two wraps."""
    (have0, warned0), (have1, warned1) = run_ranks(_wrap_sharded_twice, 2, env={"PHALANX_ALLOCATOR": "system"})
    assert have0 == have1 == "glibc"
    assert len(warned0) == 1 and "shard='parameters' runs on glibc's malloc" in warned0[0], warned0
    assert "python -m phalanx.allocator" in warned0[0], warned0
    assert warned1 == [], warned1
