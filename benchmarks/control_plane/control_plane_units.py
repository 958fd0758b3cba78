"""The unit costs of live recovery's control plane, measured on namespace hosts: what
benchmarks/control_plane/control_plane_model.py extrapolates from.

    sudo PYTHONPATH=. python benchmarks/control_plane/control_plane_units.py [--hosts 2 4 8 16] [--rounds 20] [--json F]

A TCPStore (torch's, libuv) in host 0's network namespace, with a beacon beside it (a listening socket that accepts
and closes, as liveness.py's did); for each count N, N clients, one per namespace host 1..N, each a process of its own:
- `store_rtt`: one store operation's round trip from another host (an add of 0, back to back; median), and the TCP
  segments it costs, both ways, ACKs included: `segs_per_op` when ops are 100 ms apart (as the steps' are: the
  client's delayed ACK goes alone), `segs_per_op_b2b` back to back (it rides on the next request);
- `probe`: a connection to the beacon opened and closed (its time, segments both ways; `probe_refused`: to a port
  nobody listens on);
- `keepalive_segs_per_s`: segments per second on an idle kept-open connection with the kernel's keepalives at 1 s
  (liveness.py's KeptWatch: idle 1 s, interval 1 s);
- `store_cpu_per_op`: the store's own CPU time per operation (its process's CPU over a second in which every client
  sends adds back to back, over the operations served): its service time, which serializes the clients' operations;
- `commit[N]`: rounds of the per-step commit as generation.py made it, each right after a small Gloo all-reduce (each
  client adds 1 to a counter, then reads it, 4 reads back to back then pauses growing from 20 us, until it is full):
  its time (from the last client's arrival to the last one knowing) and the reads per client;
- `agree[N]`: rounds of the survivors' agreement as generation.py makes it (each says it is alive, then every 10 ms
  checks the decision and each member's alive key, until all are there; the first proposal stored wins), without
  its probes; `agree_counter[N]`: the same agreement through one counter (each adds 1, then reads it every 10 ms);
- `group[N]`, `group_lazy[N]`: a regroup's two Gloo groups as the survivors make them, full-mesh and lazy
  (regroup_units.py): `first`, from the decision to the last client's main group, `second`, from there to its control
  group (medians of 5); one group's connections opened and segments sent, all clients together, and the segments on
  their store connections (ss's per-socket counters), both ways;
- `watch_end`: seconds from a SIGKILL of a worker (phalanx DDP over Gloo, in host 1) to its kept watch's verdict
  (liveness.KeptWatch, in host 2), median of 5, with the worker's teardown, resident memory and threads: watch_end.py
  (which also measures a host of L workers killed beside the runs' load, `watch_end_by_layout`).
The clients share this machine's cores: with more clients than cores, their times include waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.control_plane import regroup_units
from benchmarks.control_plane.watch_end import entry as watch_end_entry
from benchmarks.control_plane.watch_end import watch_ends

ROOT = Path(__file__).resolve().parents[2]
PORT = 29650
EAGER_READS, LOOK_PAUSE = 4, 0.01  # generation.py's commit (4 reads back to back) and agreement (a look every 10 ms)


def tcp_counters() -> dict[str, int]:
    with open("/proc/self/net/snmp") as snmp:
        names, values = [line.split()[1:] for line in snmp if line.startswith("Tcp:")]
    return {name: int(value) for name, value in zip(names, values)}


def _both_ways(before: dict, after: dict) -> int:
    return after["OutSegs"] - before["OutSegs"] + after["InSegs"] - before["InSegs"]


# -- in host 0: the store and the beacon --------------------------------------------------------------------------

def serve(address: str, counts: list[int]) -> None:
    import torch.distributed as dist

    master = dist.TCPStore(address, PORT, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    beacon = socket.create_server((address, PORT + 1), backlog=512)
    threading.Thread(target=_answer, args=(beacon,), daemon=True).start()
    client = dist.TCPStore(address, PORT, is_master=False, timeout=timedelta(seconds=600))
    for count in counts:  # the store's CPU time at the marks the clients set around their second of adds
        for mark in ("begin", "end"):
            client.wait([f"mark/{count}/{mark}"])
            usage = resource.getrusage(resource.RUSAGE_SELF)
            client.set(f"cpu/{count}/{mark}", repr(usage.ru_utime + usage.ru_stime))
    while master:  # until the harness ends it
        time.sleep(60)


def _answer(beacon: socket.socket) -> None:
    while True:
        connection, _ = beacon.accept()
        connection.close()


# -- in host 1..N: one client -----------------------------------------------------------------------------------------

class Client:
    def __init__(self, address: str, index: int, count: int):
        import torch.distributed as dist

        self.dist, self.address, self.index, self.count = dist, address, index, count
        self.store = dist.TCPStore(address, PORT, is_master=False, timeout=timedelta(seconds=600))
        self.key = lambda *parts: "/".join(map(str, (count, *parts)))

    def barrier(self, name: str) -> None:
        key = self.key("barrier", name)
        self.store.add(key, 1)
        while self.store.add(key, 0) < self.count:
            time.sleep(0.001)

    def start_together(self, name: str) -> float:
        """After a barrier, client 0 sets the start (its monotonic time, which every process of the machine shares)."""
        self.barrier(name)
        key = self.key("go", name)
        if self.index == 0:
            self.store.set(key, repr(time.monotonic()))
        self.store.wait([key])
        return float(self.store.get(key))

    def rtt(self) -> dict:
        timings = []
        before = tcp_counters()
        for _ in range(1000):
            started = time.perf_counter()
            self.store.add("x", 0)
            timings.append(time.perf_counter() - started)
        b2b = _both_ways(before, tcp_counters()) / 1000
        before = tcp_counters()
        for _ in range(30):
            self.store.add("x", 0)
            time.sleep(0.1)
        spaced = _both_ways(before, tcp_counters()) / 30
        return {"store_rtt": statistics.median(timings), "segs_per_op": spaced, "segs_per_op_b2b": b2b}

    def probes(self) -> dict:
        found = {}
        for name, port in (("probe", PORT + 1), ("probe_refused", PORT + 2)):
            timings, before = [], tcp_counters()
            for _ in range(300):
                started = time.perf_counter()
                try:
                    socket.create_connection((self.address, port), timeout=1.0).close()
                except ConnectionRefusedError:
                    pass
                timings.append(time.perf_counter() - started)
                time.sleep(0.002)
            after = tcp_counters()
            found[name] = {"seconds": statistics.median(timings), "segs": _both_ways(before, after) / 300,
                           "opens": (after["ActiveOpens"] - before["ActiveOpens"]) / 300}
        kept = socket.create_connection((self.address, PORT), timeout=5.0)  # the store's port: it keeps connections
        kept.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option in ("TCP_KEEPIDLE", "TCP_KEEPINTVL"):
            kept.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), 1)
        time.sleep(1.5)
        before = tcp_counters()
        time.sleep(4.0)
        found["keepalive_segs_per_s"] = _both_ways(before, tcp_counters()) / 4.0
        kept.close()
        return found

    def throughput(self) -> int:
        self.barrier("throughput")
        if self.index == 0:
            self.store.set(f"mark/{self.count}/begin", "1")
        done, ends = 0, time.monotonic() + 1.0
        while time.monotonic() < ends:
            self.store.add("y", 0)
            done += 1
        self.store.add(self.key("ops"), done)
        self.barrier("throughput-end")
        if self.index == 0:
            self.store.set(f"mark/{self.count}/end", "1")
        return done

    def commit(self, rounds: int, group) -> list[tuple[float, float, int]]:
        """(arrived, done, reads) per round: generation.py's commit, right after a small all-reduce over Gloo (as a
        step's exchange ends), which sets how far apart the clients come to it."""
        import torch

        found, tensor = [], torch.zeros(1)
        for number in range(rounds):
            group.allreduce([tensor]).wait()
            arrived = time.monotonic()
            counter, reads = self.key("commit", number), 0
            count, pause = self.store.add(counter, 1), 0.0
            while count < self.count:
                count = self.store.add(counter, 0)
                reads += 1
                if reads > EAGER_READS:
                    time.sleep(pause)
                    now = time.monotonic()
                    pause = min(max(1.5 * pause, 2e-5), 2e-4 if now - arrived < 0.02 else 5e-3)
            found.append((arrived, time.monotonic(), reads))
            time.sleep(0.01)
        return found

    def agree(self, rounds: int, counter: bool) -> list[tuple[float, float, int]]:
        """(start, done, store ops) per round: the survivors' agreement, by each member's key or by one counter."""
        found = []
        for number in range(rounds):
            name = f"{'counter' if counter else 'keys'}{number}"
            start = self.start_together(name)
            decision, ops = self.key(name, "next"), 1
            if counter:
                self.store.add(self.key(name, "alive"), 1)
            else:
                self.store.set(self.key(name, "alive", self.index), "1")
            while True:
                ops += 1
                if self.store.check([decision]):
                    break
                if counter:
                    ops += 1
                    alive = self.store.add(self.key(name, "alive"), 0)
                else:
                    alive = 0
                    for member in range(self.count):
                        ops += 1
                        alive += self.store.check([self.key(name, "alive", member)])
                if alive >= self.count:
                    ops += 1
                    self.store.compare_set(decision, "", "all")
                    break
                time.sleep(LOOK_PAUSE)
            found.append((start, time.monotonic(), ops))
        return found

    def store_segments(self) -> int:
        """Segments both ways on this client's connection(s) to the store, so far (ss's per-socket counters)."""
        shown = subprocess.run(["ss", "-tinH", "dst", f"{self.address}:{PORT}"], capture_output=True, text=True).stdout
        return sum(int(value) for value in re.findall(r"\bsegs_(?:in|out):(\d+)", shown))


def client(address: str, index: int, count: int, rounds: int) -> None:
    me = Client(address, index, count)
    result = {"index": index}
    me.barrier("start")
    if index == 0:
        result.update(me.rtt())
        result.update(me.probes())
    me.barrier("units")
    result["ops"] = me.throughput()
    result["agree"] = me.agree(max(3, rounds // 2), counter=False)
    result["agree_counter"] = me.agree(max(3, rounds // 2), counter=True)
    result["group"], result["group_counts"], group = regroup_units.groups(me, 5, False, tcp_counters)
    result["group_lazy"], result["group_lazy_counts"], _ = regroup_units.groups(me, 5, True, tcp_counters)
    result["commit"] = me.commit(rounds, group)
    me.barrier("end")
    if index == 0:
        result["store_cpu"] = float(me.store.get(f"cpu/{count}/end")) - float(me.store.get(f"cpu/{count}/begin"))
        result["ops_total"] = me.store.add(me.key("ops"), 0)
    print(json.dumps(result), flush=True)


# -- here: the hosts, the store, the clients --------------------------------------------------------------------------

def measure(counts: list[int], rounds: int = 20) -> dict:
    """The unit costs, for each count of clients in `counts`."""
    from tests.helpers.namespaces import bridged_hosts

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    me = [sys.executable, str(Path(__file__).resolve())]
    units: dict = {"commit": {}, "agree": {}, "agree_counter": {}, "group": {}, "store_cpu_per_op": {}}
    with bridged_hosts("pcm", 222, max(counts) + 1) as hosts:
        server = subprocess.Popen(["ip", "netns", "exec", hosts[0]["ns"], *me, "--serve", hosts[0]["addr"],
                                   *map(str, counts)], env=env)
        try:
            for count in counts:
                clients = [subprocess.Popen(
                    ["ip", "netns", "exec", host["ns"], *me, "--client", hosts[0]["addr"], str(i), str(count),
                     str(rounds)], env={**env, "GLOO_SOCKET_IFNAME": host["dev"]}, stdout=subprocess.PIPE, text=True)
                    for i, host in enumerate(hosts[1:count + 1])]
                results = [json.loads(c.communicate(timeout=900)[0].strip().splitlines()[-1]) for c in clients]
                _gather(units, count, results)
            units["watch_end"] = watch_end_entry(watch_ends(hosts, env))
        finally:
            server.kill()
            server.wait(timeout=60)
    return units


def _gather(units: dict, count: int, results: list[dict]) -> None:
    first = next(r for r in results if r["index"] == 0)
    for name in ("store_rtt", "segs_per_op", "segs_per_op_b2b", "probe", "probe_refused", "keepalive_segs_per_s"):
        units.setdefault(name, first[name])  # from the first count (one client busy at a time)
    units["store_cpu_per_op"][count] = first["store_cpu"] / first["ops_total"]
    rounds = list(zip(*(r["commit"] for r in results)))
    units["commit"][count] = {"seconds": statistics.median(max(done for _, done, _ in r) - max(a for a, _, _ in r)
                                                           for r in rounds),
                              "reads": statistics.mean(reads for r in rounds for _, _, reads in r)}
    for name in ("agree", "agree_counter"):
        rounds = list(zip(*(r[name] for r in results)))
        units[name][count] = {"seconds": statistics.median(max(done for _, done, _ in r) - r[0][0] for r in rounds),
                              "ops": statistics.mean(ops for r in rounds for _, _, ops in r)}
    for name in ("group", "group_lazy"):
        regroup_units.gather(units, count, results, name)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        return serve(sys.argv[2], [int(count) for count in sys.argv[3:]])
    if sys.argv[1:2] == ["--client"]:
        return client(sys.argv[2], *map(int, sys.argv[3:6]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8, 16], help="client counts (default 2 4 8 16)")
    parser.add_argument("--rounds", type=int, default=20, help="commit rounds per count (default 20)")
    parser.add_argument("--json", type=Path, help="write the units to this file")
    args = parser.parse_args()
    units = measure(args.hosts, args.rounds)
    print(json.dumps(units, indent=1))
    if args.json:
        figures = {"store op rtt us": round(1e6 * units["store_rtt"], 1),
                   "store CPU per op us": round(1e6 * statistics.median(units["store_cpu_per_op"].values()), 1),
                   "segments per op": round(units["segs_per_op_b2b"], 2)}
        args.json.write_text(json.dumps({**units, "figures": figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
