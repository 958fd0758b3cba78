"""The rendezvous store phalanx binds itself (unit tests in this process, loopback only)."""

import socket
from datetime import timedelta

import pytest

from phalanx.errors import MasterUnreachableError, PortInUseError
from phalanx.testing import free_port
from phalanx.world.meeting.store import LOOPBACK, host_or_join, host_store, join_store, owns_address


def listening_addresses(port: int) -> set:
    """Local addresses with a socket in LISTEN state on `port`, from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            pytest.skip("needs Linux's /proc/net/tcp")
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if int(port_hex, 16) == port and state == "0A":  # 0A: LISTEN
                found.add(address)
    return found


def test_single_host_store_listens_on_loopback_only_on_a_free_port():
    store = host_store(LOOPBACK, 0, 1)
    assert store.port > 0
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    client = join_store(LOOPBACK, store.port, 1, rank=0, connect_timeout=timedelta(seconds=5))
    store.set("key", "value")
    assert client.get("key") == b"value"


def test_multi_host_store_listens_on_every_interface():
    store = host_store(LOOPBACK, 0, 2, all_interfaces=True)
    assert listening_addresses(store.port) == {"00000000"}


def test_busy_port_is_a_port_in_use_error():
    with socket.socket() as other_program:
        other_program.bind((LOOPBACK, 0))
        other_program.listen()
        port = other_program.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} is already in use"):
            host_store(LOOPBACK, port, 2)


def test_nobody_listening_is_master_unreachable_naming_address_and_port():
    port = free_port()
    with pytest.raises(MasterUnreachableError, match=f"127.0.0.1:{port}"):
        join_store(LOOPBACK, port, 2, rank=3, connect_timeout=timedelta(seconds=1))


def test_the_node_that_owns_the_master_address_hosts_the_store():
    """An elastic node hosts when it can bind the master address; otherwise it dials (here: the port is taken by a
    store already, as by a second node on one machine)."""
    assert owns_address(LOOPBACK)
    assert not owns_address("192.0.2.1")  # TEST-NET-1: bound nowhere (bind() sends no packet)
    port = free_port()
    first, hosting = host_or_join(LOOPBACK, port, timeout=timedelta(seconds=5), timeout_setting="--rdzv-timeout")
    second, dialled = host_or_join(LOOPBACK, port, timeout=timedelta(seconds=5), timeout_setting="--rdzv-timeout")
    assert (hosting, dialled) == (True, False)
    first.set("key", "value")
    assert second.get("key") == b"value"


def test_a_master_nobody_serves_is_named_without_torchs_cpp_trace(capfd):
    port = free_port()
    with pytest.raises(MasterUnreachableError) as caught:
        join_store(LOOPBACK, port, 2, rank=None, connect_timeout=timedelta(seconds=1),
                   timeout_setting="--rdzv-timeout")
    assert f"{LOOPBACK}:{port}" in str(caught.value) and "--rdzv-timeout" in str(caught.value)
    assert "frame #" not in capfd.readouterr().err
