"""Who watches whom under live recovery (world/watch.py, world/liveness.py): one peer per rank, found by reading its own
host's identities and the next host's only; a kept-open connection that ends when the peer's process does, and
quietly when the watch is closed. One process; sockets on loopback."""

from __future__ import annotations

import socket
import threading

import pytest

from phalanx.world.liveness import KeptWatch
from phalanx.world.watch import ring_place


def _hosts(*sizes: int) -> dict[int, str]:
    """Ranks 0.. in blocks of `sizes`, one host name per block."""
    hosts, rank = {}, 0
    for number, size in enumerate(sizes):
        for _ in range(size):
            hosts[rank] = f"host{number}"
            rank += 1
    return hosts


def test_each_rank_watches_its_local_index_on_the_next_host_and_is_watched_once():
    hosts = _hosts(4, 4, 4)
    members = tuple(sorted(hosts))
    watched = {me: ring_place(members, me, hosts.get)[1] for me in members}
    assert watched[1] == 5 and watched[5] == 9 and watched[9] == 1  # a ring per local index
    assert sorted(watched.values()) == list(members)  # every rank watched by exactly one other
    assert ring_place(members, 6, hosts.get)[0] == (4, 5, 6, 7)


def test_hosts_of_different_sizes_and_one_host_alone():
    hosts = _hosts(2, 3, 1)
    members = tuple(sorted(hosts))
    assert [ring_place(members, me, hosts.get)[1] for me in members] == [2, 3, 5, 5, 5, 0]
    single = _hosts(3)
    assert ring_place((0, 1, 2), 1, single.get) == ((0, 1, 2), None, ())  # one host: peers by pid, nobody watched


def test_the_ranks_left_after_a_loss_and_a_joiner_keep_the_ring():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b", 7: "c"}  # rank 4 of host c was lost; 7 joined there later
    members = (0, 1, 2, 3, 7)
    assert ring_place(members, 7, hosts.get) == ((7,), 0, (0, 1))
    assert ring_place(members, 3, hosts.get) == ((2, 3), 7, (7,))


def test_finding_its_place_reads_two_hosts_identities_not_the_world():
    hosts = _hosts(*[8] * 64)  # 512 ranks, 8 per host
    asked: list[int] = []

    def host_of(member: int) -> str:
        asked.append(member)
        return hosts[member]

    ring_place(tuple(sorted(hosts)), 203, host_of)
    assert len(set(asked)) <= 2 * 8 + 2, sorted(set(asked))


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    yield server
    server.close()


def _address(server: socket.socket) -> str:
    host, port = server.getsockname()
    return f"{host}:{port}"


def test_a_kept_watch_says_the_peer_is_gone_when_its_end_closes(listener):
    verdict = threading.Event()
    seen = []
    watch = KeptWatch(_address(listener), lambda why: (seen.append(why), verdict.set()))
    peer, _ = listener.accept()
    assert not verdict.wait(0.3), "a watch with its peer alive said it was gone"
    peer.close()  # what the kernel does for a process that ends
    assert verdict.wait(2.0) and seen == ["closed"]
    watch.close()


def test_a_kept_watch_of_a_port_nobody_listens_on_says_gone_at_once():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    address = _address(probe)
    probe.close()  # nothing listens there now: connections are refused
    verdict = threading.Event()
    seen = []
    KeptWatch(address, lambda why: (seen.append(why), verdict.set()))
    assert verdict.wait(2.0) and seen == ["closed"]


def test_closing_a_watch_says_nothing(listener):
    seen = []
    watch = KeptWatch(_address(listener), seen.append)
    peer, _ = listener.accept()
    watch.close()
    watch._thread.join(2.0)
    peer.close()
    assert not watch._thread.is_alive() and seen == []
