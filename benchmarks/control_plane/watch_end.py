"""The unit `t_end` of the control plane's scale model: seconds from a SIGKILL of a host's workers to the first of
their kept watches' verdicts on another namespace host (control_plane_units.py runs it; control_plane_model.py's "a
process gone: named").

The kernel closes a killed process's sockets only once its address space is torn down (do_exit: exit_mm, then
exit_files), so the verdict waits for that teardown, whose length follows what the process holds and who else holds
it: ~2 ms for a bare Python, 46-72 ms with torch imported, 110-123 ms with 300 MB of tensors more (loopback, load
9). A worker forked from its launcher's server shares most of its pages with its ancestors: while one of them lives
its teardown unmaps them (22-44 ms here), where with every sharer killed at once it may have to free them (28-87 ms,
10 kills, when the launcher was killed first). So a victim is a worker as the runs' are: started by `phalanx run
--nproc-per-node L` (from a warm launcher, as their commands are), phalanx initialized (a world of L), trained in
tests/e2e/jobs/control_plane_job.py's model in phalanx DDP, its beacon (liveness.py's: accept, keep, read the
watcher's bytes) served beside; it trains on until killed, its local rank 0 pausing 0.15 s a step as the runs' slow
rank does, so that it dies mid-step as theirs do. The L workers and the process that forked them are SIGKILLed
together, by pid (kill_at_once), and their launcher once the verdicts came, as control_plane.py's loss runs do.
Their resident memory and threads are reported with the times.

    sudo PYTHONPATH=. python benchmarks/control_plane/watch_end.py [--rounds 5] [--per-host L] [--beside H]
        [--into UNITS.json]

measures it alone (control_plane_units.py measures one victim alone with the other units): `--into` replaces the
`watch_end` entry of a units file (control_plane_units.py --json's), saying when it was measured. Each kill also
times each victim's exit as the kernel tells it (`teardown`: the first one's, its pidfd turning readable,
tests/helpers/control_plane.py's ExitTimes): the verdict comes with it, so the naming is the teardown.

On 2 cores, the teardown of a host's victims depends on what else runs: one victim alone names the loss in 15-17 ms,
4 killed together beside 12 training ranks in 23-27 ms (medians of 10 kills, five sets on 2026-11-30), where the 4 x 4
loss runs named theirs in 20-25 ms. `--beside H` reproduces that load: H more hosts of L ranks train
control_plane_job.py meanwhile (live recovery on, rank 0 pausing), as the loss runs' survivors do, in a world of their
own; with `--per-host` or `--beside`, `--into` replaces the units file's `watch_end_by_layout` entry for L, which
control_plane_model.py takes when it compares the model with the runs at the nearest layout (the extrapolation, on
hosts of a core a rank, takes the victim alone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
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
    threading.Thread(target=_serve, args=(beacon,), daemon=True).start()
    print(f"VICTIM {address}:{beacon.getsockname()[1]} {rss_kb} {threads} {os.getpid()}", flush=True)
    ahead = int(os.environ.get("LOCAL_RANK", "0")) == 0  # the first rank, ahead by the runs' pause
    while True:  # in steps, as the loss runs' victims are when killed
        if ahead:
            time.sleep(0.15)
        optimizer.zero_grad()
        model(torch.randn(4, 4)).square().mean().backward()
        optimizer.step()


def _serve(beacon: socket.socket) -> None:
    connection, _ = beacon.accept()
    while connection.recv(64):
        pass


def watcher() -> None:
    """Per line of beacon addresses on stdin: a KeptWatch on each, "ready" once all are connected, then the
    time.time() of each one's verdict, in a JSON list, once all have ended."""
    for line in sys.stdin:
        _watch_all(line.split())


def _watch_all(addresses: list[str]) -> None:
    from phalanx.world.liveness import KeptWatch

    verdicts: list[float] = []
    lock = threading.Lock()
    ended = threading.Event()

    def gone(why: str) -> None:
        with lock:
            verdicts.append(time.time())
            if len(verdicts) == len(addresses):
                ended.set()

    watches = [KeptWatch(address, gone) for address in addresses]
    while any(watch._socket is None for watch in watches) and not verdicts:
        time.sleep(0.01)
    print("ready", flush=True)
    ended.wait()
    print(json.dumps(sorted(verdicts)), flush=True)


def watch_ends(hosts: list[dict], env: dict, rounds: int = 5, per_host: int = 1, beside: int = 0) -> dict:
    """{"seconds": [from a SIGKILL of a host's `per_host` workers (in hosts[1]) to the first of their kept watches'
    verdicts (in hosts[2])], "exited_each": [[to each worker's exit, as the kernel told it: its teardown], ...],
    "rss_kb": [...], "threads": [...]} (a value per worker), `rounds` times; `beside` > 0: meanwhile a job of `beside`
    more hosts of `per_host` ranks each trains in hosts[3:] as the loss runs' survivors do (the load they meet)."""
    from tests.e2e.test_elastic import job_env  # the loss runs' commands' environment (a warm launcher)
    from tests.helpers.control_plane import WARMUP, ExitTimes, Job, kill_at_once

    me = [sys.executable, str(Path(__file__).resolve())]
    launch_env = {**job_env(), "PYTHONPATH": env["PYTHONPATH"]}
    follower = subprocess.Popen(["ip", "netns", "exec", hosts[2]["ns"], *me, "--watcher"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    found: dict[str, list] = {"seconds": [], "exited_each": [], "rss_kb": [], "threads": []}
    with contextlib.ExitStack() as stack:
        stack.callback(follower.kill)
        job = None
        if beside:
            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="phalanx-watch-end-")))
            job = Job(hosts[3:3 + beside], run_dir / "beside", per_host, True, BESIDE_STEPS, (1, 2), 0.15)
            stack.callback(job.stop)
            job.await_steps(0, WARMUP, who="the job beside")
        for _ in range(rounds):
            port = free_port()  # for the victims' world's store: none listens in host 1 yet
            launcher = subprocess.Popen(
                ["ip", "netns", "exec", hosts[1]["ns"], sys.executable, "-m", "phalanx", "run", "--nproc-per-node",
                 str(per_host), "--master-addr", hosts[1]["addr"], "--master-port", str(port), me[1], "--victim",
                 hosts[1]["addr"]],
                env={**launch_env, "GLOO_SOCKET_IFNAME": hosts[1]["dev"]}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
            workers: list[int] = []
            parents: set[int] = set()
            try:
                said = []
                for line in launcher.stdout:
                    said += re.findall(r"VICTIM (\S+) (\d+) (\d+) (\d+)", line)
                    if len(said) == per_host:
                        break
                else:
                    raise RuntimeError(f"the victims' launcher ended before its {per_host} worker(s) served a beacon")
                workers = [int(pid) for *_, pid in said]
                parents = {int(fields[1]) for fields in map(stat_fields, workers) if fields}  # its launcher's server
                follower.stdin.write(" ".join(beacon for beacon, *_ in said) + "\n")  # a line: sent at once
                assert follower.stdout.readline().strip() == "ready"
                time.sleep(1.0)  # a few ticks
                if job is not None and job.ended():
                    raise RuntimeError(f"the job beside ended:\n{job.outputs()}")
                exits = ExitTimes(workers)
                struck = time.time()
                kill_at_once([*parents, *workers])  # as the loss runs do; the launcher itself once they are gone
                found["seconds"].append(min(json.loads(follower.stdout.readline())) - struck)
                exits.last(struck)
                found["exited_each"].append(sorted(at - struck for at in exits.times.values()))
                found["rss_kb"].append([int(rss) for _, rss, _, _ in said])
                found["threads"].append([int(threads) for _, _, threads, _ in said])
            finally:
                kill_at_once([*parents, *workers, launcher.pid])
                launcher.wait(timeout=30)
    return found


BESIDE_STEPS = 100_000  # the job beside trains until the kills are done (it is then stopped)


def entry(ends: dict, per_host: int = 1, beside: int = 0) -> dict:
    """A units file's entry for watch_ends()'s result: medians (the first of a host's victims: it names the loss),
    every round, when and beside what it was measured."""
    firsts = [each[0] for each in ends["exited_each"] if len(each) == per_host]
    return {"seconds": statistics.median(ends["seconds"]), "all": ends["seconds"],
            "teardown": statistics.median(firsts) if firsts else None, "exited_each": ends["exited_each"],
            "rss_kb": ends["rss_kb"], "threads": ends["threads"], "per_host": per_host, "beside": beside * per_host,
            "measured": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg()[0]}


def main() -> None:
    if sys.argv[1:2] == ["--victim"]:
        return victim(sys.argv[2])
    if sys.argv[1:2] == ["--watcher"]:
        return watcher()
    from tests.helpers.namespaces import bridged_hosts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="kills (default 5)")
    parser.add_argument("--per-host", type=int, default=1, help="workers on the victim host, killed together "
                        "(default 1)")
    parser.add_argument("--beside", type=int, default=0, help="hosts of --per-host ranks training beside, as the loss "
                        "runs' survivors (default 0: the victims alone)")
    parser.add_argument("--into", type=Path, help="a units file whose watch_end entry (with --per-host or --beside: "
                        "watch_end_by_layout's entry for --per-host) this measurement replaces")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    with bridged_hosts("pwe", 223, 3 + args.beside) as hosts:
        ends = watch_ends(hosts, {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, args.rounds,
                          args.per_host, args.beside)
    found = entry(ends, args.per_host, args.beside)
    print(json.dumps(found))
    if args.into:
        units = json.loads(args.into.read_text())
        if args.per_host == 1 and not args.beside:
            units["watch_end"] = found
        else:
            units.setdefault("watch_end_by_layout", {})[str(args.per_host)] = found
        args.into.write_text(json.dumps(units, indent=1) + "\n")


if __name__ == "__main__":
    main()
