"""The models and loaders that follow the generations: each new one is handed to them, in the order they registered
(the same on every rank), then the groups they moved off are released (release.py)."""

from __future__ import annotations

import time
import weakref

from ...diagnose import progress
from .. import resume_point
from . import release
from .current import current

_followers: list = []  # weak methods called with each new generation: the models' and loaders' regroups


def on_regroup(method) -> None:
    """Call bound method `method(generation)` on every new generation, while its object lives (in the order
    registered: the same on every rank when models and loaders are built in the same order)."""
    current()
    _followers.append(weakref.WeakMethod(method))


def regroup_followers(number: int, members, lost, started: float, redoing: bool = False, joined=(),
                      healed: tuple[int, float] | None = None) -> None:
    """Every model and loader that follows the generations regrouped onto the current one, and the change
    recorded for the launcher's run summary."""
    if joined:  # every member is at the same step: the collectives that redo themselves count from here
        resume_point.restart_count()
    _followers[:] = [ref for ref in _followers if ref() is not None]
    for ref in list(_followers):
        method = ref()
        if method is not None:
            method(current())
    release.release_old_groups()
    progress.regrouped(number, members, lost, time.monotonic() - started, redoing, joined=list(joined),
                       healed=healed)


def forget() -> None:
    """At shutdown: no model or loader follows the generations any more."""
    _followers.clear()
