"""The Gloo event-loop threads of the process groups a loss leaves behind, put at idle priority.

Gloo runs each process group's sockets on a thread of its own (`gloo_tcp_loop`, made with the group). After a loss,
a collective of the generation is left pending, and a survivor's pair may hold a live peer's message for a buffer
that collective never posts: Gloo wakes its loop for that message again and again, and the loop spins a whole core
until the group is freed (benchmarks/live_recovery/gloo_spin_after_loss.py shows it in plain torch; abort() and
shutdown() do not stop it). Freeing waits for the pending collective's timeout, and torch's default group,
generation 0's, is never freed. Those groups are never used again: their loops go to SCHED_IDLE, where a spin only
takes a core's idle time, never the training's or the regroup's.

Stopping the spin itself was tried (session 34) and taken back: the stuck pair's socket set to report nothing more
(EPOLL_CTL_MOD). Its bytes may still be waiting for a buffer that a collective on those groups registers later (the
non-finite check's all-reduce of the step in flight, settled in the next forward), and silenced, that collective's
end became the membership timeout's (a 5-minute stall in a chaos run). Which bytes will never be read cannot be told
from outside Gloo.

`note(group, before)` records the loop threads a group brought (torch's default group at init(), the control group,
each generation's groups once connected: a lazy group's loop starts with its first pair); `idle(groups)` demotes
theirs (Linux; elsewhere nothing happens).
"""

from __future__ import annotations

import os
import weakref

LOOP_THREAD = "gloo_tcp_loop"  # the name Gloo gives a device's event loop thread

_loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> the loop threads it made


def loop_threads() -> set[int]:
    """The thread ids of this process's Gloo event loops, from /proc (empty where there is none)."""
    found = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() == LOOP_THREAD:
                    found.add(int(tid))
        except OSError:  # a thread that ended meanwhile
            pass
    return found


def note(group, before: set[int]) -> None:
    """The loop threads started since `before` (loop_threads() read before `group` was made) are `group`'s."""
    threads = loop_threads() - before
    if group is not None and threads:
        _loops[group] = sorted(threads)


def idle(groups) -> None:
    """Put the loop threads of `groups` (left behind after a loss) at idle priority."""
    for group in groups:
        for tid in _loops.pop(group, ()) if group is not None else ():
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError):  # not Linux, or the thread ended with its group
                pass


def policy(tid: int) -> int | None:
    """The scheduling policy of thread `tid` (os.SCHED_IDLE, ...), None when it is gone."""
    try:
        return os.sched_getscheduler(tid)
    except OSError:
        return None


def threads_of(group) -> list[int]:
    """The loop threads noted for `group` (empty once idle() demoted them, or for a group never noted)."""
    return list(_loops.get(group, ())) if group is not None else []
