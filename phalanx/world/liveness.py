"""Whether a peer process is gone: by its pid on this host, by its beacon on another.

A peer that shares this process's boot, pid namespace and network is checked by its pid and start time (a
recycled pid has a later start). Every process keeps a beacon, a listening socket, for as long as it lives, and a
peer on another host is watched through it (world/watch.py says who watches whom): a kept-open connection to it
(KeptWatch) ends the moment the process is gone (its host's kernel closes the socket: a FIN or a reset), and while
its host is cut off the kernel's keepalives go unanswered, which ends it after the launchers' heartbeat window (so
that workers and launchers agree on when a silent node is lost). No data flows on it: the keepalives are the
kernels', one segment a second each way, whatever the processes are doing. A one-off probe (PeerWatch) tells the
same in a regroup, for a peer nobody watches any more.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import threading
import time

from ..diagnose.stacks import stat_fields
from .interface import address_toward
from .meeting.membership import KEEP_ALIVE_INTERVAL, KEEP_ALIVE_MISSES
from .meeting.store import LOOPBACK
from .process.identity import launch_spec

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


def identity_host(who: str) -> str:
    """The host part of an identity(): peers with the same one are checked by pid."""
    return who.split()[0]


def same_host_gone(who: str) -> bool:
    """Whether the process of `who`, an identity() on this host, is gone (its pid ended, or was reused)."""
    _, pid, start, _ = who.split()
    return _start_time(int(pid)) != start


def identity() -> str:
    """This process, as a peer reads it: "host pid start-time beacon-address" (starts the beacon)."""
    return f"{_host()} {os.getpid()} {_start_time(os.getpid())} {_beacon_address()}"


_beacon: socket.socket | None = None


def reachable_host() -> str:
    """The address at which this process's peers on other hosts reach it: its interface on the route to the master
    (the loopback when the master is on this host, or none is known)."""
    spec = launch_spec()
    return (address_toward(spec.master_addr) if spec is not None and spec.master_addr else None) or LOOPBACK


def _beacon_address() -> str:
    global _beacon
    if _beacon is None:
        beacon = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        beacon.bind((reachable_host(), 0))
        beacon.listen(64)
        threading.Thread(target=_answer, args=(beacon,), name="phalanx-beacon", daemon=True).start()
        _beacon = beacon
    host, port = _beacon.getsockname()
    return f"{host}:{port}"


def _answer(beacon: socket.socket) -> None:
    """Accept each watcher and probe and keep it open (its end says this process is gone) until it closes its end,
    so that connections never pile up in the backlog or half-closed."""
    selector = selectors.DefaultSelector()
    selector.register(beacon, selectors.EVENT_READ)
    while True:
        try:
            events = selector.select()
        except OSError:  # the beacon closed under the selector (a forked child)
            return
        for key, _ in events:
            if key.fileobj is beacon:
                try:
                    connection, _ = beacon.accept()
                except OSError:  # closed
                    return
                selector.register(connection, selectors.EVENT_READ)
                continue
            try:
                ended = not key.fileobj.recv(64)  # a watcher sends nothing: readable means it closed its end
            except OSError:
                ended = True
            if ended:
                selector.unregister(key.fileobj)
                key.fileobj.close()


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


# A kept watch sends a byte every TICK seconds, which the peer's kernel acknowledges (its process need not run: a busy
# or stalled peer is not a silent one), with TCP_USER_TIMEOUT at the heartbeat window: a byte unacknowledged that long
# ends the connection, so a host cut off is found SILENT_WINDOW to SILENT_WINDOW + TICK seconds after it went.
TICK = 0.25
WATCH_CONNECT_TIMEOUT = 1.0  # seconds per try to connect a kept watch (silence counts only after SILENT_WINDOW)


class KeptWatch:
    """A kept-open connection to one peer's beacon, in a thread of its own: `on_gone(why)` once, when the peer's process
    is gone ("closed": the connection ended or was refused) or its host was silent for the heartbeat window ("silent":
    a tick unacknowledged by its kernel, or no connection at all). `close()` ends the watch quietly."""

    def __init__(self, address: str, on_gone, name: str = "phalanx-watch"):
        self.address, self.on_gone = address, on_gone
        self._socket: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()  # the socket is set, and shut down by close(), under it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            if self._socket is not None:
                try:
                    self._socket.shutdown(socket.SHUT_RDWR)  # the blocked recv returns: the thread sees it was closed
                except OSError:
                    pass

    def _run(self) -> None:
        why = self._connect()
        if why is None:
            why = self._watch()
        if why is not None and not self._closed.is_set():
            self.on_gone(why)
        if self._socket is not None:
            self._socket.close()

    def _connect(self) -> str | None:
        host, port = self.address.rsplit(":", 1)
        started = time.monotonic()
        while not self._closed.is_set():
            try:
                sock = socket.create_connection((host, int(port)), timeout=WATCH_CONNECT_TIMEOUT)
            except ConnectionRefusedError:
                return "closed"
            except OSError:
                if time.monotonic() - started >= SILENT_WINDOW:
                    return "silent"
                self._closed.wait(PROBE_EVERY)
                continue
            if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: how long a tick may go unacknowledged
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(SILENT_WINDOW * 1000))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(TICK)
            with self._lock:
                if self._closed.is_set():
                    sock.close()
                    return None
                self._socket = sock  # close() from now on shuts it down
            return None
        return None

    def _watch(self) -> str | None:
        if self._socket is None:
            return None
        while not self._closed.is_set():
            try:
                self._socket.send(b"\0")
                if not self._socket.recv(1):  # the peer never sends: this returns when the connection ends
                    return "closed"
            except TimeoutError as exc:
                if exc.errno == errno.ETIMEDOUT:  # the kernel's: a tick unacknowledged for the window
                    return "silent"
                continue  # the socket's: a tick's wait for an end that did not come, all well
            except OSError as exc:  # ETIMEDOUT: a tick unacknowledged for the window; else the connection ended
                return "silent" if exc.errno == errno.ETIMEDOUT else "closed"
        return None


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
