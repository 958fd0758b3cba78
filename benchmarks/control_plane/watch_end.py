"""The unit `t_end` of the control plane's scale model: seconds from a SIGKILL of a worker to its kept watch's verdict
on another namespace host (control_plane_units.py runs it; control_plane_model.py's "a process gone: named").

The kernel closes a killed process's sockets only once its address space is torn down (do_exit: exit_mm, then
exit_files), so the verdict waits for that teardown, whose length follows what the process holds: ~2 ms for a bare
Python, 46-72 ms with torch imported, 110-123 ms with 300 MB of tensors more (loopback, load 9). The victim is
therefore a worker as tests/e2e/jobs/control_plane_job.py's are, not a bare beacon: phalanx initialized over a Gloo
group (a world of one, its own store), the job's model wrapped in phalanx DDP and trained a few steps, its beacon
(liveness.py's: accept, keep, read the watcher's bytes) served beside. Its resident memory and threads are reported
with the times, to compare with the run's workers.

    sudo PYTHONPATH=. python benchmarks/control_plane/watch_end.py [--rounds 5] [--into UNITS.json]

measures it alone (control_plane_units.py measures it with the other units): `--into` replaces the `watch_end`
entry of a units file (control_plane_units.py --json's), saying when it was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def victim(address: str, device: str) -> None:
    """A worker's address space serving a beacon: says `address:port rss_kb threads`, then serves until killed."""
    with socket.socket() as probe:  # a free port for the world of one's store, in this namespace
        probe.bind((address, 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=address,
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=device)
    import torch

    import phalanx as px

    px.init()
    model = px.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                           torch.nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 4)).square().mean().backward()
        optimizer.step()
    beacon = socket.create_server((address, 0), backlog=64)
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    print(f"{address}:{beacon.getsockname()[1]} {fields['VmRSS'].split()[0]} {fields['Threads'].strip()}", flush=True)
    connection, _ = beacon.accept()
    while connection.recv(64):
        pass


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
    """{"seconds": [from a SIGKILL of a worker in hosts[1] to its kept watch's verdict in hosts[2]], "rss_kb": [...],
    "threads": [...]}, `rounds` times."""
    me = [sys.executable, str(Path(__file__).resolve())]
    follower = subprocess.Popen(["ip", "netns", "exec", hosts[2]["ns"], *me, "--watcher"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    found: dict[str, list] = {"seconds": [], "rss_kb": [], "threads": []}
    try:
        for _ in range(rounds):
            watched = subprocess.Popen(["ip", "netns", "exec", hosts[1]["ns"], *me, "--victim", hosts[1]["addr"],
                                        hosts[1]["dev"]], env=env, stdout=subprocess.PIPE, text=True)
            try:
                beacon, rss_kb, threads = watched.stdout.readline().split()
                follower.stdin.write(beacon + "\n")  # a line: sent at once (bufsize=1)
                assert follower.stdout.readline().strip() == "ready"
                time.sleep(1.0)  # a few ticks
                struck = time.time()
            finally:
                watched.kill()
                watched.wait(timeout=30)
            found["seconds"].append(json.loads(follower.stdout.readline())["at"] - struck)
            found["rss_kb"].append(int(rss_kb))
            found["threads"].append(int(threads))
    finally:
        follower.kill()
    return found


def main() -> None:
    if sys.argv[1:2] == ["--victim"]:
        return victim(sys.argv[2], sys.argv[3])
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
    entry = {"seconds": statistics.median(ends["seconds"]), "all": ends["seconds"], "rss_kb": ends["rss_kb"],
             "threads": ends["threads"], "measured": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg()[0]}
    print(json.dumps(entry))
    if args.into:
        units = json.loads(args.into.read_text())
        args.into.write_text(json.dumps({**units, "watch_end": entry}, indent=1) + "\n")


if __name__ == "__main__":
    main()
