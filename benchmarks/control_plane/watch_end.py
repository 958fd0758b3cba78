"""The unit `t_end` of the control plane's scale model: seconds from a SIGKILL of a worker to its kept watch's verdict
on another namespace host (control_plane_units.py runs it; control_plane_model.py's "a process gone: named").

The kernel closes a killed process's sockets only once its address space is torn down (do_exit: exit_mm, then
exit_files), so the verdict waits for that teardown, whose length follows what the process holds and who else holds
it: ~2 ms for a bare Python, 46-72 ms with torch imported, 110-123 ms with 300 MB of tensors more (loopback, load
9). A worker forked from its launcher's server shares most of its pages with its ancestors: while one of them lives
its teardown unmaps them (22-44 ms here), where with every sharer killed at once it may have to free them (28-87 ms,
10 kills, when the launcher was killed first). So the victim is a worker as the runs' are: started by `phalanx run
--nproc-per-node 1` (from a warm launcher, as their commands are), phalanx initialized (a world of one),
tests/e2e/jobs/control_plane_job.py's model in phalanx DDP trained a few steps, its beacon (liveness.py's: accept,
keep, read the watcher's bytes) served beside; it and the process that forked it are SIGKILLed together, by pid, and
its launcher once the verdict came, as control_plane.py's loss runs do. Its resident memory and threads are reported
with the times.

    sudo PYTHONPATH=. python benchmarks/control_plane/watch_end.py [--rounds 5] [--into UNITS.json]

measures it alone (control_plane_units.py measures it with the other units): `--into` replaces the `watch_end`
entry of a units file (control_plane_units.py --json's), saying when it was measured. Each kill also times the
victim's exit as the kernel tells it (`teardown`: its pidfd turning readable, tests/helpers/control_plane.py's
ExitTimes): the verdict comes with it, so the naming is the teardown; control_plane_model.py compares the loss runs
with their own teardown too, which 16 hosts on 2 cores stretch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from phalanx.diagnose.stacks import stat_fields
from phalanx.testing import free_port


def victim(address: str) -> None:
    """A worker under `phalanx run` serving a beacon: says `VICTIM address:port rss_kb threads pid`, then serves
    until killed."""
    import torch

    import phalanx as px
    from tests.e2e.jobs.control_plane_job import build
    from tests.helpers.control_plane import held_by

    px.init()
    model, optimizer = build()
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 4)).square().mean().backward()
        optimizer.step()
    beacon = socket.create_server((address, 0), backlog=64)
    rss_kb, threads = held_by(os.getpid())
    print(f"VICTIM {address}:{beacon.getsockname()[1]} {rss_kb} {threads} {os.getpid()}", flush=True)
    connection, _ = beacon.accept()
    while connection.recv(64):
        pass


def _kill(*pids: int | None) -> None:
    for pid in pids:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def watcher() -> None:
    """Per beacon address on stdin: a KeptWatch on it, "ready" once connected, then the time.time() of its verdict."""
    from phalanx.world.liveness import KeptWatch

    for line in sys.stdin:
        ended = threading.Event()
        watch = KeptWatch(line.strip(), lambda why, ended=ended: (print(json.dumps({"at": time.time(), "why": why})),
                                                                   ended.set()))
        while watch._socket is None and not ended.is_set():
            time.sleep(0.01)
        print("ready", flush=True)
        ended.wait()


def watch_ends(hosts: list[dict], env: dict, rounds: int = 5) -> dict:
    """{"seconds": [from a SIGKILL of a worker in hosts[1] to its kept watch's verdict in hosts[2]], "exited": [to the
    worker's exit, as the kernel told it: its teardown], "rss_kb": [...], "threads": [...]}, `rounds` times."""
    from tests.e2e.test_elastic import job_env  # the loss runs' commands' environment (a warm launcher)
    from tests.helpers.control_plane import ExitTimes

    me = [sys.executable, str(Path(__file__).resolve())]
    launch_env = {**job_env(), "PYTHONPATH": env["PYTHONPATH"]}
    follower = subprocess.Popen(["ip", "netns", "exec", hosts[2]["ns"], *me, "--watcher"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    found: dict[str, list] = {"seconds": [], "exited": [], "rss_kb": [], "threads": []}
    try:
        for _ in range(rounds):
            port = free_port()  # for the world of one's store: none listens in host 1 yet
            launcher = subprocess.Popen(
                ["ip", "netns", "exec", hosts[1]["ns"], sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "1",
                 "--master-addr", hosts[1]["addr"], "--master-port", str(port), me[1], "--victim", hosts[1]["addr"]],
                env={**launch_env, "GLOO_SOCKET_IFNAME": hosts[1]["dev"]}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
            worker = parent = None
            try:
                for line in launcher.stdout:
                    said = re.search(r"VICTIM (\S+) (\d+) (\d+) (\d+)", line)
                    if said:
                        break
                else:
                    raise RuntimeError("the victim's launcher ended before its worker served a beacon")
                beacon, (rss_kb, threads, worker) = said.group(1), map(int, said.group(2, 3, 4))
                fields = stat_fields(worker)
                parent = int(fields[1]) if fields else None  # the process that forked it (its launcher's server)
                follower.stdin.write(beacon + "\n")  # a line: sent at once (bufsize=1)
                assert follower.stdout.readline().strip() == "ready"
                time.sleep(1.0)  # a few ticks
                exits = ExitTimes([worker])
                struck = time.time()
                _kill(parent, worker)  # as the loss runs do; the launcher itself once the worker is gone
                found["seconds"].append(json.loads(follower.stdout.readline())["at"] - struck)
                found["exited"].append(exits.last(struck))
                found["rss_kb"].append(rss_kb)
                found["threads"].append(threads)
            finally:
                _kill(parent, worker, launcher.pid)
                launcher.wait(timeout=30)
    finally:
        follower.kill()
    return found


def main() -> None:
    if sys.argv[1:2] == ["--victim"]:
        return victim(sys.argv[2])
    if sys.argv[1:2] == ["--watcher"]:
        return watcher()
    from tests.helpers.namespaces import bridged_hosts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="kills (default 5)")
    parser.add_argument("--into", type=Path, help="a units file whose watch_end entry this measurement replaces")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    with bridged_hosts("pwe", 223, 3) as hosts:
        ends = watch_ends(hosts, {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, args.rounds)
    exited = [seconds for seconds in ends["exited"] if seconds is not None]
    entry = {"seconds": statistics.median(ends["seconds"]), "all": ends["seconds"],
             "teardown": statistics.median(exited) if exited else None, "exited": ends["exited"],
             "rss_kb": ends["rss_kb"],
             "threads": ends["threads"], "measured": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg()[0]}
    print(json.dumps(entry))
    if args.into:
        units = json.loads(args.into.read_text())
        args.into.write_text(json.dumps({**units, "watch_end": entry}, indent=1) + "\n")


if __name__ == "__main__":
    main()
