"""`phalanx run` launchers waiting for nodes that do not come: a line every 10 s, a stop within 2 s, a node rank
given twice named on every launcher.

Several launchers on this machine, all on 127.0.0.1, act as the nodes (a different --node-rank each for a fixed
--nnodes N; the first to bind the port hosts an elastic run's store, the others dial it). No worker ever
starts: the launchers only wait, so a test costs the launchers' forks from the warm server (tests/conftest.py).
"""

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from phalanx.testing import free_port
from tests.conftest import ROOT
from tests.e2e.test_launch import clean_env

WORKER = str(Path(__file__).resolve().parent / "jobs" / "launch_worker.py")
LINE_WITHIN = 30  # seconds for a launcher's first waiting line: its start (a fork, or seconds fresh) and 10 s
STOP_WITHIN = 2.0  # seconds from the signal to the launcher's exit: what a user may expect of a wait
HANG_GUARD = 60


class Launch:
    """One `phalanx run` in a session of its own; its output is read as it comes."""

    def __init__(self, *flags):
        self.process = subprocess.Popen([sys.executable, "-m", "phalanx", "run", *flags, WORKER], env=clean_env(),
                                        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, within: float, after: int = 0) -> re.Match:
        """The first line from the `after`-th on that matches `pattern`; fails after `within` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for line in self.lines[after:]:
                if found := re.search(pattern, line):
                    return found
            assert self.process.poll() is None, f"the launcher ended ({self.process.returncode}):\n{self.output}"
            time.sleep(0.05)
        pytest.fail(f"no line matching {pattern!r} within {within} s:\n{self.output}")

    def stop(self, sig: signal.Signals) -> float:
        """Send `sig`; the seconds until the launcher ended."""
        asked = time.monotonic()
        self.process.send_signal(sig)
        self.process.wait(timeout=HANG_GUARD)
        ended = time.monotonic()
        self._reader.join(timeout=10)
        return ended - asked

    def finish(self) -> int:
        self.process.wait(timeout=HANG_GUARD)
        self._reader.join(timeout=10)
        return self.process.returncode

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def launchers():
    started: list[Launch] = []
    yield lambda *flags: started.append(Launch(*flags)) or started[-1]
    for launcher in started:
        launcher.kill()


def fixed(nnodes: int, node_rank: int, port: int) -> tuple:
    return ("--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--rdzv-timeout", "120")


def wait_until_listening(port: int) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail(f"nobody listens on 127.0.0.1:{port}")


def assert_stopped_while_waiting(launcher: Launch, sig: signal.Signals) -> None:
    took = launcher.stop(sig)
    assert launcher.process.returncode == 75, launcher.output
    assert f"stopped on request ({sig.name}) during the rendezvous, before any worker started" in launcher.output
    assert took < STOP_WITHIN, f"{took:.2f} s after {sig.name}:\n{launcher.output}"


@pytest.mark.waiting(seconds=15)
def test_fixed_nodes_waiting_for_the_others_say_so_and_stop_on_sigterm_and_ctrl_c(launchers):
    """Two lone node 0s of --nnodes 2 (one for SIGTERM, one for Ctrl-C) and a lone node 1 whose node 0 never comes."""
    ports = [free_port(), free_port(), free_port()]
    by_sigterm, by_sigint = launchers(*fixed(2, 0, ports[0])), launchers(*fixed(2, 0, ports[1]))
    node_1 = launchers(*fixed(2, 1, ports[2]))
    for launcher, port in ((by_sigterm, ports[0]), (by_sigint, ports[1])):
        found = launcher.wait_for(r"^phalanx run: waiting for the other nodes: 1 of 2 in, missing node rank 1; "
                                  rf"store at 127\.0\.0\.1:{port}; (\d+) s left of --rdzv-timeout 120 s\.$",
                                  LINE_WITHIN)
        assert 100 <= int(found.group(1)) <= 111, found.group(0)
    node_1.wait_for(rf"^phalanx run: waiting for node 0: its store at 127\.0\.0\.1:{ports[2]} does not answer yet "
                    r"\(this is node 1 of --nnodes 2\); \d+ s left of --rdzv-timeout 120 s\.$", LINE_WITHIN)
    assert_stopped_while_waiting(by_sigterm, signal.SIGTERM)
    assert_stopped_while_waiting(by_sigint, signal.SIGINT)
    assert_stopped_while_waiting(node_1, signal.SIGTERM)


def test_a_node_rank_given_twice_fails_every_launcher_naming_both(launchers):
    """--nnodes 3 given node ranks 0, 1, 1; and --nnodes 2 given 0 twice (as two launchers without --node-rank)."""
    port, other_port = free_port(), free_port()
    three = [launchers(*fixed(3, 0, port))]
    wait_until_listening(port)
    three += [launchers(*fixed(3, 1, port)), launchers(*fixed(3, 1, port))]
    two = [launchers(*fixed(2, 0, other_port))]
    wait_until_listening(other_port)
    two.append(launchers(*fixed(2, 0, other_port)))
    host = re.escape(socket.gethostname())
    for node_rank, group in ((1, three), (0, two)):
        named = set()
        for launcher in group:
            assert launcher.finish() == 1, launcher.output
            found = re.search(rf"^phalanx run: DuplicateNodeRankError: node rank {node_rank} was given to two "
                              rf"launchers: seen {host} \(127\.0\.0\.1, pid (\d+)\) and {host} \(127\.0\.0\.1, "
                              rf"pid (\d+)\).*--node-rank", launcher.output, re.MULTILINE)
            assert found, launcher.output
            assert found.group(1) != found.group(2)
            named.add(found.groups())
        assert len(named) == 1, named  # every launcher names the same two


@pytest.mark.waiting(seconds=25)
def test_an_elastic_node_waiting_for_a_round_says_so_and_a_stop_leaves_the_round_to_the_others(launchers):
    """--nnodes 3:4 with two nodes: the second, stopped while both wait, leaves the round without closing it; the
    first (the store's host) goes on waiting with one node fewer, and stops within 2 s too."""
    port = free_port()
    flags = ("--nnodes", "3:4", "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "120")
    host = launchers(*flags)
    wait_until_listening(port)
    guest = launchers(*flags)
    line = (r"^phalanx run: waiting for the other nodes: {} node\(s\) in round 0, which starts with 3 "
            rf"\(--nnodes 3:4\); store at 127\.0\.0\.1:{port}; \d+ s left of --rdzv-timeout 120 s\.$")
    guest.wait_for(line.format(2), LINE_WITHIN)
    assert_stopped_while_waiting(guest, signal.SIGTERM)
    seen = len(host.lines)
    host.wait_for(line.format(1), 12, after=seen)  # still waiting: the rendezvous was not closed under it
    assert "RunEndedError" not in host.output
    assert_stopped_while_waiting(host, signal.SIGTERM)
