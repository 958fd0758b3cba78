"""Hosts on one machine, for the multi-node tests and benchmarks: network namespaces joined by a veth pair (two
hosts), or each by a veth pair to a bridge (any number).

Names carry a random tag, so runs side by side (or a previous run's leftovers) never collide; whatever
was made is deleted on the way out, also when the set-up itself fails half-way.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


class NamespaceUnavailable(RuntimeError):
    """This machine (or user) cannot create a network namespace."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _add_namespaces(hosts: list[dict], created: list) -> None:
    """Make each host's namespace, noting in `created` what to delete; NamespaceUnavailable when one cannot be."""
    for host in hosts:
        made = ip("netns", "add", host["ns"], check=False)
        if made.returncode != 0:
            raise NamespaceUnavailable(f"cannot create a network namespace ({made.stderr.strip()})")
        created.append(host["ns"])


def _address(host: dict) -> None:
    """The host's end of its link, now in its namespace: its address, up, and the namespace's loopback up."""
    ip("-n", host["ns"], "addr", "add", f"{host['addr']}/24", "dev", host["dev"])
    ip("-n", host["ns"], "link", "set", host["dev"], "up")
    ip("-n", host["ns"], "link", "set", "lo", "up")


@contextmanager
def veth_hosts(prefix: str, octet: int) -> Iterator[list[dict]]:
    """Yield [{"ns", "dev", "addr"} of host 0, of host 1]: namespaces `<prefix><tag>0/1`, addresses
    10.<octet>.<tag>.1/.2 on a /24; NamespaceUnavailable when a namespace cannot be made."""
    tag = uuid.uuid4().hex[:6]
    hosts = [{"ns": f"{prefix}{tag}{i}", "dev": f"{prefix}{tag}v{i}", "addr": f"10.{octet}.{int(tag[:2], 16)}.{i + 1}"}
             for i in (0, 1)]
    created = []
    try:
        _add_namespaces(hosts, created)
        ip("link", "add", hosts[0]["dev"], "type", "veth", "peer", "name", hosts[1]["dev"])
        for host in hosts:
            ip("link", "set", host["dev"], "netns", host["ns"])
            _address(host)
        yield hosts
    finally:
        for name in created:  # deleting a namespace also deletes its end of the veth pair
            ip("netns", "del", name, check=False)


@contextmanager
def bridged_hosts(prefix: str, octet: int, count: int) -> Iterator[list[dict]]:
    """Yield [{"ns", "dev", "addr"}] for `count` hosts: namespaces `<prefix><tag><i>`, each with one end of a veth
    pair, the other end on a bridge in this namespace; addresses 10.<octet>.<tag>.<i + 1> on a /24.
    NamespaceUnavailable when a namespace cannot be made."""
    tag = uuid.uuid4().hex[:6]
    bridge = f"{prefix}{tag}br"
    hosts = [{"ns": f"{prefix}{tag}{i}", "dev": f"{prefix}{tag}v{i}", "peer": f"{prefix}{tag}p{i}",
              "addr": f"10.{octet}.{int(tag[:2], 16)}.{i + 1}"} for i in range(count)]
    created, links = [], []
    try:
        _add_namespaces(hosts, created)
        ip("link", "add", bridge, "type", "bridge")
        links.append(bridge)
        ip("link", "set", bridge, "up")
        for host in hosts:
            ip("link", "add", host["dev"], "type", "veth", "peer", "name", host["peer"])
            links.append(host["peer"])  # deleting this end deletes the pair, wherever the other end is
            ip("link", "set", host["dev"], "netns", host["ns"])
            ip("link", "set", host["peer"], "master", bridge)
            ip("link", "set", host["peer"], "up")
            _address(host)
        yield hosts
    finally:
        for name in created:
            ip("netns", "del", name, check=False)
        for link in reversed(links):
            ip("link", "del", link, check=False)

