"""Recovery from a lost rank in-process: the survivors agree on the next generation (agreement.py), and every model
and loader that follows the generations regroups onto it (followers.py). Whether a loss is recovered so or by a restart
is said once per process (say_mode)."""

from __future__ import annotations

import time

from ...diagnose import progress
from ...diagnose.watch import ddp_stall_seconds
from ...errors import PeerFailedError
from ...log import logger
from .. import group as world
from .. import joining, resume_point
from ..process import gloo_loops
from .agreement import next_generation
from .current import Generation, current
from .followers import regroup_followers
from .settings import (
    MEMBERSHIP_MARGIN,
    MEMBERSHIP_TIMEOUT_ENV,
    MIN_WORLD_ENV,
    live_recovery,
    membership_timeout,
    min_world_size,
)
from .waits import peer_gone, wait_for

_undoing = False  # during recover(undone=True)


def recover(cause: BaseException, redoing: bool = False, undone: bool = False) -> Generation:
    """Collective over the survivors of a loss: the next generation (next_generation), then every model and
    loader that follows the generations regrouped onto it. `redoing`: the step in flight starts over (for the
    launcher's run summary). `undone`: the step whose micro-batch loop ended last was rolled back (a sharded
    optimizer's step that could not count everywhere): the loaders hand it out again (undoing())."""
    global _undoing
    started, old = time.monotonic(), current()
    before = old.members
    # The generation's groups are left from here: a collective pending on them may spin Gloo's loop (gloo_loops.py)
    gloo_loops.idle((old.group, world.control_group()))
    survivors = next_generation(cause)
    # A rank behind takes what others finished; every rank applied the same steps of the generation before
    resume_point.settle(world.control_group(), survivors.rank, wait_for, old.last_applied())
    _undoing = undone
    try:
        regroup_followers(survivors.number, survivors.members, sorted(set(before) - set(survivors.members)),
                          started, redoing)
    finally:
        _undoing = False
    return survivors


def undoing() -> bool:
    """During recover(): whether the step last finished by the loop is to be redone (see recover's `undone`)."""
    return _undoing


def is_loss(failure: BaseException) -> bool:
    """Whether `failure` is a peer lost that the ranks left recover from (live recovery on)."""
    return live_recovery() and (isinstance(failure, PeerFailedError) or peer_gone(failure))


def again_after_loss(action, warning: str | None = None, what: str = "a collective", like=None):
    """`action()`, a collective (`what` it is); with live recovery, when a peer is lost during it (PeerFailedError, or
    Gloo's words for a closed connection), the ranks left regroup (recover) and do it again. `warning`, formatted
    with `left` (how many ranks are left), is logged when that happens. `like`: a tensor of the result's shape and
    dtype: a rank whose peers finished the action before the loss takes their result instead (world/resume_point.py:
    the action may end on some ranks and not others, and those went on)."""
    if not live_recovery():  # nothing to line up after a loss: it fails the run
        return action()
    resume_point.entering(what, like)
    try:
        result = action()
    except RuntimeError as lost:  # PeerFailedError is one
        if not is_loss(lost):
            resume_point.abandoned()
            raise
        survivors = recover(lost)
        result = resume_point.take_handed()
        if result is None:
            if warning:
                logger.warning(warning.format(left=survivors.world_size))
            result = action()
    resume_point.finished(result)
    return result


_mode: bool | None = None  # what say_mode() said: a loss recovered in-process (True) or by a restart (False)


def recovers_in_process() -> bool:
    """Whether this process said that a loss will be recovered in-process (say_mode): what only such a loop needs
    (a sharded optimizer's copies) is done from then on."""
    return _mode is True


def say_mode(live: bool, why: str) -> None:
    """Once per process: whether a loss will be recovered in-process or by a restart (said on the main rank,
    recorded on every rank for its launcher)."""
    global _mode
    if _mode is not None:
        return
    _mode = live
    if live and world.is_main() and current().number == 0:
        joining.count_ranks_from(world.store(), world.launch_world_size())  # before the launcher may let a node join
    progress.recovery(live)  # every rank: its launcher keeps the others after a loss only if they recover
    if not world.is_main():
        return
    if live:
        logger.info("live recovery on: a lost rank costs the step in flight while %s=%s ranks are left (%s)",
                    MIN_WORLD_ENV, min_world_size(), why)
        if membership_timeout() <= ddp_stall_seconds():
            logger.warning("%s=%g s is not above PHALANX_DDP_STALL_TIMEOUT=%g s: after a loss, a rank that is alive "
                           "but slower than that is dropped from the group before its own step would have reported "
                           "it; set it higher (default: the DDP stall timeout + %g s)", MEMBERSHIP_TIMEOUT_ENV,
                           membership_timeout(), ddp_stall_seconds(), MEMBERSHIP_MARGIN)
    else:
        logger.warning("live recovery off for this loop: %s; a lost rank fails the group, which restarts from its "
                       "newest checkpoint (under --max-restarts)", why)
