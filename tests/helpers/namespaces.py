"""Hosts on one machine, for the multi-node tests and benchmarks: network namespaces joined by a veth pair (two
hosts), or each by a veth pair to a bridge (any number).

Names carry a random tag, so runs side by side (or a previous run's leftovers) never collide; whatever
was made is deleted on the way out, also when the set-up itself fails half-way. A namespace's own /etc files
(`etc_files`) go in /etc/netns, which tests side by side share.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.system_packages import IPROUTE2

ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` mounts /etc/netns/NS/<file> over /etc/<file>


class NamespaceUnavailable(RuntimeError):
    """This machine (or user) cannot create a network namespace."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _add_namespaces(hosts: list[dict], created: list) -> None:
    """Make each host's namespace, noting in `created` what to delete; NamespaceUnavailable when one cannot be."""
    reason = IPROUTE2.missing()
    if reason is not None:
        raise NamespaceUnavailable(reason)
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


@contextmanager
def bridged_hosts_or_skip(prefix: str, octet: int, count: int) -> Iterator[list[dict]]:
    """bridged_hosts() for a test's fixture: the test skips, saying why, where namespaces cannot be made."""
    import pytest

    try:
        with bridged_hosts(prefix, octet, count) as hosts:
            yield hosts
    except NamespaceUnavailable as exc:
        pytest.skip(f"multi-host test skipped: {exc}")


@contextmanager
def etc_files(namespace: str, files: dict[str, str]) -> Iterator[Path]:
    """Yield /etc/netns/<namespace>/, holding `files` ({name: text}: what /etc/<name> reads inside the namespace);
    removed on the way out, with /etc/netns too if this made it and nothing else is in it by then. Other tests
    use /etc/netns at the same time: it is made by a mkdir that may fail, never by a check and then a mkdir."""
    folder = ETC_NETNS / namespace
    while True:
        try:
            ETC_NETNS.mkdir()
            made_root = True
        except FileExistsError:
            made_root = False
        try:
            folder.mkdir()
            break
        except FileNotFoundError:  # the test that made /etc/netns removed it between the two mkdirs
            continue
    try:
        for name, text in files.items():
            (folder / name).write_text(text)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if made_root:
            try:
                ETC_NETNS.rmdir()
            except OSError:  # another test's files are in it: it stays, empty once they are gone
                pass
