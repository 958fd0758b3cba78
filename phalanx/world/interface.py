"""Which network interface Gloo and NCCL use between hosts, when nobody said.

Left alone, Gloo binds to the address its host's name resolves to: 127.0.1.1 on many Debian hosts, a
management network on some clusters, and the other hosts cannot reach it (pytorch/gloo#335). The one
interface known to reach the other hosts is the one the kernel routes the master's address through, so
that is the choice: a UDP socket "connected" to the master (no packet is sent) shows which local
address the kernel would send from, and that address belongs to one interface. A user's
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME is never overridden.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import MutableMapping
from dataclasses import dataclass

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (first) IPv4 address


@dataclass(frozen=True)
class Choice:
    """The interface chosen (or None) and the sentence that says why, to log at `level`."""

    name: str | None
    sentence: str
    level: str = "info"


def set_for_world(master_addr: str | None, spans_hosts: bool,
                  environ: MutableMapping[str, str] | None = None) -> Choice | None:
    """Set each unset IFNAME variable of `environ` (default os.environ) to the interface that reaches the
    master; None when there is nothing to do (one host, or both variables already set)."""
    env = os.environ if environ is None else environ
    unset = [name for name in IFNAME_VARIABLES if not env.get(name)]
    if not spans_hosts or not master_addr or not unset or _is_loopback(master_addr):
        return None  # a literal loopback master: every rank is on this host, whatever the counts say
    master_ip = _resolve(master_addr)
    if master_ip is None:
        return None  # the rendezvous will say that the master cannot be found
    name, address, how = choose(master_ip, _source_address(master_ip), _interface_addresses(),
                                _default_route_interface())
    override = " / ".join(f"{variable}" for variable in IFNAME_VARIABLES)
    if name is None:
        return Choice(None, f"no interface of this host is known to reach the master {master_addr} "
                            f"({master_ip}); if the hosts cannot connect, set {override}", "warning")
    for variable in unset:
        env[variable] = name
    master = master_addr if master_addr == master_ip else f"{master_addr} ({master_ip})"
    return Choice(name, f"{' and '.join(unset)}={name} ({address}), {how.format(master=master)}; "
                        f"set {override} to choose another")


def choose(master_ip: str, source: str | None, addresses: dict[str, list[str]],
           default_interface: str | None) -> tuple[str | None, str | None, str]:
    """(interface, its address, why) from the kernel's source address for the master, the interfaces'
    addresses and the default route's interface; `why` has a {master} field. Pure.

    >>> choose("10.0.0.1", "10.0.0.2", {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}, "eth0")
    ('eth0', '10.0.0.2', 'the interface of the route to the master {master}')
    """
    owner = {address: name for name, listed in addresses.items() for address in listed}
    if source is not None and not _is_loopback(source) and source in owner:
        return owner[source], source, "the interface of the route to the master {master}"
    # The master's name leads to loopback here: this is the master's host, named after 127.0.1.1 in its
    # own /etc/hosts. The others reach it by its network address: take the default route's interface,
    # else the only interface besides loopback.
    outside = {name: listed for name, listed in addresses.items() if not all(map(_is_loopback, listed))}
    loopback = "(the master {master} is a loopback address on this host)"
    if default_interface in outside:
        return default_interface, outside[default_interface][0], f"the interface of the default route {loopback}"
    if len(outside) == 1:
        name, listed = next(iter(outside.items()))
        return name, listed[0], f"this host's only interface besides loopback {loopback}"
    return None, None, ""


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def _resolve(host: str) -> str | None:
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return None
    found.sort(key=lambda entry: entry[0] != socket.AF_INET)  # IPv4 first, as TCPStore dials
    return found[0][4][0] if found else None


def address_toward(master_addr: str) -> str | None:
    """This host's address on the route to `master_addr` (what the other hosts can reach it by), or None."""
    master_ip = _resolve(master_addr)
    return _source_address(master_ip) if master_ip is not None else None


def _source_address(master_ip: str) -> str | None:
    """The local address the kernel would send from to reach `master_ip` (no packet leaves)."""
    family = socket.AF_INET6 if ":" in master_ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master_ip, 9))
            return probe.getsockname()[0]
    except OSError:  # no route at all
        return None


def _interface_addresses() -> dict[str, list[str]]:
    """{interface: its addresses}: IPv4 from the kernel (SIOCGIFADDR), IPv6 from /proc/net/if_inet6."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            found.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) == 6:
                    text = ":".join(fields[0][i:i + 4] for i in range(0, 32, 4))
                    found.setdefault(fields[5], []).append(socket.inet_ntop(socket.AF_INET6,
                                                                            socket.inet_pton(socket.AF_INET6, text)))
    except OSError:
        pass
    return found


def _default_route_interface() -> str | None:
    """The interface of the IPv4 default route with the lowest metric (/proc/net/route), or None."""
    try:
        with open("/proc/net/route") as table:
            rows = [line.split() for line in table.readlines()[1:]]
    except OSError:
        return None
    defaults = [(int(row[6]), row[0]) for row in rows
                if len(row) > 7 and row[1] == "00000000" and row[7] == "00000000" and int(row[3], 16) & 1]
    return min(defaults)[1] if defaults else None
