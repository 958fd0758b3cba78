"""The fixed nodes' rendezvous (`phalanx run --nnodes N`): node 0 hosts the store (store.py), the others dial it, and
each attempt's meeting is a roll call (roll_call.py)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from ...errors import PortInUseError
from . import roll_call
from .store import host_store, join_store
from .waiting import store_line


class StaticRendezvous(RendezvousHandler):
    """A fixed set of nodes (`--nnodes N`, node ranks given): node 0 hosts the store, the others dial it.

    Unlike torch's static handler, the store is created up front, so a busy port or an unreachable
    master is reported before any worker starts, and a single-node store listens on loopback only. Each
    rendezvous (one per attempt) of several nodes is a roll call (roll_call.py): a node rank given twice
    is named, and the wait for the others says who is missing and can be stopped.
    """

    def __init__(self, master_addr: str, master_port: int, node_rank: int, nnodes: int, run_id: str,
                 timeout: timedelta):
        self.master_addr, self.node_rank, self.nnodes, self.run_id = master_addr, node_rank, nnodes, run_id
        self.timeout, self.round = timeout, 0
        self.me = roll_call.Launcher.here(master_addr) if nnodes > 1 else None
        if node_rank == 0:
            try:
                self.store = host_store(master_addr, master_port, nnodes, rank=None, timeout=timeout,
                                        all_interfaces=nnodes > 1)
            except PortInUseError:
                if nnodes > 1:  # another launcher left at node rank 0 on this host?
                    roll_call.check_master(master_addr, master_port, run_id, self.me, nnodes)
                raise
            if nnodes > 1:
                roll_call.hosting(self.store, run_id, self.me, nnodes)
        else:
            where = f"{master_addr}:{master_port}"
            self.store = join_store(
                master_addr, master_port, nnodes, rank=None, connect_timeout=timeout, timeout=timeout,
                timeout_setting="--rdzv-timeout", waiting_line=lambda left: store_line(
                    "node 0", where, f"this is node {node_rank} of --nnodes {nnodes}", left, timeout.total_seconds()))
        self.master_port = self.store.port

    def get_backend(self) -> str:
        return "phalanx-static"

    @property
    def use_agent_store(self) -> bool:
        return True  # workers reuse this store: they find it at MASTER_ADDR:MASTER_PORT

    def next_rendezvous(self) -> RendezvousInfo:
        if self.nnodes > 1:  # else torch's agent waits for the others in a C++ read: deaf to a stop, silent
            round_number, self.round = self.round, self.round + 1
            roll_call.gather(self.store, self.run_id, round_number, self.node_rank, self.nnodes, self.me,
                             self.timeout.total_seconds(), f"{self.master_addr}:{self.master_port}")
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
