"""The interface Gloo and NCCL use between hosts when nobody named one (world/interface.py): one process."""

import socket

import pytest

from phalanx.world import interface
from phalanx.world.interface import choose, set_for_world

TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.12"], "ib0": ["192.168.5.12"]}


class TestChoose:
    def test_the_interface_of_the_route_to_the_master(self):
        assert choose("192.168.5.11", "192.168.5.12", TABLE, "eth0")[:2] == ("ib0", "192.168.5.12")
        assert choose("10.0.0.11", "10.0.0.12", TABLE, "eth0")[:2] == ("eth0", "10.0.0.12")

    def test_a_master_named_after_loopback_takes_the_default_route(self):
        """The master's own host, where its name resolves to 127.0.1.1."""
        name, address, why = choose("127.0.1.1", "127.0.0.1", TABLE, "ib0")
        assert (name, address) == ("ib0", "192.168.5.12")
        assert "default route" in why and "loopback" in why

    def test_without_a_default_route_the_only_network_interface(self):
        assert choose("127.0.1.1", "127.0.0.1", {"lo": ["127.0.0.1"], "eth0": ["10.0.0.12"]}, None)[:2] == \
            ("eth0", "10.0.0.12")

    def test_no_guess_between_several_interfaces(self):
        assert choose("127.0.1.1", "127.0.0.1", TABLE, None)[0] is None


def this_hosts_address() -> str:
    for addresses in interface._interface_addresses().values():
        for address in addresses:
            if "." in address and not address.startswith("127."):
                return address
    pytest.skip("this host has no IPv4 address besides loopback")


class TestSetForWorld:
    def test_sets_both_variables_to_the_interface_that_reaches_the_master(self):
        master = this_hosts_address()
        owner = next(name for name, listed in interface._interface_addresses().items() if master in listed)
        env = {}
        choice = set_for_world(master, True, env)
        assert env == {"GLOO_SOCKET_IFNAME": owner, "NCCL_SOCKET_IFNAME": owner}
        assert choice.name == owner and choice.level == "info"
        assert f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME={owner} ({master})" in choice.sentence
        assert "the route to the master" in choice.sentence

    def test_a_users_setting_wins(self):
        master = this_hosts_address()
        env = {"GLOO_SOCKET_IFNAME": "mine", "NCCL_SOCKET_IFNAME": "ours"}
        assert set_for_world(master, True, env) is None
        assert env == {"GLOO_SOCKET_IFNAME": "mine", "NCCL_SOCKET_IFNAME": "ours"}

    def test_only_the_unset_variable_is_set(self):
        master = this_hosts_address()
        env = {"GLOO_SOCKET_IFNAME": "mine"}
        choice = set_for_world(master, True, env)
        assert env["GLOO_SOCKET_IFNAME"] == "mine" and env["NCCL_SOCKET_IFNAME"] == choice.name
        assert choice.sentence.startswith(f"NCCL_SOCKET_IFNAME={choice.name} ")

    @pytest.mark.parametrize("master, spans_hosts", [("10.0.0.1", False), (None, True), ("127.0.0.1", True)])
    def test_nothing_to_choose_on_one_host(self, master, spans_hosts):
        env = {}
        assert set_for_world(master, spans_hosts, env) is None and env == {}

    def test_a_master_that_does_not_resolve_is_left_to_the_rendezvous(self, monkeypatch):
        def no_such_host(*args, **kwargs):
            raise socket.gaierror(-2, "Name or service not known")

        monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
        env = {}
        assert set_for_world("no-such-host.invalid", True, env) is None and env == {}

    def test_no_interface_known_is_a_warning_that_says_what_to_set(self, monkeypatch):
        monkeypatch.setattr(interface, "_interface_addresses", lambda: TABLE)
        monkeypatch.setattr(interface, "_default_route_interface", lambda: None)
        monkeypatch.setattr(interface, "_resolve", lambda host: "127.0.1.1")
        env = {}
        choice = set_for_world("node1", True, env)
        assert choice.name is None and choice.level == "warning" and env == {}
        assert "node1 (127.0.1.1)" in choice.sentence and "GLOO_SOCKET_IFNAME" in choice.sentence
