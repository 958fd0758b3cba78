"""Who watches whom in a generation: one peer per rank, so that what a rank does to notice a loss does not grow with
the world.

The members, in rank order, come in blocks of one host each (a launcher gives its node's workers contiguous ranks; a
host is what liveness.identity() says: a boot, a pid namespace and a network). The rank with local index i watches the
rank with local index i (modulo its size) of the next host's block, the last host's the first's: a ring, each rank
watched by one other, over one kept-open connection (liveness.KeptWatch). The peers on its own host it checks by pid.
What a rank finds it spreads through the store: the generation's `gone` key (ranks appended), its `trouble` counter,
which a failed commit counts too, and its `alarm` key, on which a thread of every member's watch blocks (one wait the
store answers once, when the key is set): a rank waiting on its peers looks at what its thread heard, asking the store
nothing, so that the looks of a thousand waiting ranks cost the store nothing per step. It also sets the `done` keys
of the steps in flight, on which the others block waiting for a generation's first commit (generations/commit.py).
While this rank blocks so (`awaiting`), a thread of its watch sets its key should a peer on its host end or the wait
outlast the membership timeout. The watch's threads write through a store connection of their own: the rank's own
may be held by that blocking wait; the alarm's thread waits on one more.

Setting a watch up reads the identities of this rank's host block and of one other host's, in a thread: O(ranks per
host) store reads per rank and generation, which nothing waits for. A peer whose watcher is lost too (two hosts lost
together) is found by the survivors' agreement (generation.py), which probes the members it still misses. Apart from
it, the board on which the ranks its launcher started on this host agree on each step's commit
(generations/host_board.py) is made by their leader as the watch starts and mapped by the others at their first
commit: it asks nothing of another host, so that a member lost there as a generation starts delays no commit.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ..log import logger
from .generations.host_board import HostBoard, attach_board, create_board, host_block, launched_here
from .generations.settings import membership_timeout
from .liveness import KeptWatch, PeerWatch, identity_host, same_host_gone
from .process.identity import launch_spec

TROUBLE, GONE, ALARM = "trouble", "gone", "alarm"
ENDED = "ended"  # the alarm's value when the generation ended without trouble: its members' threads stop listening
WHO_WAIT = 30.0  # seconds the set-up waits for a member to say who it is (one lost before it could is found otherwise)
LOOK_EVERY = 0.05  # seconds between a blocked rank's looks at the pids of its host and at its deadline
LISTEN_FOR = timedelta(days=30)  # the alarm thread's one wait: a generation's life (torch's own log would say a retry)


class GenerationWatch:
    """This rank's watch in one generation (see the module docstring). `key(*parts)` names the generation's keys."""

    def __init__(self, key, members: tuple[int, ...], me: int, store, in_flight=lambda: []):
        self.key, self.members, self.me, self.store = key, members, me, store
        self.in_flight = in_flight  # () -> the done keys of the steps the members may be waiting on
        self._side: object | None = None  # the store connection of the watch's threads (side_store)
        self._awaited: tuple[str, float] | None = None  # (key, deadline) this rank blocks on
        self._awake = threading.Event()
        self._waker: threading.Thread | None = None
        self.who: dict[int, str] = {}  # member -> identity, as read
        self.block: tuple[int, ...] = ()  # the members on this rank's host (itself included)
        self.watched: int | None = None
        self._found: set[int] = set()  # gone, as this rank found them (its watch, the pids of its host)
        self._pids_read = float("-inf")  # when found() last read the pids of its host's members
        self._said: set[int] = set()
        self._kept: KeptWatch | None = None
        self._probes = PeerWatch()  # a regroup's probes of members nobody watches any more
        self._closed = threading.Event()
        self._alarmed = threading.Event()  # the alarm key was set for trouble (_listen)
        self._listening = False  # a thread blocks on the alarm key: the looks need not ask the store
        self._lock = threading.Lock()
        spec = launch_spec()
        gtids = os.environ.get("SLURM_GTIDS") if spec is not None and spec.source == "slurm" else None
        self.host = host_block(members, launched_here(me, spec.local_rank, spec.local_world_size, gtids)
                               if spec is not None else {me})
        self._board: HostBoard | None = None  # this host's board for the commit (host_board.py)
        self._board_asked = False  # a follower maps it once, at its first commit: that answer stays
        if len(self.host) > 1 and me == self.host[0]:
            self._board_asked = True
            try:
                self._board = create_board(key, self.host, me, self.peer, store)
            except Exception as exc:  # the store gone with the run: the launcher ends it
                logger.debug("rank %d made no host board: %s", me, exc)
        threading.Thread(target=self._set_up_watch, name="phalanx-watch-setup", daemon=True).start()
        threading.Thread(target=self._listen, name="phalanx-watch-alarm", daemon=True).start()

    # -- what a rank asks ------------------------------------------------------------------------

    def found(self) -> set[int]:
        """The members this rank knows are gone, asking nobody: its watch's verdict, and the pids of its host (read at
        most every LOOK_EVERY seconds: a look comes more often, and a read of a peer's pid costs tens of
        microseconds)."""
        now = time.monotonic()
        if now - self._pids_read >= LOOK_EVERY:
            self._pids_read = now
            for member in self.block:
                if member != self.me and member not in self._found and same_host_gone(self.who[member]):
                    self._verdict(member, "its process ended")
        return set(self._found)

    def troubled(self) -> bool:
        """Whether the generation is ending: this rank found a member gone, or any member did, or gave a step up (what
        its alarm thread heard; one store read while no thread listens: at the start, or once the generation ended)."""
        if self.found() or self._alarmed.is_set():
            return True
        return not self._listening and self.store.add(self.key(TROUBLE), 0) > 0

    def gone(self) -> set[int]:
        """Every member known gone: what this rank found and what the others said (one or two store reads)."""
        gone = self.found()
        if self.store.add(self.key(TROUBLE), 0) > 0 and self.store.check([self.key(GONE)]):
            gone |= {int(rank) for rank in self.store.get(self.key(GONE)).decode().split(",") if rank}
        return gone

    def probe(self, members) -> set[int]:
        """Which of `members` are gone, by a probe of each (a regroup's: members nobody may watch any more)."""
        gone = set()
        for member in members:
            who = self._identity(member, wait=False)
            if who is not None and self._probes.gone(member, who):
                gone.add(member)
                self._verdict(member, "its probe")
        return gone

    def say_trouble(self) -> None:
        """A step was given up here: the others' waits end at their next look."""
        self.store.add(self.key(TROUBLE), 1)
        self.store.set(self.key(ALARM), TROUBLE)

    @contextmanager
    def awaiting(self, key: str, seconds: float):
        """While the caller blocks on store key `key`: set it should this rank find a member gone (the pids of its
        host, its kept watch) or `seconds` pass, so that the wait ends and the caller reads why."""
        with self._lock:
            self._awaited = (key, time.monotonic() + seconds)
            if self._waker is None:
                self._waker = threading.Thread(target=self._wake_when_due, name="phalanx-commit-wake", daemon=True)
                self._waker.start()
        self._awake.set()
        try:
            yield
        finally:
            self._awaited = None

    def _wake_when_due(self) -> None:
        while not self._closed.is_set():
            awaited = self._awaited
            if awaited is None:
                self._awake.wait()
                self._awake.clear()
                continue
            try:
                if self.found() or time.monotonic() > awaited[1]:
                    self._side_store().set(awaited[0], "0")
                    if self._awaited is awaited:
                        self._awaited = None
                    continue
            except Exception as exc:  # the store gone with the run: the launcher ends it
                logger.debug("the commit's wait could not be woken: %s", exc)
                return
            time.sleep(LOOK_EVERY)

    def board(self, wait: bool = True) -> HostBoard | None:
        """This host's board for the step's commit (None: this rank commits for itself alone). A follower maps it at
        its first ask (`wait`: for its leader to name it, bounded by the membership timeout, its leader's end and
        the generation's); that answer stays the generation's."""
        if self._board_asked or not wait or len(self.host) < 2:
            return self._board
        self._board_asked = True
        deadline = time.monotonic() + membership_timeout()
        board = attach_board(self.key, self.host, self.me, self.peer, self.store, deadline, self.troubled)
        with self._lock:
            if self._closed.is_set():
                if board is not None:
                    board.close()
                return None
            self._board = board
        return board

    def close(self) -> None:
        self._closed.set()
        self._awake.set()
        if self._listening and not self._alarmed.is_set():  # the members' threads stop listening, unless it was set
            try:
                self._side_store().compare_set(self.key(ALARM), "", ENDED)
            except Exception as exc:  # the store gone with the run: the launcher ends it
                logger.debug("the generation's alarm was not ended: %s", exc)
        with self._lock:
            if self._kept is not None:
                self._kept.close()
            if self._board is not None:
                self._board.close()

    # -- set-up and verdicts -----------------------------------------------------------------------

    def _identity(self, member: int, wait: bool = True) -> str | None:
        if member not in self.who:
            key, store = self.key("who", member), self._side_store()
            if not store.check([key]):
                if not wait:
                    return None
                deadline = time.monotonic() + WHO_WAIT
                while not store.check([key]):
                    if self._closed.is_set() or time.monotonic() > deadline:
                        return None
                    time.sleep(0.02)
            self.who[member] = store.get(key).decode()
        return self.who[member]

    def peer(self, member: int) -> str | None:
        """`member`'s identity if it said who it is (the board's looks at the members of this host), waiting for
        nobody."""
        return self._identity(member, wait=False)

    def _listen(self) -> None:
        """Block on the generation's alarm key over a connection of its own, until someone sets it: for trouble (the
        looks then see it) or because the generation ended. A rank that lingers in an ended generation (a second
        loss while it meets the next) asks the store at its looks again."""
        try:
            listener = side_store(self.store)
            self._listening = True
            listener.wait([self.key(ALARM)], LISTEN_FOR)
            if listener.get(self.key(ALARM)).decode() != ENDED:
                self._alarmed.set()
        except Exception as exc:  # the store gone with the run, or the run longer than LISTEN_FOR: ask at the looks
            if not self._closed.is_set():
                logger.debug("the generation's alarm is not listened to: %s", exc)
        finally:
            self._listening = False

    def _host_of(self, member: int) -> str | None:
        who = self._identity(member)
        return identity_host(who) if who is not None else None

    def _set_up_watch(self) -> None:
        try:
            self.block, watched, host = ring_place(self.members, self.me, self._host_of)
            if watched is not None:  # else one host: its peers are checked by pid
                self._keep_watching(watched, host)
        except Exception as exc:  # the store gone with the run, or the watched peer lost before it said who it is
            if not self._closed.is_set():
                logger.debug("the generation's watch was not set up: %s", exc)

    def _keep_watching(self, watched: int, host: tuple[int, ...]) -> None:
        address = self._identity(watched).split()[3]
        with self._lock:
            if not self._closed.is_set():
                self.watched = watched
                self._kept = KeptWatch(address, lambda why: self._watch_ended(watched, host, why))

    def _watch_ended(self, watched: int, host: tuple[int, ...], why: str) -> None:
        """The kept watch ended: its peer's process is gone ("closed"), or its host is silent, and with it every
        member of that host (their watchers, when the hosts differ in size, may be on the same silent host)."""
        for member in (host if why == "silent" else (watched,)):
            self._verdict(member, f"its watch: {why}")

    def _verdict(self, member: int, why: str) -> None:
        """`member` is gone: remembered here, and said once in the store for the others."""
        self._found.add(member)
        if member in self._said or self._closed.is_set():
            return
        self._said.add(member)
        logger.debug("rank %d found rank %d gone (%s)", self.me, member, why)
        try:
            store = self._side_store()
            store.append(self.key(GONE), f"{member},")
            store.add(self.key(TROUBLE), 1)
            store.set(self.key(ALARM), TROUBLE)
            for key in self.in_flight():  # the members blocked on a commit read the news now
                store.set(key, "0")
        except Exception:  # the store's host is gone: the launcher ends the run
            pass

    def _side_store(self):
        """The watch threads' own connection to the store (side_store), made once."""
        with self._lock:
            if self._side is None:
                self._side = side_store(self.store)
            return self._side


def ring_place(members: tuple[int, ...], me: int, host_of) -> tuple[tuple[int, ...], int | None, tuple[int, ...]]:
    """(the members on `me`'s host, the member `me` watches (None: one host), the members of that one's host), asking
    `host_of(member)` only of the members of its own host block and of the next one (O(ranks per host), whatever the
    world).

    >>> hosts = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c"}
    >>> ring_place((0, 1, 2, 3, 4), 1, hosts.get), ring_place((0, 1, 2, 3, 4), 4, hosts.get)
    (((0, 1), 3, (2, 3)), ((4,), 0, (0, 1)))
    """
    count, position = len(members), members.index(me)
    mine = host_of(me)

    def run(start: int, direction: int, host: str) -> list[int]:
        found = []
        for step in range(count):
            member = members[(start + direction * step) % count]
            if member in found or host_of(member) != host:
                break
            found.append(member)
        return found

    after = run(position, 1, mine)
    if len(after) == count:
        return tuple(members), None, ()
    block = sorted(set(run(position, -1, mine) + after))
    start = (members.index(after[-1]) + 1) % count
    following = run(start, 1, host_of(members[start]))
    return tuple(block), following[block.index(me) % len(following)], tuple(sorted(following))


def side_store(store):
    """A connection of its own to the server of `store` (a TCPStore, maybe under prefixes): a TCPStore client serves
    one call at a time, and a blocking wait holds it. A store in this process (a HashStore) is `store` itself."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    return store.clone() if isinstance(base, dist.TCPStore) else store
