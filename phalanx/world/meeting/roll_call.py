"""The fixed nodes' roll call (`phalanx run --nnodes N`): each node registers its node rank, then waits for all N.

Left to torch's agent, the wait for the other nodes is a C++ read of the store: deaf to a stop request and
silent until --rdzv-timeout. Here each node claims its node rank in the store and polls a count in short
sleeps, so a signal handler runs between two looks and a line names the missing node ranks every
PROGRESS_EVERY seconds (waiting.py). A node rank claimed twice is written down where every node's poll reads
it: both launchers fail within a poll. The keys are per round, as each restart under --max-restarts meets again.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

from ...errors import (
    DuplicateNodeRankError,
    MasterUnreachableError,
    PhalanxError,
    RendezvousTimeoutError,
    StoreLostError,
    explain,
)
from ..interface import address_toward
from .store import join_store
from .waiting import Ticker, fixed_line, rank_ranges, say

POLL = 0.2  # seconds between two looks at the count: a stop request waits at most this long
PROBE_TIMEOUT = timedelta(seconds=2)  # for a node 0 whose port is taken to find out whether another node 0 holds it
HOST_WAIT = 1.0  # seconds the probe waits for the other node 0 to write who it is (it does just after binding)
LINGER = 2.0  # seconds node 0 keeps its store up at most after a clash, for the other nodes to read it there


@dataclass(frozen=True)
class Launcher:
    """One node's `phalanx run`, as the others name it."""

    host: str
    address: str
    pid: int

    @classmethod
    def here(cls, master_addr: str) -> Launcher:
        return cls(socket.gethostname(), address_toward(master_addr) or "no route to the master", os.getpid())

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, text) -> Launcher:
        return cls(**json.loads(text))

    def __str__(self) -> str:
        return f"{self.host} ({self.address}, pid {self.pid})"


def _key(run_id: str, *parts) -> str:
    return "/".join(("phalanx/nodes", run_id, *map(str, parts)))


def duplicate_error(node_rank: int, first: Launcher, second: Launcher, nnodes: int) -> DuplicateNodeRankError:
    return DuplicateNodeRankError(explain(
        f"node rank {node_rank} was given to two launchers", seen=f"{first} and {second}",
        expected=f"a node rank of its own for each of the {nnodes} nodes (0..{nnodes - 1})",
        fix="Pass each node's `phalanx run` its own --node-rank (a launcher without one is node 0)."),
        node_rank, [str(first), str(second)])


def _report_duplicate(store, run_id: str, round_number: int, node_rank: int, first: Launcher, me: Launcher,
                      nnodes: int):
    """Write the clash where the poll of every node in this round reads it (the first clash written stands), then
    raise it here. Nodes in a later round, that met before this launcher came, go on without it."""
    ours = json.dumps({"rank": node_rank, "first": first.encode(), "second": me.encode()})
    _raise_recorded(store.compare_set(_key(run_id, round_number, "duplicate"), "", ours), nnodes)


def _raise_recorded(text, nnodes: int):
    recorded = json.loads(text)
    raise duplicate_error(recorded["rank"], Launcher.decode(recorded["first"]), Launcher.decode(recorded["second"]),
                          nnodes)


def check_duplicates(store, run_id: str, round_number: int, nnodes: int) -> None:
    """DuplicateNodeRankError when a launcher wrote down a node rank claimed twice in this round."""
    key = _key(run_id, round_number, "duplicate")
    if store.check([key]):
        store.add(f"{key}/seen", 1)  # node 0, which hosts the store, waits for every node's
        _raise_recorded(store.get(key), nnodes)


def claim(store, run_id: str, round_number: int, node_rank: int, nnodes: int, me: Launcher) -> None:
    """Register `node_rank` for this round; DuplicateNodeRankError (on both launchers) when another holds it."""
    holder = store.compare_set(_key(run_id, round_number, "rank", node_rank), "", me.encode()).decode()
    if holder != me.encode():
        _report_duplicate(store, run_id, round_number, node_rank, Launcher.decode(holder), me, nnodes)
    store.append(_key(run_id, round_number, "ranks"), f"{node_rank},")
    store.add(_key(run_id, round_number, "count"), 1)


def present(store, run_id: str, round_number: int) -> list[int]:
    """The node ranks registered for this round (for the waiting line; the poll reads the count only)."""
    key = _key(run_id, round_number, "ranks")
    if not store.check([key]):
        return []
    return sorted({int(rank) for rank in store.get(key).decode().split(",") if rank})


def gather(store, run_id: str, round_number: int, node_rank: int, nnodes: int, me: Launcher, timeout: float,
           where: str) -> None:
    """Claim `node_rank`, then wait until all `nnodes` claimed theirs in this round: a line every PROGRESS_EVERY
    seconds, RendezvousTimeoutError naming the missing node ranks after `timeout` seconds, StoreLostError when
    node 0's store goes away meanwhile."""
    try:
        _gather(store, run_id, round_number, node_rank, nnodes, me, timeout, where)
    except PhalanxError:
        raise
    except RuntimeError as exc:  # torch's DistNetworkError: node 0's launcher ended (stopped, failed, killed)
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise StoreLostError(explain(
            f"node 0's store at {where} went away while this node waited for the others", seen=first_line,
            expected="node 0's `phalanx run` up until every node arrived",
            fix="Node 0's own output says why it ended; start it again, then the other nodes.")) from None


def _gather(store, run_id: str, round_number: int, node_rank: int, nnodes: int, me: Launcher, timeout: float,
            where: str) -> None:
    ticker = Ticker(timeout)
    count = _key(run_id, round_number, "count")
    try:
        claim(store, run_id, round_number, node_rank, nnodes, me)
        while True:
            check_duplicates(store, run_id, round_number, nnodes)
            if store.add(count, 0) >= nnodes:
                return
            _look(store, run_id, round_number, nnodes, ticker, timeout, where)
            time.sleep(POLL)  # in Python: a stop request's handler runs here (launch/stop.py)
    except DuplicateNodeRankError:
        if node_rank == 0:  # the others read the clash in this node's store: keep it up until they have
            deadline = time.monotonic() + LINGER
            while (store.add(_key(run_id, round_number, "duplicate", "seen"), 0) < store.add(count, 0)
                   and time.monotonic() < deadline):
                time.sleep(0.05)
        raise


def _look(store, run_id: str, round_number: int, nnodes: int, ticker: Ticker, timeout: float, where: str) -> None:
    """Every PROGRESS_EVERY seconds, the waiting line; at the deadline, RendezvousTimeoutError."""
    out_of_time = ticker.left() <= 0
    if not (out_of_time or ticker.due()):
        return
    here = present(store, run_id, round_number)
    missing = sorted(set(range(nnodes)) - set(here))
    if out_of_time:
        raise RendezvousTimeoutError(explain(
            f"the {nnodes} nodes did not all arrive at the rendezvous at {where}",
            seen=f"{len(here)} of {nnodes} within --rdzv-timeout {timeout:g} s, missing node rank(s) "
                 f"{rank_ranges(missing)}", expected=f"node ranks 0..{nnodes - 1}",
            fix="Start `phalanx run` with each missing --node-rank (the same --master-addr and --master-port) on "
                "its node, or raise --rdzv-timeout."), missing)
    say(fixed_line(len(here), nnodes, missing, where, ticker.left(), timeout))


def hosting(store, run_id: str, me: Launcher, nnodes: int) -> None:
    """Node 0 of several writes who it is in the store. Two launchers without --node-rank are both node 0, each with
    a store server of its own; but a store's own client dials the master address, so on another host the second
    writes into the first's store, finds it taken, and both launchers learn of it (DuplicateNodeRankError)."""
    holder = store.compare_set(_key(run_id, "host"), "", me.encode()).decode()
    if holder != me.encode():
        _report_duplicate(store, run_id, 0, 0, Launcher.decode(holder), me, nnodes)  # round 0: it has not met yet


def check_master(master_addr: str, master_port: int, run_id: str, me: Launcher, nnodes: int) -> None:
    """For node 0 of several whose port is taken on this host: DuplicateNodeRankError (here and on the other node 0)
    when the port is another node 0's store, as for two launchers without --node-rank on one host. A port that does
    not answer, or not as a phalanx launcher's store, is no clash: the caller says the port is in use."""
    try:
        store = join_store(master_addr, master_port, 1, rank=None, connect_timeout=PROBE_TIMEOUT,
                           timeout=timedelta(seconds=5))
    except MasterUnreachableError:
        return
    key = _key(run_id, "host")
    deadline = time.monotonic() + HOST_WAIT
    while not store.check([key]):
        if time.monotonic() > deadline:
            return  # not a phalanx launcher's store: the port is another program's (PortInUseError then)
        time.sleep(0.05)
    _report_duplicate(store, run_id, 0, 0, Launcher.decode(store.get(key)), me, nnodes)
