"""Ranks that join a run in progress (joining.py), taken in at a step every member agreed on.

At that step (the checkpointer's stop agreement counted ranks waiting to join), the first member takes the ready
joiners in, under `generation/<g>/joined/<n>` in the store; the next generation is the members and them, met by all
of them alike (current.meet). A joiner waits for that, on a generation of its own until then (current.start_solo).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from ...errors import MembershipError, explain
from ...log import logger
from .. import group as world
from .. import joining
from ..liveness import identity
from .current import Generation, current, meet, next_admission
from .settings import AWAITED_SAY_EVERY, membership_timeout


def admit_joiners() -> tuple[int, ...]:
    """Collective over the current generation, at a step every member agreed on (the checkpointer's agreement saw
    joiners waiting): the ranks ready to join are taken in, and the next generation is the members and them.
    Returns the joiners (none: nobody was ready after all)."""
    store, old = world.store(), current()
    decision = old._key("joined", next_admission())
    if old.rank == 0:
        ready = [rank for rank in joining.ready_ranks(store, world.launch_world_size()) if rank not in old.members]
        text = ",".join(map(str, ready)) or "-"
        if store.compare_set(decision, "", text) == text.encode():  # decided here (the first writer wins)
            for rank in ready:
                store.delete_key(joining.ready_key(rank))
            store.add(joining.WAITING, -len(ready))
    store.wait([decision], timedelta(seconds=membership_timeout()))
    text = store.get(decision).decode()
    joiners = tuple(int(rank) for rank in text.split(",")) if text != "-" else ()
    if not joiners:
        return ()
    members = tuple(sorted(old.members + joiners))
    if old.rank == 0:
        for rank in joiners:
            store.set(joining.admitted_key(rank), f"{old.number + 1}:{','.join(map(str, members))}:"
                                                  f"{','.join(map(str, joiners))}")
    meet(old.number + 1, members, "the ranks that train and the ones joining")
    return joiners


def join_run() -> tuple[Generation, tuple[int, ...]]:
    """A joiner: say it is ready, wait until the ranks that train take it in at a step boundary (up to
    PHALANX_JOIN_TIMEOUT), and meet them on the generation that takes it in. Returns it, and the ranks it took
    in (this one among them)."""
    store, me = world.store(), dist.get_rank()
    store.set(joining.ready_key(me), identity())
    store.add(joining.WAITING, 1)
    started = time.monotonic()
    deadline, say_at = started + joining.join_timeout(), started + AWAITED_SAY_EVERY
    while not _admitted(store, me):
        now = time.monotonic()
        if now > deadline:
            raise MembershipError(explain(
                "this rank was not taken into the run it was started to join", rank=me,
                seen=f"no answer within {joining.join_timeout():g} s ({joining.JOIN_TIMEOUT_ENV})",
                expected="the ranks that train taking it in at their next step boundary (checkpointer.step())",
                fix="The others may be stopping, or their loop does not call checkpointer.step(state); its launcher "
                    "starts it again to join."))
        if now > say_at:
            say_at += AWAITED_SAY_EVERY
            logger.info("rank %d: waiting %.0f s so far to be taken into the run at a step boundary", me,
                        now - started)
        time.sleep(0.01)
    number, members, joiners = store.get(joining.admitted_key(me)).decode().split(":")
    meet(int(number), tuple(int(rank) for rank in members.split(",")), "a joining rank")
    joining.set_pending(False)
    return current(), tuple(int(rank) for rank in joiners.split(","))


def _admitted(store, me: int) -> bool:
    try:
        if store.check([joining.admitted_key(me)]):
            return True
        if store.check([joining.CLOSED]):
            logger.warning("rank %d: %s", me, joining.RunFinished())
            raise joining.RunFinished()
        return False
    except RuntimeError as exc:  # the store's host is gone: the run ended (or its master node was lost)
        raise MembershipError(explain(
            "the run this rank was started to join ended before it was taken in", rank=me,
            seen=f"its store no longer answers ({type(exc).__name__})", expected="the run in progress",
            fix="Nothing to do if the run finished; else start it again (its newest checkpoint).")) from None
