"""Releasing the process groups of the generation before, once the followers moved off them.

The old groups are never used again: a Gloo collective on them cannot be aborted, and may still write its buffers.
They are released once the followers moved off them (release_old_groups): unregistered at once, freed by a thread of
their own when their last collective ends.
"""

from __future__ import annotations

import queue
import sys
import threading

import torch.distributed as dist

from ...log import logger

_old_groups: list = []  # (group, left after a loss) of the generation before, released once the followers moved on
_freeing: queue.Queue | None = None  # groups unregistered, freed by their last holder: _free_when_last()


def set_aside(groups, abandoned: bool) -> None:
    """The groups of the generation before (`abandoned`: left after a loss), to be released once the followers moved
    off them (release_old_groups); torch's default group is never among them."""
    _old_groups.extend((g, abandoned) for g in groups if g is not None and g != dist.group.WORLD)


def release_old_groups() -> None:
    """Release the process groups of the generation before, now that every follower moved off them: each Gloo group
    that was used holds ~3 MB (its pairs' buffers) and its sockets until it is freed, which over many losses is
    what a long run would grow by. torch forgets them here (destroy_process_group: it does not wait for their
    collectives); they are freed by the thread of _free_when_last, which a collective still waiting on a lost rank
    holds up until it ends (at once for a process gone, the group's timeout for a host cut off): freeing a group waits
    for its collectives, in C++ and without the GIL, so that the step goes on meanwhile. A generation replaced by a
    larger one (ranks joined) left nothing pending: its groups are freed at once. Those left after a loss are
    aborted, not shut down: NCCL's shutdown waits for kernels that may wait on the lost rank for ever, its abort
    ends them (Gloo's changes nothing: its collectives end by the timeout)."""
    global _freeing
    while _old_groups:
        group, lost = _old_groups.pop()
        try:
            (_abort_process_group if lost else dist.destroy_process_group)(group)
        except Exception as exc:  # torch's registry without it already
            logger.debug("an old generation's group was not unregistered: %s", exc)
        if _freeing is None:
            _freeing = queue.Queue()
            threading.Thread(target=_free_when_last, args=(_freeing,), name="phalanx-free-groups", daemon=True).start()
        _freeing.put(group)
        del group  # the thread's reference is to be the last


# torch's abort of one group (it unregisters it as destroy_process_group does); private, so looked up with a fallback
_abort_process_group = getattr(dist.distributed_c10d, "_abort_process_group", dist.destroy_process_group)


def _free_when_last(groups: queue.Queue, every: float = 0.2) -> None:
    """Hold each group until no other reference is left (a follower's attribute, a traceback's frame), then drop
    it here: the last reference's holder is the thread that waits for the group's collectives in its destructor."""
    held: list = []
    while True:
        try:
            held.append(groups.get(timeout=every if held else None))
        except queue.Empty:
            pass
        for index in range(len(held) - 1, -1, -1):
            if sys.getrefcount(held[index]) <= 2:  # the list's reference and the argument's: no other holder
                del held[index]


def forget() -> None:
    """At shutdown: no group is left to release."""
    _old_groups.clear()  # shutdown() destroys every group left
