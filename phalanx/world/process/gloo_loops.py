"""The Gloo event loops of the process groups a loss leaves behind: silenced, and put at idle priority.

Gloo runs each process group's sockets on a thread of its own (`gloo_tcp_loop`, made with the group), in an epoll
loop. After a loss, a collective of the generation is left pending, and a survivor's pair may hold a live peer's
message for a buffer that collective never posts: the pair reads its header, leaves the rest in the socket, and the
loop, woken for it again and again (level-triggered), spins a whole core until the group is freed
(benchmarks/live_recovery/gloo_spin_after_loss.py shows it in plain torch; abort() and shutdown() do not stop it).
Freeing waits for the pending collective's timeout, and torch's default group, generation 0's, is never freed.

Those groups are never used again. At a loss, quiet() puts their loop threads at SCHED_IDLE, where a spin takes only
a core's idle time, and stops the spin: each socket registered in the group's epoll that holds bytes left unread is
set to report nothing more (EPOLL_CTL_MOD to EPOLLONESHOT and no event, its handler kept: at most one hang-up
reaches Gloo's handler, which does nothing with it; the socket stays registered, so that Gloo's own unregistering
when the group is freed or the process exits still finds it). Such a pair never reads again anyway (its bytes wait
for a buffer that never comes), so this takes nothing from the group but the spin; its other pairs are left as they
are, where a peer's close still fails the pending collective and lets the group be freed. recover() quiets them as
the survivors start to agree, once they agreed (each one has left them), and once the followers moved on, for a pair
stuck meanwhile. Where a loop's epoll could not be found (a loop busy when its group was made), idle priority is all
there is.

`note(group, before)` records the loop threads a group brought, and the epoll each one waits in (torch's default
group at init(), the control group, each generation's groups once connected: a lazy group's loop starts with its
first pair); `quiet(groups)` quiets theirs (Linux; elsewhere nothing happens).
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import os
import platform
import socket
import termios
import time
import weakref

LOOP_THREAD = "gloo_tcp_loop"  # the name Gloo gives a device's event loop thread
EPOLL_CTL_MOD, EPOLLONESHOT = 3, 1 << 30  # <sys/epoll.h>
LOOKS_FOR_EPOLL = 20  # reads of a loop thread's system call, 1 ms apart, to find it waiting in its epoll

_loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> [(loop thread, its epoll fd or None)]


class _EpollEvent(ctypes.Structure):
    """struct epoll_event: packed on x86-64 (12 bytes), naturally aligned elsewhere (16)."""
    _pack_ = 1 if platform.machine() in ("x86_64", "AMD64") else 8
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


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
        _loops[group] = [(tid, _epoll_of(tid)) for tid in sorted(threads)]


def quiet(groups, last: bool = False) -> int:
    """Put the loop threads of `groups` (left behind after a loss) at idle priority, and silence the sockets their
    loops spin on (_silence); returns how many were silenced. `last`: the groups' last look (once every survivor has
    left them): their loops are forgotten here."""
    silenced = 0
    for group in groups:
        loops = (_loops.pop(group, ()) if last else _loops.get(group, ())) if group is not None else ()
        for tid, epoll in loops:
            silenced += _silence(epoll) if epoll is not None else 0
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError):  # not Linux, or the thread ended with its group
                pass
    return silenced


def _epoll_of(tid: int) -> int | None:
    """The epoll fd loop thread `tid` waits in: the first argument of the system call it is in (/proc's `syscall`),
    when that is an epoll; None when not seen within LOOKS_FOR_EPOLL looks (a busy loop, or no such file)."""
    for _ in range(LOOKS_FOR_EPOLL):
        try:
            with open(f"/proc/self/task/{tid}/syscall") as call:
                fields = call.read().split()
            fd = int(fields[1], 16) if len(fields) > 1 else None  # "running" or "-1 ...": not in a call now
            if fd is not None and os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]":
                return fd
        except (OSError, ValueError):
            return None
        time.sleep(0.001)
    return None


def _silence(epoll: int) -> int:
    """Silence every socket registered in `epoll` that holds bytes Gloo left unread (see the module's docstring);
    returns how many. The others, listening sockets and Gloo's wake-up pipe are left as they are."""
    libc, silenced = ctypes.CDLL(None, use_errno=True), 0
    try:
        with open(f"/proc/self/fdinfo/{epoll}") as info:
            registered = [line.split() for line in info if line.startswith("tfd:")]
    except OSError:  # gone with its group
        return 0
    for fields in registered:  # tfd: <fd> events: <hex> data: <hex> ...
        fd, data = int(fields[1]), int(fields[5], 16)
        if _stuck(fd):
            event = _EpollEvent(EPOLLONESHOT, data)
            silenced += libc.epoll_ctl(epoll, EPOLL_CTL_MOD, fd, ctypes.byref(event)) == 0
    return silenced


def _stuck(fd: int) -> bool:
    """Whether `fd` is a connected socket with bytes not read (a pair's, whose loop spins on them)."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return False
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        unread = array.array("i", [0])
        if probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        fcntl.ioctl(probe.fileno(), termios.FIONREAD, unread)
        return unread[0] > 0
    except OSError:
        return False
    finally:
        probe.close()  # the duplicate only


def policy(tid: int) -> int | None:
    """The scheduling policy of thread `tid` (os.SCHED_IDLE, ...), None when it is gone."""
    try:
        return os.sched_getscheduler(tid)
    except OSError:
        return None


def threads_of(group) -> list[int]:
    """The loop threads noted for `group` (empty after quiet()'s last look, or for a group never noted)."""
    return [tid for tid, _ in _loops.get(group, ())] if group is not None else []


def epolls_of(group) -> list[int | None]:
    """The epoll fd each of `group`'s noted loop threads waits in (None where it was not found)."""
    return [epoll for _, epoll in _loops.get(group, ())] if group is not None else []
