"""The rendezvous store: where ranks (and launcher agents) first meet.

torch's TCPStore server listens on every interface of the host. phalanx binds the listening socket
itself, on the one address the ranks will dial (127.0.0.1 for a single host), and hands it to the
store; binding port 0 lets the kernel pick a free port, so there is no race for it.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from ..errors import MasterUnreachableError, PortInUseError, explain

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
               timeout=timedelta(minutes=10), timeout_setting: str = "the connect timeout") -> dist.TCPStore:
    """Connect to the TCPStore at addr:port; MasterUnreachableError after `connect_timeout`."""
    where = f"{addr}:{port}"
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=connect_timeout)
    except Exception as exc:  # torch raises DistNetworkError, DistStoreError or RuntimeError
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise MasterUnreachableError(explain(
            f"could not reach the rendezvous master at {where}", rank=rank,
            seen=f"no answer within {connect_timeout.total_seconds():.0f}s ({first_line})",
            expected=f"rank 0 (or node 0's `phalanx run`) listening on {where}",
            fix="Check the master address and port, that rank 0 / node 0 started, and that the port is open "
                f"between the hosts ({timeout_setting} sets how long to wait).")) from None
    store.set_timeout(timeout)
    return store


class StaticRendezvous(RendezvousHandler):
    """A fixed set of nodes (`--nnodes N`, node ranks given): node 0 hosts the store, the others dial it.

    Unlike torch's static handler, the store is created up front, so a busy port or an unreachable
    master is reported before any worker starts, and a single-node store listens on loopback only.
    """

    def __init__(self, master_addr: str, master_port: int, node_rank: int, nnodes: int, run_id: str,
                 timeout: timedelta):
        self.master_addr, self.node_rank, self.nnodes, self.run_id = master_addr, node_rank, nnodes, run_id
        if node_rank == 0:
            self.store = host_store(master_addr, master_port, nnodes, rank=None, timeout=timeout,
                                    all_interfaces=nnodes > 1)
        else:
            self.store = join_store(master_addr, master_port, nnodes, rank=None, connect_timeout=timeout,
                                    timeout=timeout, timeout_setting="--rdzv-timeout")
        self.master_port = self.store.port

    def get_backend(self) -> str:
        return "phalanx-static"

    @property
    def use_agent_store(self) -> bool:
        return True  # workers reuse this store: they find it at MASTER_ADDR:MASTER_PORT

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(dist.PrefixStore(self.run_id, self.store), self.node_rank, self.nnodes,
                              RendezvousStoreInfo(self.master_addr, self.master_port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0  # a static world never grows

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True
