"""Ranks that join a run in progress, taken in at a step boundary without a restart of the ranks that train.

Under live recovery (generation.py) the ranks that train never restart for a change of membership: a node that
starts, or comes back, under `phalanx run --nnodes MIN:MAX` starts its workers with PHALANX_JOIN=1. Each gets a
global rank that this run never used (the store's counter NEXT_RANK, which starts at the first world's size), so
the ranks that train keep theirs and their order, and the joiners come after them.

torch's default process group cannot grow, and a new one cannot be made in-process beside the old one (pytorch
#55967), so a joining process makes its default group without connecting it (Gloo's lazy start: a world whose
other members it never talks to), trains nothing in it, and meets the others on groups made by name from their
members (make_group): the generations' groups. Until it is taken in, it is a world of its own (a solo generation),
where its model and loader are built as in a world of one.

The store protocol, in phalanx's namespace of the run's store:
- join/next-rank: the counter the joiners' launcher draws global ranks from (NEXT_RANK);
- join/ready/<rank>: a joiner is ready (it waits in `checkpointer.restore()`); join/waiting counts them;
- join/admitted/<rank>: the generation that took it in ("<number>:<members>"), written by that generation's
  first rank at a step every rank of the old generation agreed on.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..diagnose import progress

JOIN_ENV = "PHALANX_JOIN"
JOIN_TIMEOUT_ENV = "PHALANX_JOIN_TIMEOUT"
DEFAULT_JOIN_TIMEOUT = 300.0  # seconds a joiner waits to be taken in: the ranks that train take it at a step boundary
NEXT_RANK = "join/next-rank"
WAITING = "join/waiting"
CLOSED = "join/closed"  # the ranks that trained are done: a joiner has no run left to join
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"  # torch's switch for Gloo groups that connect a pair at its first use
SOLO = -1  # the number of a joiner's generation of its own, before it is taken in

_pending = False  # this process started as a joiner and was not taken in yet
_refused: str | None = None  # why this process's run cannot take a joiner in (a sharded model, its copies off)
_said = False  # say_taken() said it


def requested() -> bool:
    """Whether this process was started to join a run in progress (its launcher set PHALANX_JOIN=1)."""
    return os.environ.get(JOIN_ENV) == "1"


class RunFinished(SystemExit):
    """Raised by `checkpointer.restore()` in a rank that was to join a run in progress which finished first: nothing
    is left to train. A SystemExit with code 0: uncaught, the process ends quietly, and its launcher's run ends."""

    def __init__(self):
        super().__init__(0)

    def __str__(self) -> str:
        return "the run this rank was started to join finished before it was taken in: nothing is left to train"


def close(store) -> None:
    """The ranks that trained are done (the main one says so at shutdown): joiners waiting, or yet to come, leave."""
    store.set(CLOSED, "1")


def pending() -> bool:
    """Whether this process joins a run in progress and was not taken in yet."""
    return _pending


def set_pending(value: bool) -> None:
    global _pending
    _pending = value


def refuse(why: str) -> None:
    """This run cannot take a joiner in, for `why`: a node that joins makes the run save and restart instead."""
    global _refused
    if _refused is None:
        _refused = why
        progress.joins(False, why)


def say_taken() -> None:
    """This rank's loop reached its step boundary (`checkpointer.step()`, where joiners are taken in): its launcher
    may let a node join in-process from now on, unless the run refused (once per process)."""
    global _said
    if not _said and _refused is None:
        _said = True
        progress.joins(True)


def refused() -> str | None:
    """Why this run cannot take a joiner in, or None."""
    return _refused


def join_timeout() -> float:
    value = os.environ.get(JOIN_TIMEOUT_ENV)
    return float(value) if value else DEFAULT_JOIN_TIMEOUT


def ready_key(rank: int) -> str:
    return f"join/ready/{rank}"


def admitted_key(rank: int) -> str:
    return f"join/admitted/{rank}"


def count_ranks_from(store, world_size: int) -> None:
    """The first rank of the first world: the joiners' ranks are drawn from `world_size` on (once per run's store
    namespace: a restarted group counts in a namespace of its own)."""
    store.add(NEXT_RANK, world_size)


def draw_ranks(store, count: int) -> list[int]:
    """The launcher of a joining node: `count` global ranks this run never used, in order."""
    last = store.add(NEXT_RANK, count)
    return list(range(last - count, last))


def waiting(store) -> int:
    """How many joiners are ready and not yet taken in."""
    return store.add(WAITING, 0)


def ready_ranks(store, world_size: int) -> list[int]:
    """The ranks ready to be taken in (those drawn after the first world's `world_size` whose ready key is set)."""
    drawn = store.add(NEXT_RANK, 0)
    candidates = list(range(world_size, drawn))
    return [rank for rank in candidates if store.check([ready_key(rank)])]


def make_group(members, name: str, timeout: timedelta, backend: str | None = None, lazy: bool = False,
               store=None):
    """A process group of `members` (global ranks, ascending), made by its name: every member calls it with the
    same name, whatever groups each process made before (dist.new_group names a group by how many the process
    made, which differs in a joiner), and whatever the size of each one's default group. Registered with torch
    like dist.new_group's groups, so that every collective and rank query takes it. `lazy`: a Gloo group whose
    pairs connect at their first collective (gloo_lazy). `store`: where its members meet (default: the default
    group's store)."""
    members = list(members)
    default = c10d._get_default_group()
    default_backend, default_store = c10d._world.pg_map[default]
    with gloo_lazy(lazy):
        group, _ = c10d._new_process_group_helper(len(members), members.index(dist.get_rank()), members,
                                                  backend or default_backend, store or default_store, name,
                                                  timeout=timeout)
    c10d._world.pg_group_ranks[group] = {rank: index for index, rank in enumerate(members)}
    return group


def default_store():
    """The store of the default group, which make_group's groups meet on unless given another."""
    return c10d._world.pg_map[c10d._get_default_group()][1]


@contextmanager
def gloo_lazy(lazy: bool = True):
    """Gloo groups made inside connect each pair of ranks at the pair's first collective, reading only that peer's
    address from the store, not all pairs at once (TORCH_GLOO_LAZY_INIT, read as each group is made): a rank then
    connects the few peers its collectives use (2 for a ring all-reduce), where a full mesh costs each rank a read
    of every member's address, O(members^2) store reads for the group."""
    previous = os.environ.get(LAZY_ENV)
    if lazy:
        os.environ[LAZY_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LAZY_ENV, None)
        else:
            os.environ[LAZY_ENV] = previous


def connect_lazy(group) -> None:
    """Connect the pairs of a lazy Gloo group that phalanx's collectives on it use, and return once they are: each
    rank's two ring neighbours (a ring all-reduce's and all-gather's pairs: a message each way, one step, where a
    one-element all-reduce would take 2 (size - 1) steps in turn) and the broadcast tree from rank 0 (log2 size
    steps), at most 2 + log2 size peers per rank. Blocks, up to the group's timeout (a send sets its pair up in the
    caller's thread, five times that for a peer that refuses): run it where that can be waited out."""
    me, size = group.rank(), group.size()
    if size == 1:
        return
    sent, received, flag = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    works = [group.send([sent], (me + 1) % size, 0), group.recv([received], (me - 1) % size, 0),
             group.broadcast([flag], dist.BroadcastOptions())]
    for work in works:
        work.wait()


def init_unconnected(backend: str, store, rank: int, world_size: int, timeout: timedelta) -> None:
    """A joiner's default process group: rank `rank` of a world it never talks to (Gloo, not connected until used,
    which it never is), so that its global rank is `rank` in every group it makes with the others."""
    with gloo_lazy():
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    set_pending(True)
