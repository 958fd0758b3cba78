"""The rendezvous store: where ranks (and launcher agents) first meet.

torch's TCPStore server listens on every interface of the host. phalanx binds the listening socket
itself, on the one address the ranks will dial (127.0.0.1 for a single host), and hands it to the
store; binding port 0 lets the kernel pick a free port, so there is no race for it. A node that waits for
another's store waits in Python, where a stop request is heard, and says so.
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ...errors import MasterUnreachableError, PortInUseError, explain
from .waiting import Ticker, say

LOOPBACK = "127.0.0.1"


def _listen(addr: str, port: int, *, rank: int | None, all_interfaces: bool) -> socket.socket:
    """A listening TCP socket on (addr, port), or on every interface at `port` when asked to."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # A restarted run must be able to reuse the port of a store that closed moments ago (TIME_WAIT).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
        sock.bind((wildcard if all_interfaces else addr, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(explain(
                f"port {port} is already in use on this host", rank=rank,
                seen=f"bind to {addr}:{port} failed ({exc.strerror})", expected="a free port",
                fix="Choose another --master-port / MASTER_PORT, or leave it unset on a single host "
                    "so a free one is picked.")) from None
        raise
    sock.listen(512)
    return sock


def host_store(addr: str, port: int, world_size: int, *, rank: int | None = 0, timeout=timedelta(minutes=10),
               all_interfaces: bool = False) -> dist.TCPStore:
    """Start a TCPStore server on `addr` only (port 0: a free port; read it from `.port`).

    `all_interfaces` is for stores that other hosts dial: the name they use for this host may not
    resolve, here, to the interface they reach it by.
    """
    sock = _listen(addr, port, rank=rank, all_interfaces=all_interfaces)
    bound_port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(addr, bound_port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store now owns the descriptor: closing it here would silence the store
    return store


def join_store(addr: str, port: int, world_size: int, *, rank: int | None, connect_timeout: timedelta,
               timeout=timedelta(minutes=10), timeout_setting: str = "the connect timeout",
               waiting_line: Callable[[float], str] | None = None) -> dist.TCPStore:
    """Connect to the TCPStore at addr:port; MasterUnreachableError after `connect_timeout`.

    The port is dialled from Python until it answers, and only then handed to torch's client: torch's C++
    client logs every failed try and, when it gives up, its own C++ stack trace. `waiting_line(seconds left)`:
    what a launcher says every PROGRESS_EVERY seconds while nobody answers."""
    where = f"{addr}:{port}"
    ticker = Ticker(connect_timeout.total_seconds())
    deadline = ticker.deadline
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                break
        except OSError as exc:  # refused (nobody listens yet), no route, timed out, unknown name
            if time.monotonic() >= deadline:
                raise MasterUnreachableError(explain(
                    f"could not reach the rendezvous master at {where}", rank=rank,
                    seen=f"no answer within {connect_timeout.total_seconds():.0f}s (last try: {exc})",
                    expected=f"rank 0 (or node 0's `phalanx run`) listening on {where}",
                    fix="Check the master address and port, that rank 0 / node 0 started, and that the port is open "
                        f"between the hosts ({timeout_setting} sets how long to wait).")) from None
            if waiting_line is not None and ticker.due():
                say(waiting_line(ticker.left()))
            time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=False,
                              timeout=timedelta(seconds=max(5.0, deadline - time.monotonic())))
    except Exception as exc:  # torch raises DistNetworkError, DistStoreError or RuntimeError
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise MasterUnreachableError(explain(
            f"could not connect to the rendezvous master at {where}", rank=rank, seen=first_line,
            expected=f"rank 0 (or node 0's `phalanx run`) serving a store on {where}",
            fix="Check that the port belongs to this run's master and not to another program.")) from None
    store.set_timeout(timeout)
    return store


def owns_address(addr: str) -> bool:
    """Whether this host has `addr` (it can bind a socket there): the elastic nodes' test for who hosts the store."""
    try:
        infos = socket.getaddrinfo(addr, 0, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(sockaddr)
                return True
            except OSError:
                continue
    return False


def host_or_join(addr: str, port: int, *, timeout: timedelta, timeout_setting: str,
                 waiting_line: Callable[[float], str] | None = None) -> tuple[dist.TCPStore, bool]:
    """(store, hosting): the node that owns `addr` hosts the store on `port` (every interface), any other dials
    it and waits up to `timeout` for it (MasterUnreachableError then). Decided by the address, not the host name:
    in containers and network namespaces the host name says nothing about which node is the master."""
    if owns_address(addr):
        try:
            return host_store(addr, port, 1, rank=None, timeout=timeout, all_interfaces=True), True
        except PortInUseError:
            if not addr.startswith("127."):
                raise
            # Several nodes on one machine, all on loopback: the first hosts, the others dial it.
    return join_store(addr, port, 1, rank=None, connect_timeout=timeout, timeout=timeout,
                      timeout_setting=timeout_setting, waiting_line=waiting_line), False
