"""Generations of the world: the ranks that train together, renewed in-process when some are lost.

Generation 0 is the world `init()` made. When a rank is lost (its process killed, its host gone) the survivors do not
restart: they agree through the rendezvous store on who is left, and meet on a new process group, generation g+1,
with their old ranks in their old order; ranks that join are taken in at a step every member agreed on. This module is
the face the rest of phalanx calls; each part is a file of generations/: the settings, the current generation and the
meeting on the next, the per-step commit, the survivors' agreement, the joiners taken in, the watched waits on
collectives, the followers regrouped, the old groups released, and recovery from a loss.
"""

from __future__ import annotations

from .generations import current as _current_generation
from .generations import followers as _followers
from .generations import release as _release
from .generations.admissions import admit_joiners, join_run
from .generations.agreement import next_generation
from .generations.commit import COMMIT_SLOTS, GIVEN_UP
from .generations.current import (
    Generation,
    announce,
    commit_step,
    current,
    fail_step,
    generation_group,
    lost_among,
    lost_since,
    start_solo,
)
from .generations.followers import on_regroup, regroup_followers
from .generations.recovery import again_after_loss, is_loss, recover, recovers_in_process, say_mode, undoing
from .generations.settings import (
    AGREE_READ_EVERY,
    AWAITED_SAY_EVERY,
    MEMBERSHIP_MARGIN,
    MEMBERSHIP_TIMEOUT_ENV,
    MIN_WORLD_ENV,
    ORPHAN_AFTER,
    REGROUP_CONNECT_SECONDS,
    WAIT_THREADS,
    WATCH_EVERY,
    live_recovery,
    membership_timeout,
    min_world_size,
)
from .generations.waits import (
    all_gather_bytes,
    all_gather_objects,
    peer_gone,
    step_abandoned,
    timed_wait,
    wait_for,
    wait_watching,
    waited_aside,
    watch,
)
from .process import lifecycle, live

__all__ = [
    "AGREE_READ_EVERY", "AWAITED_SAY_EVERY", "COMMIT_SLOTS", "GIVEN_UP", "MEMBERSHIP_MARGIN",
    "MEMBERSHIP_TIMEOUT_ENV", "MIN_WORLD_ENV", "ORPHAN_AFTER", "REGROUP_CONNECT_SECONDS", "WAIT_THREADS",
    "WATCH_EVERY", "Generation", "admit_joiners", "again_after_loss", "all_gather_bytes",
    "all_gather_objects", "announce", "commit_step",
    "current", "fail_step", "forget", "generation_group", "is_loss", "join_run", "live_recovery", "lost_since",
    "membership_timeout", "min_world_size", "next_generation", "on_regroup", "peer_gone", "recover",
    "recovers_in_process", "regroup_followers", "say_mode", "start_solo", "step_abandoned", "timed_wait", "undoing",
    "wait_for", "wait_watching", "waited_aside", "watch",
]


def forget() -> None:
    """At shutdown, after the last collectives: the next init() starts at generation 0 again."""
    _current_generation.forget()
    _followers.forget()
    _release.forget()


# The world (group.py's parts, process/) asks the generations through these, set here: it is below them and imports
# none of them.
live.lost_among = lost_among  # barrier(): which of the ranks it misses are known gone
lifecycle.start_solo = start_solo  # init(): a joiner's generation of its own, until the run takes it in
lifecycle.forget_generations = forget  # shutdown(): the generations end, once every last collective ran
