"""The per-step commit among hosts along a tree, so that a healthy step costs the store nothing whatever the world.

A generation's first commit goes through the store alone (commit.py), and each rank that speaks in it for its host
(a board's leader, or a rank alone on its host) writes its rank, its weight (the ranks it speaks for) and the address
of a listening socket of its own to the generation's `speakers` key first: once that commit is applied, every
speaker's line is there. From the second step on, the speakers, in rank order, form a tree of fan-out FANOUT. Each one
waits for its children's votes (the ranks ready in their subtrees), sends the sum with its own host's to its parent,
and waits for the outcome to come down; the root, once the whole world said ready, decides "applied" and sends it
down at once. The messages go over a TCP connection per edge of the tree that the child opens at its first vote and
both keep for the generation (SocketLinks): 16 bytes, one segment each, read in the caller's own thread by a bounded
poll(), so that a hop costs a wake-up, not a thread's hand-off; a speaker sends and receives at most FANOUT + 1 of
them a step.

A speaker whose vote went up ready and whose parent's word cannot come (a peer gone, a wait outlasting the membership
timeout) is in doubt: it asks the ranks left (commit.py's _doubt), and passes what they say down. Each speaker sends
exactly one message a step up to its parent and one down to each child, whichever way the step ends (a vote or
NOT_READY up, the outcome down), and reads one from each, in order: a connection's messages are a step's each.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field

from ...errors import MembershipError, PeerDiedError, explain

FANOUT = 8  # children per speaker: a speaker's messages per step stay at most 2 (FANOUT + 1) whatever the world
# A wait polls without sleeping this long first: a vote or an outcome mostly comes within it, and a process woken from
# sleep pays the scheduler's wake-up (tens of microseconds, more on a loaded host) on the step's critical path, twice
# per hop. The rank has nothing else to do meanwhile: its step waits for the commit. Not on a host whose cores are all
# wanted: there a yield runs another task (YIELDED_AWAY), and the spin would take the core from a peer's Gloo threads.
SPIN_SECONDS = 0.0005
YIELDED_AWAY = 0.00005  # a yield that long ran another task: the host's cores are all wanted, the spin stops
NOT_READY = -1  # the vote of a subtree in which some rank cannot apply the step
_UP, _DOWN = "up", "down"  # a message's direction: votes up, outcomes down (a connection carries both, in turn)
_WORD = struct.Struct("<qq")  # a message: (step, value); a connection's first, (_HELLO, the child's rank)
_HELLO = -(1 << 62)


def tree_place(count: int, index: int) -> tuple[int | None, list[int]]:
    """(the parent, the children) of speaker `index` of `count`, as positions in rank order: a tree of fan-out
    FANOUT rooted at the first speaker.

    >>> tree_place(20, 0), tree_place(20, 1), tree_place(20, 2)
    ((None, [1, 2, 3, 4, 5, 6, 7, 8]), (0, [9, 10, 11, 12, 13, 14, 15, 16]), (0, [17, 18, 19]))
    """
    parent = None if index == 0 else (index - 1) // FANOUT
    return parent, list(range(FANOUT * index + 1, min(FANOUT * index + FANOUT + 1, count)))


def read_speakers(text: str) -> tuple[dict[int, int], dict[int, str]]:
    """The `speakers` key's lines, "rank:weight:host:port," each: ({rank: weight}, {rank: its listener's address}).

    >>> read_speakers("4:2:10.0.0.2:5001,0:4:10.0.0.1:5000,")
    ({0: 4, 4: 2}, {0: '10.0.0.1:5000', 4: '10.0.0.2:5001'})
    """
    ordered = sorted((int(rank), int(weight), address)
                     for rank, weight, address in (line.split(":", 2) for line in text.split(",") if line))
    return {rank: weight for rank, weight, _ in ordered}, {rank: address for rank, _, address in ordered}


_open_links: set = set()  # every SocketLinks not closed: a forked child (a DataLoader worker) closes its copies


class SocketLinks:
    """The tree's messages between speakers, over TCP connections of their own (see the module docstring): a listener
    bound where this process's beacon is (`host`), connections a child opens to its parent's listener (`addresses`:
    the speakers' listeners, once read), messages kept per peer in the order they came. Everything happens in the
    caller's thread: send() writes at once (or once the connection is up, at the next wait), a receive's wait polls
    for at most the seconds it is given."""

    def __init__(self, host: str):
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.address = "{}:{}".format(*self.listener.getsockname())
        self.me: int | None = None
        self.addresses: dict[int, str] = {}
        self._peers: dict[int, socket.socket] = {}  # rank -> its connection, once up and known
        self._connecting: dict[int, socket.socket] = {}
        self._unknown: dict[socket.socket, bytearray] = {}  # accepted, its hello not read yet
        self._read: dict[socket.socket, bytearray] = {}  # bytes of a message not whole yet
        self._inbox: dict[int, deque] = {}
        self._outbox: dict[int, bytearray] = {}
        self._ended: dict[int, str] = {}  # rank -> why its connection ended
        _open_links.add(self)

    def receive(self, peer: int, tag: str) -> _Incoming:
        return _Incoming(self, peer)

    def send(self, peer: int, tag: str, number: int, value: int) -> None:
        """Send (number, value) to `peer` (`tag`: its direction, which the connection's order already says). A child
        opens the connection to its parent, the lower rank; a word to a child not connected yet waits for it."""
        if peer < self.me and peer not in self._peers and peer not in self._connecting and peer not in self._ended:
            self._connect(peer)
        self._outbox.setdefault(peer, bytearray()).extend(_WORD.pack(number, value))
        self._flush(peer)

    def close(self) -> None:
        for sock in [self.listener, *self._peers.values(), *self._connecting.values(), *self._unknown]:
            sock.close()
        self._peers, self._connecting, self._unknown = {}, {}, {}
        _open_links.discard(self)

    # -- the connections --------------------------------------------------------------------------

    def _connect(self, peer: int) -> None:
        """Open the connection to `peer`'s listener (this speaker's parent), without waiting: its hello goes first."""
        host, port = self.addresses[peer].rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        failed = sock.connect_ex((host, int(port)))
        if failed not in (0, errno.EINPROGRESS):
            sock.close()
            self._ended[peer] = f"connecting to its listener {self.addresses[peer]}: {os.strerror(failed)}"
            return
        self._connecting[peer] = sock
        self._outbox[peer] = bytearray(_WORD.pack(_HELLO, self.me))

    def _flush(self, peer: int) -> None:
        sock, pending = self._peers.get(peer), self._outbox.get(peer)
        if sock is None or not pending:
            return
        try:
            del pending[:sock.send(pending)]
        except BlockingIOError:
            pass
        except OSError as exc:
            self._end(peer, str(exc))

    def _end(self, peer: int, why: str) -> None:
        self._ended.setdefault(peer, why)
        sock = self._peers.pop(peer, None) or self._connecting.pop(peer, None)
        if sock is not None:
            sock.close()

    def pump(self, seconds: float) -> None:
        """Wait up to `seconds` for something to do, then do it: accept a child, finish a connect, send what waits,
        read what came."""
        masks: dict[int, tuple[socket.socket, int]] = {}  # poll(), not select(): a process's fds may pass 1,024
        for sock in (self.listener, *self._unknown, *self._peers.values()):
            masks[sock.fileno()] = (sock, select.POLLIN)
        for sock in (*self._connecting.values(), *(self._peers[p] for p, out in self._outbox.items()
                                                     if out and p in self._peers)):
            masks[sock.fileno()] = (sock, masks.get(sock.fileno(), (sock, 0))[1] | select.POLLOUT)
        poller = select.poll()
        for fd, (_, mask) in masks.items():
            poller.register(fd, mask)
        events, spin_until = poller.poll(0), time.monotonic() + min(seconds, SPIN_SECONDS)
        while not events and time.monotonic() < spin_until:
            yielded = time.monotonic()
            os.sched_yield()  # a peer this wait is for may need this core: on a host with more ranks than cores
            events = poller.poll(0)
            if time.monotonic() - yielded > YIELDED_AWAY:  # another task took this core: sleep, leave it to them
                break
        if not events:
            events = poller.poll(max(0.0, seconds - SPIN_SECONDS) * 1000)
        ended = select.POLLERR | select.POLLHUP  # read or finish as asked: the error shows there
        ready_write = [masks[fd][0] for fd, event in events if event & (select.POLLOUT | ended)
                       and masks[fd][1] & select.POLLOUT]
        ready_read = [masks[fd][0] for fd, event in events if event & (select.POLLIN | ended)
                      and masks[fd][1] & select.POLLIN]
        for sock in ready_write:
            peer = next((p for p, s in self._connecting.items() if s is sock), None)
            if peer is not None:
                failed = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                del self._connecting[peer]
                if failed:
                    sock.close()
                    self._ended.setdefault(peer, f"connecting to its listener: {os.strerror(failed)}")
                    continue
                self._peers[peer] = sock
                self._read[sock] = bytearray()
            peer = next((p for p, s in self._peers.items() if s is sock), None)
            if peer is not None:
                self._flush(peer)
        for sock in ready_read:
            if sock is self.listener:
                self._accept()
            else:
                self._take(sock)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            self._unknown[sock] = bytearray()

    def _take(self, sock: socket.socket) -> None:
        """Read what `sock` brought: a child's hello (then it is known by its rank), or messages for the inbox."""
        peer = next((p for p, s in self._peers.items() if s is sock), None)
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as exc:
            data, why = b"", str(exc)
        else:
            why = "connection closed by peer"
        if not data:
            if peer is None:
                self._unknown.pop(sock, None)
                sock.close()
            else:
                self._end(peer, why)
            return
        buffer = self._unknown[sock] if peer is None else self._read[sock]
        buffer.extend(data)
        while len(buffer) >= _WORD.size:
            number, value = _WORD.unpack_from(buffer)
            del buffer[:_WORD.size]
            if peer is None:  # a hello, or a stranger: closed
                del self._unknown[sock]
                if number != _HELLO or value in self._peers:
                    sock.close()
                    return
                peer, self._peers[value], self._read[sock] = value, sock, buffer
                continue
            self._inbox.setdefault(peer, deque()).append((number, value))


class _Incoming:
    """The next message from `peer`: wait(seconds) until it came (raises RuntimeError when its connection ended
    first), then value()."""

    def __init__(self, links: SocketLinks, peer: int):
        self.links, self.peer, self._got = links, peer, None

    def wait(self, seconds: float) -> bool:
        links, deadline = self.links, time.monotonic() + seconds
        while True:
            if self._got is not None:
                return True
            if links._inbox.get(self.peer):
                self._got = links._inbox[self.peer].popleft()
                return True
            if self.peer in links._ended:
                raise RuntimeError(f"rank {self.peer}'s commit connection ended: {links._ended[self.peer]}")
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            links.pump(left)

    def value(self) -> tuple[int, int]:
        return self._got


def _close_in_child() -> None:
    for links in list(_open_links):
        links.close()


os.register_at_fork(after_in_child=_close_in_child)


@dataclass
class CommitTree:
    """This speaker's place in the tree of a generation's speakers ({rank: weight}, in rank order)."""

    speakers: dict[int, int]
    me: int
    links: object  # SocketLinks, or a test's
    parent: int | None = field(init=False)
    children: list[int] = field(init=False)

    def __post_init__(self):
        order = list(self.speakers)
        parent, children = tree_place(len(order), order.index(self.me))
        self.parent = None if parent is None else order[parent]
        self.children = [order[child] for child in children]

    def settle(self, number: int, weight: int | None, world_size: int, in_doubt, give_up, watched_wait) -> bool:
        """Step `number`'s outcome, through the tree: `weight` ranks of this speaker's host are ready (None: this
        host cannot apply the step). The root decides. `in_doubt()`: the outcome as the ranks left say it, for a
        speaker whose vote went up ready and whose parent's word cannot come (commit.py's _doubt); `give_up()`: the
        step fails here before this speaker's vote went up (says so to the others' waits); `watched_wait(arriving)`:
        waits for a message, raising PeerDiedError once the step is given up or a member found gone, False past the
        membership timeout."""
        votes = [(child, self.links.receive(child, _UP)) for child in self.children]
        heard = self.links.receive(self.parent, _DOWN) if self.parent is not None else None
        total, sent_up = (weight if weight is not None else NOT_READY), False
        try:
            for child, arriving in votes:
                if total == NOT_READY:
                    break
                vote = self._heard(arriving, number, child, watched_wait)
                total = NOT_READY if vote == NOT_READY else total + vote
            if self.parent is None:
                if total not in (NOT_READY, world_size):
                    raise MembershipError(explain(
                        f"the per-step commit of step {number} counted {total} ranks ready", rank=self.me,
                        seen=f"speakers {self.speakers}", expected=f"{world_size}, the generation's members",
                        fix="This is a bug in phalanx: please report it with the run's log."))
                applied = total == world_size  # the root's word is the outcome: nobody else decides
            else:
                self.links.send(self.parent, _UP, number, total)
                sent_up = True
                applied = total != NOT_READY and self._heard(heard, number, self.parent, watched_wait) == 1
        except PeerDiedError:
            if sent_up and total != NOT_READY:  # the root may have decided either way
                applied = in_doubt()
            else:  # this subtree's vote is missing or NOT_READY: the root cannot apply the step
                applied = False
                give_up()
                if self.parent is not None and not sent_up:
                    self.links.send(self.parent, _UP, number, NOT_READY)
        for child in self.children:
            self.links.send(child, _DOWN, number, int(applied))
        return applied

    def _heard(self, arriving, number: int, peer: int, watched_wait) -> int:
        if not watched_wait(arriving):
            raise PeerDiedError(f"rank {peer} said nothing of step {number} within the membership timeout")
        said, value = arriving.value()
        if said != number:
            raise MembershipError(explain(
                f"rank {peer}'s word in the per-step commit was about step {said}", rank=self.me,
                seen=f"step {said}", expected=f"step {number}",
                fix="This is a bug in phalanx: please report it with the run's log."))
        return value
