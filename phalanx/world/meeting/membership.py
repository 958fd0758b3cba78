"""Elastic membership (`phalanx run --nnodes MIN:MAX`): torch's dynamic rendezvous on a store phalanx places.

The node that owns the master address hosts the store (it can bind it; host names decide nothing), the
others dial it; torch's DynamicRendezvousHandler keeps the rounds on it (C10dRendezvousBackend). Each
launcher sends a heartbeat every KEEP_ALIVE_INTERVAL; a node silent for KEEP_ALIVE_MISSES of them is lost,
and a round with MIN nodes closes --rdzv-last-call after the MIN-th arrived (at once with MAX). torch's errors
(a C++ trace for a lost store) come out as typed ones. A node waiting for a round says so every PROGRESS_EVERY
seconds (waiting.py); one that leaves before its workers ran leaves the rendezvous open for the others.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _Action,
    _BackendRendezvousStateHolder,
)

from ...errors import RendezvousTimeoutError as PhalanxRendezvousTimeout
from ...errors import RunEndedError, StoreLostError, explain
from .. import joining
from ..interface import address_toward
from .store import host_or_join, join_store
from .waiting import Ticker, elastic_line, say, store_line

# Measured on 2 namespaces: a lost node is named ~4 s after its death, the smaller round closes 2 s later.
KEEP_ALIVE_INTERVAL = 1  # seconds between a launcher's heartbeats (torch: 5)
KEEP_ALIVE_MISSES = 4  # heartbeats missed before a node counts as lost (torch: 3, so 15 s)
LAST_CALL_SECONDS = 2.0  # wait for more nodes once MIN are in (torch: 30 s); --rdzv-last-call
STATE_TIMEOUT = timedelta(seconds=10)  # a read of the rounds' state that takes longer: the store is unreachable
# The store's node, at the end, waits this long for the nodes waiting to join to see the rendezvous closed: each looks
# at the state every second (torch's join loop), and would take a store gone for its host lost (exit code 1).
CLOSED_NOTICE = 2.5
PROBE_TIMEOUT = 3.0  # seconds for the store's host to answer a TCP connect
SYNC_POLL = 0.1  # seconds between a waiting launcher's reads of the rounds' state (torch: 1)
LEAVE_TIMEOUT = 1.0  # seconds a launcher that leaves tries to take itself off the round; then its heartbeats expire


@dataclass(frozen=True)
class Node:
    """One launcher in a round: its node rank there and the address the others reach it by."""

    rank: int
    addr: str
    pid: int

    def __str__(self) -> str:
        return f"node {self.rank} ({self.addr})"


class _Handler(DynamicRendezvousHandler):
    """torch's handler, minus its second TCPStore server: the workers use the store phalanx placed.
    `on_pause(state)`: called at each pause of a wait for the round, with the state last read."""

    on_pause = None

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return self._store

    def next_rendezvous(self) -> RendezvousInfo:
        # torch keeps the first round's store address and has rank 0 publish it in that round only: a node
        # that joins a later round would wait for it forever. Every round publishes it again.
        self._bootstrap_store_info = None
        # torch's rounds read their state once a second while they wait for one another (each change of the round
        # costs a few reads): SYNC_POLL apart instead, so that a node joins the workers in progress within a second.
        delay, dynamic_rendezvous._delay = dynamic_rendezvous._delay, self._pause
        try:
            return super().next_rendezvous()
        finally:
            dynamic_rendezvous._delay = delay

    def _pause(self, seconds) -> None:
        _sync_pause(seconds)  # in Python: a stop request's handler runs here (launch/stop.py)
        if self.on_pause is not None:
            self.on_pause(self._state_holder.state)

    def leave(self) -> None:
        """Off the wait list, and off a round not yet complete, without closing the rendezvous."""
        self._stop_heartbeats()
        with self._heartbeat_lock:
            self._op_executor.run(_LeaveOp(), time.monotonic() + LEAVE_TIMEOUT)


class _LeaveOp:
    """torch's exit operation for a node that goes before its workers ran: the round it waits in must not
    count it, a round complete without it is left alone. Past the deadline it goes anyway (its heartbeats stop)."""

    def __call__(self, ctx, deadline: float) -> _Action:
        if time.monotonic() > deadline:
            return _Action.FINISH
        if ctx.node in ctx.state.wait_list:
            return _Action.REMOVE_FROM_WAIT_LIST
        if ctx.node in ctx.state.participants and not ctx.state.complete:
            return _Action.REMOVE_FROM_PARTICIPANTS
        return _Action.FINISH


def _sync_pause(seconds) -> None:
    """torch's pause between two reads of the rounds' state (1 s, or a random one below a bound), at most SYNC_POLL."""
    bound = max(seconds) if isinstance(seconds, tuple) else seconds
    time.sleep(min(bound, SYNC_POLL))


class ElasticRendezvous(RendezvousHandler):
    """`--nnodes MIN:MAX`: rounds of torch's dynamic rendezvous; `nodes()`, `lost()` and `waiting()` for the agent.

    torch's agent restarts the workers the moment a node waits to join; `num_nodes_waiting()` answers 0 to it,
    and phalanx's agent asks `waiting()` itself, to let the workers save at an agreed step first.
    """

    def __init__(self, master_addr: str, master_port: int, run_id: str, min_nodes: int, max_nodes: int,
                 timeout: timedelta, last_call: float = LAST_CALL_SECONDS):
        self.master_addr, self.run_id, self.timeout = master_addr, run_id, timeout
        self.store, self.hosting = host_or_join(
            master_addr, master_port, timeout=timeout, timeout_setting="--rdzv-timeout",
            waiting_line=lambda left: store_line("the node that owns --master-addr", f"{master_addr}:{master_port}",
                                                 f"--nnodes {min_nodes}:{max_nodes}", left, timeout.total_seconds()))
        self.master_port = self.store.port
        self.round = -1
        self.store_lost = False
        self.previous: list[Node] = []
        self.current: list[Node] = []
        try:
            # The rounds' state on a connection of its own that answers within STATE_TIMEOUT or fails: a node cut
            # off from the store's host learns it in seconds, not after --rdzv-timeout (the agent's waits for the
            # other nodes keep the long timeout on self.store).
            state_store = self.store if self.hosting else join_store(
                master_addr, self.master_port, 1, rank=None, connect_timeout=timeout, timeout=STATE_TIMEOUT,
                timeout_setting="--rdzv-timeout")
            self._state_store = state_store
            backend = C10dRendezvousBackend(state_store, run_id)
            settings = RendezvousSettings(
                run_id, min_nodes, max_nodes, RendezvousTimeout(join=timeout, last_call=timedelta(seconds=last_call)),
                keep_alive_interval=timedelta(seconds=KEEP_ALIVE_INTERVAL), keep_alive_max_attempt=KEEP_ALIVE_MISSES)
            # cache_duration=0: every look at the state reads the store (torch's handler serves a 1 s old copy,
            # which hides a store that is gone).
            self._inner = _Handler(_Handler._node_desc_generator.generate(address_toward(master_addr)), settings,
                                   backend.name, self.store,
                                   _BackendRendezvousStateHolder(backend, settings, cache_duration=0))
        except Exception as exc:
            raise self._lost(exc) from None
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self._ticker = Ticker(timeout.total_seconds())
        self._inner.on_pause = self._say_waiting

    @property
    def where(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def _lost(self, exc: BaseException) -> BaseException:
        if isinstance(exc, SignalException):  # a stop request raised inside torch's wait (launch/stop.py): as is
            return exc
        self.store_lost = True
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        return StoreLostError(explain(
            f"the rendezvous store at {self.where} (in the `phalanx run` of the node that owns --master-addr) is gone "
            f"or cannot be reached from this node", seen=f"{type(exc).__name__}: {first_line}",
            expected="the store's host reachable for the whole run",
            fix="If this node lost its network, the others go on without it: run the same command here again once "
                "it is back, and it joins at a step boundary. If the store's node was lost, the group cannot regroup: "
                "run the same command again on the nodes (the master's node, or one that took over its address), and "
                "the workers resume from the newest checkpoint."))

    # -- what torch's agent calls --------------------------------------------------------------

    def get_backend(self) -> str:
        return "phalanx-elastic"

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers dial the store at MASTER_ADDR:MASTER_PORT

    def next_rendezvous(self) -> RendezvousInfo:
        self._ticker = Ticker(self.timeout.total_seconds())
        try:
            info = self._inner.next_rendezvous()
        except RendezvousClosedError:
            raise RunEndedError(explain(
                f"the elastic run at {self.where} ended before this node met the others in a new round",
                seen="its rendezvous closed (the workers of another node finished the run)",
                expected="a run in progress to meet", fix="Nothing to do if the run finished; else start it again "
                "(it resumes from its newest checkpoint).")) from None
        except RendezvousTimeoutError:
            raise PhalanxRendezvousTimeout(explain(
                f"the elastic rendezvous at {self.where} did not gather enough nodes",
                seen=f"fewer than {self.min_nodes} node(s) within --rdzv-timeout {self.timeout.total_seconds():g} s",
                expected=f"--nnodes {self.min_nodes}:{self.max_nodes}",
                fix="Start `phalanx run` on more nodes, lower MIN, or raise --rdzv-timeout.")) from None
        except Exception as exc:
            raise self._lost(exc) from None
        self.previous, self.current = self.current, self.nodes()
        self.round = self._inner._state_holder.state.round
        return RendezvousInfo(info.store, info.rank, info.world_size,
                              RendezvousStoreInfo(self.master_addr, self.master_port))

    def is_closed(self) -> bool:
        try:
            return self._inner.is_closed()
        except Exception as exc:
            raise self._lost(exc) from None

    def set_closed(self) -> None:
        try:
            self._inner.set_closed()
        except Exception as exc:
            raise self._lost(exc) from None

    def _say_waiting(self, state) -> None:
        """Every PROGRESS_EVERY seconds of a wait for a round: the nodes in it and waiting, the time left."""
        if not self._ticker.due():
            return
        joining = state.complete and self._inner._this_node not in state.participants
        say(elastic_line(state.round, len(state.participants), len(state.wait_list), joining, self.min_nodes,
                         self.max_nodes, self.where, self._ticker.left(), self.timeout.total_seconds()))

    def num_nodes_waiting(self) -> int:
        return 0  # to torch's agent; phalanx's asks waiting()

    def get_run_id(self) -> str:
        return self.run_id

    def leave(self) -> None:
        """Go without closing the rendezvous (shutdown() closes it, which ends the run of every node): for a node
        whose workers never ran, stopped or failed while it waited, the others' run is not its to end."""
        if self.store_lost:
            return
        try:
            self._inner.leave()
        except Exception:  # the store's host is gone, or slow: this node's heartbeats stop all the same
            pass

    def shutdown(self) -> bool:
        if self.store_lost:  # nothing to close (the heartbeat thread, a daemon, may be stuck in a read: left alone)
            return False
        try:
            closed = self._inner.shutdown()
            waiting = self.waiting() if self.hosting else []
        except Exception:  # the store's host is gone: nothing left to close
            return False
        if waiting:
            print(f"phalanx run: the run ended while {len(waiting)} node(s) waited to join ({', '.join(waiting)}): "
                  f"keeping the store up {CLOSED_NOTICE:g} s for them to see it", flush=True)
            time.sleep(CLOSED_NOTICE)
        return closed

    # -- what phalanx's agent asks --------------------------------------------------------------

    def quick_store(self):
        """This round's store (the one torch's agent gets) on the connection that fails within STATE_TIMEOUT."""
        return dist.PrefixStore(f"torch.rendezvous.{self.run_id}.{self.round}", self._state_store)

    def probe(self) -> None:
        """StoreLostError unless the store's host answers a TCP connect within PROBE_TIMEOUT. Dialled from Python
        first: torch's client can block in a read for good once its host is cut off."""
        if self.hosting:
            return
        try:
            socket.create_connection((self.master_addr, self.master_port), timeout=PROBE_TIMEOUT).close()
        except OSError as exc:
            raise self._lost(exc) from None

    def _state(self):
        self.probe()
        with self._inner._heartbeat_lock:
            try:
                self._inner._state_holder.sync()
            except Exception as exc:
                raise self._lost(exc) from None
            return self._inner._state_holder.state

    def nodes(self) -> list[Node]:
        """The current round's nodes, by node rank."""
        state = self._inner._state_holder.state
        return sorted((Node(rank, desc.addr, desc.pid) for desc, rank in state.participants.items()),
                      key=lambda node: node.rank)

    def waiting(self) -> list[str]:
        """Addresses of the nodes waiting to join the next round."""
        return sorted(desc.addr for desc in self._state().wait_list)

    # -- a node that joins the workers in progress (world/joining.py) ------------------------------------

    def _join_key(self, round_number: int) -> str:
        return f"phalanx/join/{self.run_id}/{round_number}"

    def decide_join(self, attempt: str | None) -> str | None:
        """The launchers' one answer for the node(s) waiting now: taken in by the workers in progress, whose store
        namespace is `attempt` (None: this launcher's workers cannot; they save and restart instead). The first
        launcher to answer decides for all; returns the attempt decided, or None for a restart."""
        answer = f"live:{attempt}" if attempt else "restart"
        text = self.store.compare_set(self._join_key(self.round + 1), "", answer).decode()
        return text[len("live:"):] if text.startswith("live:") else None

    def join_decided(self) -> bool:
        """Whether a launcher decided that the node(s) waiting join the workers in progress: every other launcher
        then meets them in the next round too (the waiting node may have left the wait list for that round by now,
        and a launcher in the round sends no heartbeat until it closes)."""
        key = self._join_key(self.round + 1)
        return self.store.check([key]) and self.store.get(key).decode().startswith("live:")

    def joining_attempt(self) -> str | None:
        """In a round just met: the store namespace of the workers this node's workers join (None: a round of its
        own, every node's workers starting together)."""
        key = self._join_key(self.round)
        if not self.store.check([key]):
            return None
        text = self.store.get(key).decode()
        return text[len("live:"):] if text.startswith("live:") else None

    def draw_ranks(self, attempt: str, count: int) -> list[int]:
        """`count` global ranks for this node's joining workers, never used in the run (joining.py)."""
        return joining.draw_ranks(dist.PrefixStore(f"phalanx/{attempt}", self.store), count)

    def lost(self) -> list[Node]:
        """This round's nodes that missed KEEP_ALIVE_MISSES heartbeats (or were dropped for it already)."""
        state = self._state()
        expired = datetime.now(timezone.utc) - timedelta(seconds=KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MISSES)
        alive = {(desc.addr, desc.pid) for desc, beat in state.last_heartbeats.items() if beat >= expired}
        me = (self._inner._this_node.addr, self._inner._this_node.pid)
        return [node for node in self.current if (node.addr, node.pid) not in alive and (node.addr, node.pid) != me]

    def changes(self) -> tuple[list[Node], list[Node]]:
        """(left, joined) between the previous round and this one."""
        before = {(n.addr, n.pid) for n in self.previous}
        now = {(n.addr, n.pid) for n in self.current}
        return ([n for n in self.previous if (n.addr, n.pid) not in now],
                [n for n in self.current if (n.addr, n.pid) not in before])
