"""N simulated hosts on one machine for benchmarks/hosts/xhost_bench.py: network namespaces on a bridge, shaped.

Each host is a namespace with one veth port; the ports' other ends sit on a bridge in a namespace of
its own (nothing is added to the machine's own namespace). Each port is shaped in both directions
with tc tbf: on the host's end (what it sends) and on the bridge's end (what it receives). Offloads
are off on both ends (ethtool -K), so tbf sees wire-sized packets and the rate is accurate. This
kernel has no netem: the shaping sets the rate, not a delay. Every name carries a random tag, and
`Hosts` (a context manager) deletes every namespace it made, also on failure.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import time


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=60)


_SERVE = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', {port})); s.listen(1)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range({pings}):
    c.sendall(c.recv(1))
got, first = 0, None
while got < {nbytes}:
    chunk = c.recv(1 << 20)
    if not chunk: break
    first = first or time.perf_counter(); got += len(chunk)
print(got, time.perf_counter() - first)
"""

_SEND = """
import socket, time
deadline = time.monotonic() + 60
while True:  # the server's interpreter may still be starting (a loaded machine)
    try:
        c = socket.create_connection(('{addr}', {port}), timeout=30)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range({pings}):
    t = time.perf_counter(); c.sendall(b'x'); c.recv(1); rtts.append(time.perf_counter() - t)
c.sendall(bytes({nbytes})); c.close()
print(sorted(rtts)[len(rtts) // 2])
"""


class Hosts:
    """`count` namespaces on a bridge, each port shaped to `rate` (tc syntax, e.g. "300mbit") both ways; with
    `rate=None` the ports are left unshaped (the same hosts, as fast as the machine moves the bytes)."""

    def __init__(self, count: int, rate: str | None):
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise SystemExit("xhost bench: needs iproute2 (ip, tc)")
        self.count, self.rate = count, rate
        self.tag = secrets.token_hex(3)
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.switch = f"phx{self.tag}sw"
        self.names = [f"phx{self.tag}h{i}" for i in range(count)]
        self.devs = [f"phx{self.tag}e{i}" for i in range(count)]
        self.ports = [f"phx{self.tag}p{i}" for i in range(count)]
        self.addrs = [f"{self.subnet}.{i + 1}" for i in range(count)]
        self.made: list[str] = []
        self.offloads = shutil.which("ethtool") is not None

    def __enter__(self) -> Hosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _build(self) -> None:
        sh("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for ns, dev, port, addr in zip(self.names, self.devs, self.ports, self.addrs):
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "link", "set", port, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            sh("ip", "-n", self.switch, "link", "set", port, "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            for where, name in ((ns, dev), (self.switch, port)):
                if self.offloads:
                    sh("ip", "netns", "exec", where, "ethtool", "-K", name, "tso", "off", "gso", "off", "gro", "off",
                       check=False)
                if self.rate is None:
                    continue
                # burst: a few ms of the rate (at least 32 KB); the queue holds up to 100 ms of it
                sh("tc", "-n", where, "qdisc", "add", "dev", name, "root", "tbf", "rate", self.rate, "burst",
                   "64kb", "latency", "100ms")

    def close(self) -> None:
        for ns in reversed(self.made):  # deleting a namespace deletes its veth ends and their qdiscs
            sh("ip", "netns", "del", ns, check=False)
        self.made.clear()

    def run(self, host: int, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[host], *args], capture_output=True, text=True,
                              timeout=120)

    def measure(self, sender: int, receiver: int, nbytes: int = 4 << 20, pings: int = 20) -> tuple[float, float]:
        """(Mbit/s, round trip in ms) from host `sender` to host `receiver`, over TCP."""
        port = 20000 + secrets.randbelow(20000)
        server = subprocess.Popen(["ip", "netns", "exec", self.names[receiver], sys.executable, "-c",
                                   _SERVE.format(port=port, nbytes=nbytes, pings=pings)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(0.3)
            sent = self.run(sender, sys.executable, "-c",
                            _SEND.format(addr=self.addrs[receiver], port=port, nbytes=nbytes, pings=pings))
            out, err = server.communicate(timeout=120)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        if sent.returncode or server.returncode:
            raise RuntimeError(f"link test {sender} -> {receiver} failed: {sent.stderr} {err}")
        got, seconds = out.split()
        return int(got) * 8 / float(seconds) / 1e6, float(sent.stdout) * 1e3
