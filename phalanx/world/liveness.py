"""Whether a peer process is gone: by its pid on this host, by its beacon on another.

A peer that shares this process's boot, pid namespace and network is checked by its pid and start time (a
recycled pid has a later start). Any other is probed: every process keeps a beacon, a listening socket, for
as long as it lives. A connection to it is refused the moment the process is gone (its host's kernel closed
the socket), and gets no answer at all while its host is cut off, which counts as gone once it lasts the
launchers' heartbeat window (so that workers and launchers agree on when a silent node is lost). Probes are
made only while a rank waits on its peers (world/generation.py), at most every PROBE_EVERY seconds a peer.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from ..diagnose.stacks import stat_fields
from . import group as world
from .interface import address_toward
from .meeting.membership import KEEP_ALIVE_INTERVAL, KEEP_ALIVE_MISSES
from .meeting.store import LOOPBACK

PROBE_EVERY = 0.1  # seconds between probes of one peer on another host
PROBE_TIMEOUT = 0.1  # seconds a probe waits for a connection (silence counts only after SILENT_WINDOW)
SILENT_WINDOW = KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MISSES
# Silence counts only while it lasts: two probes that went unanswered (a loaded machine, a slow neighbour lookup)
# with a pause in the probing between them (the rank was training, not waiting) are not a host cut off.
SILENCE_GAP = 1.0


def _host() -> str:
    """What two processes must share for one to check on the other by its pid: a boot, a pid namespace, and a
    network (another network namespace can be cut off while its processes run on: its beacon says)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        return f"{boot}|{os.readlink('/proc/self/ns/pid')}|{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return f"unknown-{os.getpid()}"  # matches no other process: its peers probe it instead


def _start_time(pid: int) -> str | None:
    """`pid`'s start time (a recycled pid has a later one), or None when it is gone or a zombie."""
    fields = stat_fields(pid)
    return fields[19] if fields and fields[0] not in ("Z", "X", "x") else None


def identity() -> str:
    """This process, as a peer reads it: "host pid start-time beacon-address" (starts the beacon)."""
    return f"{_host()} {os.getpid()} {_start_time(os.getpid())} {_beacon_address()}"


_beacon: socket.socket | None = None


def _beacon_address() -> str:
    global _beacon
    if _beacon is None:
        spec = world._spec
        host = (address_toward(spec.master_addr) if spec is not None and spec.master_addr else None) or LOOPBACK
        beacon = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        beacon.bind((host, 0))
        beacon.listen(64)
        threading.Thread(target=_answer, args=(beacon,), name="phalanx-beacon", daemon=True).start()
        _beacon = beacon
    host, port = _beacon.getsockname()
    return f"{host}:{port}"


def _answer(beacon: socket.socket) -> None:
    """Accept and close each probe, so that probes never fill the backlog."""
    while True:
        try:
            connection, _ = beacon.accept()
        except OSError:  # closed
            return
        connection.close()


def _close_beacon_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep the beacon open after its parent is gone."""
    global _beacon
    if _beacon is not None:
        _beacon.close()
        _beacon = None


os.register_at_fork(after_in_child=_close_beacon_in_child)


def probe(address: str, timeout: float = PROBE_TIMEOUT) -> str:
    """"alive", "gone" (refused: the process is gone, its host is not) or "silent" (no answer in `timeout`)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return "alive"
    except ConnectionRefusedError:
        return "gone"
    except OSError:
        return "silent"


class PeerWatch:
    """What one process knows of its peers' liveness: the last probe of each, and since when it is silent."""

    def __init__(self):
        self._host = _host()  # this process's (made in it: a fork that entered other namespaces made its own)
        self._probes: dict[int, tuple[str, float]] = {}  # peer -> (last answer, when)
        self._silent: dict[int, float] = {}  # peer -> silent since

    def gone(self, peer: int, who: str) -> bool:
        """Whether `peer`, whose identity() is `who`, is gone."""
        host, pid, start, beacon = who.split()
        if host == self._host:
            return _start_time(int(pid)) != start
        now = time.monotonic()
        seen, when = self._probes.get(peer, ("alive", 0.0))
        if now - when >= PROBE_EVERY:
            seen = probe(beacon)
            if seen != "silent" or now - when > SILENCE_GAP:
                self._silent.pop(peer, None)  # an answer, or probes paused: silence counts from this probe on
            if seen == "silent" and now - self._silent.setdefault(peer, now) >= SILENT_WINDOW:
                seen = "gone"
            self._probes[peer] = (seen, now)
        return seen == "gone"
