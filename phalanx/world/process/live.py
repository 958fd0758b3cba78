"""The ranks that train now, and the barrier that waits for them all: the whole world, on torch's default group,
until ranks are lost and the others go on, or ranks join (live recovery, generation.py); then theirs, numbered again
densely in the order they had. `rank()`, `world_size()`, `is_main()`, `barrier()` and `live_group()` are about them;
the process's launch identity is identity.py's."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from ...diagnose import recorder
from ...errors import PeerDiedError, RanksTimedOutError, explain
from ...log import logger
from .. import joining, stop
from . import gloo_loops, identity
from .resources import DEFAULT_TIMEOUT, env_seconds, seconds

SHUTDOWN_WAIT = 60.0  # seconds shutdown() waits for the other ranks before leaving anyway
DEAD_CHECK_AFTER = 1.0  # seconds a barrier waits before it asks whether a missing rank's process died

_barrier_count = 0
lost_among = None  # generation.py's: which of some ranks are known gone (live recovery), for barrier()
# After a loss (live recovery, generation.py): (generation number, members' global ranks, their process group).
# None: the whole world, on torch's default group.
_live: tuple[int, tuple[int, ...], object] | None = None
_abandoned = False  # a generation's groups were left behind after a loss (set_live(abandoned=True))
# A Gloo group of the ranks that train, for phalanx's own small collectives (the checkpointer's stop agreement):
# made with the world, and anew with each generation, never in the middle of a step. A group made lazily at a
# rank's first step is made while a faster rank may already be in its next one: were that rank lost there,
# the slower one would be left connecting to it, in a call that cannot be watched or aborted.
_control = None


def group_size(group=None) -> int:
    """The size of `group` (default: the world, or after a loss the ranks left), 1 outside a torch.distributed
    world."""
    if group is None and _live is not None:
        return len(_live[1])
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """This process's rank in `group` (default: the world, or after a loss the ranks left), 0 outside a
    torch.distributed world."""
    if group is None and _live is not None:
        return _live[1].index(dist.get_rank())
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def live_group():
    """The process group of the ranks that train: None (torch's default group, the whole world) until ranks
    are lost and the others go on (live recovery), then theirs. Pass it as `group=` to a collective."""
    return None if _live is None else _live[2]


def live_members() -> tuple[int, ...]:
    """The global ranks that train: every rank of the world, or after a loss the ranks left."""
    return tuple(range(group_size())) if _live is None else _live[1]


def live_generation() -> int:
    """0, or how many times ranks were lost and the others went on (the current generation's number)."""
    return 0 if _live is None else _live[0]


def set_live(number: int, members: tuple[int, ...], group, control, abandoned: bool = False) -> None:
    """generation.py's: from now on the ranks that train are `members`, on `group` (and `control`, a Gloo group of
    theirs: control_group()). `abandoned`: the groups before were left after a loss (a collective on them may never
    end): shutdown() leaves every group to the process's exit."""
    global _live, _control, _barrier_count, _abandoned
    _abandoned = _abandoned or abandoned
    # Barriers count from 0 in each generation (their keys name it): a rank that joined counted none before.
    _live, _control, _barrier_count = (number, tuple(members), group), control, 0


def control_group():
    """A Gloo group of the ranks that train, made at init() and with each generation: phalanx's own small
    collectives run on it (None: a world of one, or before init())."""
    return _control


def abandoned() -> bool:
    """Whether a generation's groups were left behind after a loss (set_live(abandoned=True))."""
    return _abandoned


def _ranks_that_train():
    """(how many ranks train now, their control group), once init() ran: stop.stop_requested(agree=True)'s."""
    return (group_size(), _control) if identity.is_initialized() else None


stop.ranks_that_train = _ranks_that_train


def make_control_group(timeout: timedelta) -> None:
    global _control
    if dist.get_world_size() > 1:
        loops = gloo_loops.loop_threads()
        _control = dist.new_group(backend="gloo", timeout=timeout)
        gloo_loops.note(_control, loops)


def forget() -> None:
    """shutdown()'s: the whole world again, no group of phalanx's own, none abandoned."""
    global _live, _control, _abandoned
    _live = _control = None
    _abandoned = False


def rank() -> int:
    """This process's rank among the ranks that train now: 0..world_size()-1. After a loss or a join (live
    recovery) the ranks are numbered again, densely, in the order they had, as a restart would number them. A rank
    waiting to join answers its launch rank (one no other process has: never 0) until `checkpointer.restore()` takes
    it in."""
    if joining.pending() or not dist.is_initialized():
        return identity.launch_rank()
    return group_rank()


def world_size() -> int:
    """How many ranks train now: the world, or after a loss or a join (live recovery) the ranks of the run (a rank
    waiting to join: its launch world's size, until it is taken in)."""
    if joining.pending() or not dist.is_initialized():
        return identity.launch_world_size()
    return group_size()


def is_main() -> bool:
    """True on exactly one of the ranks that train: rank() 0 (after a loss of the first rank, the first of the ranks
    left), and in a process that has not joined a world."""
    if joining.pending():
        return False  # a joiner before the run took it in: its world of its own is not the run's
    return not identity.is_initialized() or rank() == 0


def barrier(timeout=None, name: str = "barrier") -> None:
    """Wait for every rank; after `timeout` seconds raise RanksTimedOutError naming the missing ranks."""
    global _barrier_count
    spec = identity.require()
    if spec.world_size == 1:
        return
    limit = seconds(timeout) if timeout is not None else seconds(env_seconds("PHALANX_TIMEOUT", DEFAULT_TIMEOUT))
    store = identity.store()
    if store is None:  # adopted group: no store of ours, fall back to the backend's barrier
        dist.barrier()
        return
    _barrier_count += 1
    members = range(spec.world_size) if _live is None else _live[1]
    key = f"{name}/{_barrier_count}" if _live is None else f"{name}/generation{_live[0]}/{_barrier_count}"
    entry = recorder.begin(recorder.BARRIER)
    store.set(f"{key}/{identity.launch_rank()}", b"1")
    arrived = store.add(key, 1)
    now = time.monotonic()
    deadline, dead_check = now + limit, now + DEAD_CHECK_AFTER
    pause = 0.0005
    while arrived < len(members):
        now = time.monotonic()
        if now > dead_check:  # a peer that died will never come: say so now, not at the deadline
            dead_check = now + 0.5
            missing = [r for r in members if not store.check([f"{key}/{r}"])]
            dead = recorder.dead_peers(missing)
            if lost_among is not None:  # live recovery: a peer on another host too, by its beacon (generation.py)
                gone = lost_among(missing)
                if gone:
                    raise PeerDiedError(explain(f"barrier '{name}' lost rank(s) {sorted(gone)}",
                                                rank=identity.launch_rank(), seen="their processes gone",
                                                expected="every rank alive",
                                                fix="The ranks left regroup and go on (live recovery)."))
            if dead:
                raise RanksTimedOutError(explain(
                    f"barrier '{name}' cannot complete", rank=identity.launch_rank(),
                    seen=f"rank(s) {sorted(dead)} ended without arriving (pid {', '.join(map(str, dead.values()))})",
                    expected="every rank alive", fix="Read the dead ranks' logs: they crashed or were killed "
                                                     "(SIGKILL usually means out of memory)."), missing_ranks=dead)
        if now > deadline:
            missing = [r for r in members if not store.check([f"{key}/{r}"])]
            raise RanksTimedOutError(explain(
                f"barrier '{name}' timed out after {limit:.0f}s", rank=identity.launch_rank(),
                seen=f"{arrived}/{len(members)} ranks arrived, missing ranks {missing}",
                expected="every rank",
                fix="Look at the missing ranks' logs: they crashed, hang, or skipped this barrier."),
                missing_ranks=missing)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = store.add(key, 0)
    recorder.done(entry)


def leave_together(name: str) -> None:
    """A barrier that never raises: a rank that is busy for long, or gone, cannot be waited for."""
    try:
        barrier(timeout=SHUTDOWN_WAIT, name=name)
    except RanksTimedOutError as exc:
        logger.warning("shutdown() did not wait for every rank: %s", exc)
    except Exception:
        pass


def keep_store_until_all_left() -> None:
    """When rank 0 hosts the store itself, it stays until every rank has seen the last barrier end."""
    spec = identity.launch_spec()
    hosts_store = spec.rank == 0 and not spec.agent_store and not recorder.dead_peers(range(spec.world_size))
    try:
        store = identity.store()
        key = f"shutdown/left/{_barrier_count}"  # unique per shutdown, like the barriers before it
        left = store.add(key, 1)
        deadline = time.monotonic() + 5.0
        while hosts_store and left < spec.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            left = store.add(key, 0)
    except Exception:
        pass
