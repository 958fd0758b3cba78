"""When live recovery is on, and how long its waits last: the minimum world size turns it on; the membership timeout
and the timeouts nested under it bound what the ranks left wait for; a wait on a peer that a loss may keep from ever
answering asks every WATCH_EVERY seconds whether to give up (wait_watching).

Live recovery is asked for with a minimum world size (`PHALANX_MIN_WORLD_SIZE`, or
`phalanx.spawn(..., min_world_size=)`): a loss that leaves fewer ranks ends the run as before.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from ...diagnose.watch import ddp_stall_seconds
from ...errors import MembershipError, PeerDiedError, explain
from .. import group as world

MIN_WORLD_ENV = "PHALANX_MIN_WORLD_SIZE"
MEMBERSHIP_TIMEOUT_ENV = "PHALANX_MEMBERSHIP_TIMEOUT"
# Timeouts nest, so that an outer one never gives up on what an inner one would still save: a collective
# waiting on a lost peer is abandoned at once (a process gone) or after the heartbeat window (a host silent);
# a rank alive but slow is waited for by the step's collectives up to PHALANX_DDP_STALL_TIMEOUT; the survivors'
# agreement waits that long and MEMBERSHIP_MARGIN more for a member that is alive but has not said so; the
# launcher's stall watch (`phalanx run`, launch/command/flags.py) waits MEMBERSHIP_MARGIN beyond that.
MEMBERSHIP_MARGIN = 30.0
AWAITED_SAY_EVERY = 10.0  # seconds between the lines naming the members the survivors still wait for
AGREE_READ_EVERY = 0.5  # seconds between a survivor's reads of who is alive, when another one decides
ORPHAN_AFTER = 0.5  # seconds into the agreement after which the deciding survivor probes the members it still misses
# Seconds between a waiting rank's looks at whether the step in flight was given up. What a look asks is in memory
# (the watch's threads heard it: watch.py), so a look costs the rank tens of microseconds and the store nothing; it
# bounds how long the last survivor of a loss takes to see it, which the regroup waits for: the looks of ranks that
# entered their waits at different moments are out of phase by up to this much.
WATCH_EVERY = 0.02
CONNECT_LOOK_EVERY = 0.1  # seconds between a regroup's looks for a second loss while its groups connect (a store read)
REGROUP_CONNECT_SECONDS = 30.0  # the ranks left making a new generation's process groups wait this long for each other
WAIT_THREADS = 16  # threads that wait on collectives whose own waits cannot be bounded (waited_aside)


def min_world_size() -> int | None:
    """The fewest ranks a run may go on with after a loss (None: live recovery off, a loss ends the run)."""
    value = os.environ.get(MIN_WORLD_ENV, "").strip()
    if not value:
        return None
    try:
        minimum = int(value)
    except ValueError:
        minimum = 0
    if minimum < 1:
        raise MembershipError(explain(f"{MIN_WORLD_ENV} is not a positive whole number", seen=repr(value),
                                      expected="e.g. 2", fix=f"Set {MIN_WORLD_ENV} to the fewest ranks to go on with."))
    return minimum


def live_recovery() -> bool:
    """Whether a lost rank is recovered from in-process: asked for, in a world of several ranks."""
    return min_world_size() is not None and world.is_initialized() and world.launch_world_size() > 1


def membership_timeout() -> float:
    """Seconds the survivors of a loss wait for a member that is neither alive nor known gone (PHALANX_MEMBERSHIP_
    TIMEOUT; default: the DDP stall timeout + MEMBERSHIP_MARGIN, so that a slow rank is not dropped first)."""
    value = os.environ.get(MEMBERSHIP_TIMEOUT_ENV)
    return float(value) if value else ddp_stall_seconds() + MEMBERSHIP_MARGIN


def wait_watching(ready, what: str, timeout: float, abandoned) -> bool:
    """Call `ready(seconds)` (a wait of at most that long, True once done) until it says True; between waits of
    WATCH_EVERY seconds, raise PeerDiedError as soon as `abandoned()` says the step in flight was given up (a member
    gone, or another rank's exchange failed): a peer that left a Gloo collective never sends what this rank waits
    for, and the collective cannot be aborted (it is abandoned; nothing touches its buffers again). False once
    `timeout` seconds passed first."""
    deadline = time.monotonic() + timeout
    while not ready(min(WATCH_EVERY, max(0.0, deadline - time.monotonic()))):
        if abandoned():
            raise PeerDiedError(explain(f"{what} was given up", rank=dist.get_rank() if dist.is_initialized() else None,
                                        seen="a peer gone, or another rank's exchange failed",
                                        expected="every rank of the generation in it",
                                        fix="The ranks left regroup and redo the step (live recovery)."))
        if time.monotonic() >= deadline:
            return False
    return True
