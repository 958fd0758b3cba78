"""torchft on this machine, for issue 33's comparison: a replica killed, and what a healthy step pays.

    pip install --no-deps --target /tmp/tftlib torchft==0.2.0
    pip install --target /tmp/tftdeps "opentelemetry-exporter-otlp-proto-http>=1.39" "opentelemetry-sdk>=1.39"
    PYTHONPATH=/tmp/tftlib:/tmp/tftdeps:. python benchmarks/live_recovery/torchft_compare.py [--kills 3] [--hosts]

(torchft is not one of phalanx's dependencies; its wheel takes the installed torch.) Three replica groups of one CPU
process each, torchft's Gloo process group, its Lighthouse in this process (quorum tick 100 ms, heartbeat timeout
1 s: shorter than its defaults, so that its recovery is not held back by them), each process hosting its group's store
as torchrun would. Each trains tests/helpers/global_batch_cases.py's model on a fixed batch of its own, with 0.1 s of
sleep per step, through torchft's DistributedDataParallel and Optimizer (a quorum and a should-commit per step).
Prints the median time of a step's work (forward, backward, the exchange, the commit) with torchft and with the plain
loop, and for each kill of replica 2 (after 10 of its steps) the seconds from the kill to the first step both others
committed after it, and how many steps they did not commit. With `--hosts` (root needed) each replica runs on a host
of its own, three network namespaces on a bridge as phalanx's live-recovery tests and benchmarks build them, the
Lighthouse on host 0, each replica's store on its host's address; besides the kills, host 2's link is set down
(a silent host) and the same time is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

STEPS, PAUSE = 40, 0.1


def replica(replica_id: int, lighthouse: str, port: int, log_path: str, with_torchft: bool,
            store_host: str = "127.0.0.1") -> None:
    import torch
    import torch.nn.functional as F

    from tests.helpers.global_batch_cases import make_model

    torch.set_num_threads(1)
    model = make_model()
    generator = torch.Generator().manual_seed(replica_id)
    inputs, targets = torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator)
    manager = None
    if with_torchft:
        import torch.distributed as dist
        from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

        store = dist.TCPStore(store_host, port, 1, True, wait_for_workers=False)  # what torchrun would host
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                          load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                                         inner.load_state_dict(state["optimizer"])),
                          state_dict=lambda: {"model": model.state_dict(), "optimizer": inner.state_dict()},
                          replica_id=f"replica{replica_id}", lighthouse_addr=lighthouse, store_addr=store_host,
                          hostname=store_host,  # its manager's address for the others (not the machine's name)
                          store_port=port, rank=0, world_size=1, timeout=timedelta(seconds=10),
                          quorum_timeout=timedelta(seconds=10))
        wrapped, optimizer = DistributedDataParallel(manager, model), Optimizer(manager, inner)
    else:
        wrapped, optimizer = model, torch.optim.SGD(model.parameters(), lr=0.05)
    with open(log_path, "a") as log:
        for step in range(STEPS):
            time.sleep(PAUSE)
            started = time.time()
            optimizer.zero_grad()
            F.mse_loss(wrapped(inputs), targets).backward()
            committed = optimizer.step() if with_torchft else True
            log.write(json.dumps([step, time.time(), time.time() - started, committed is not False]) + "\n")
            log.flush()
    if manager is not None:
        manager.shutdown()
        del store


def run(mode: str, directory: Path) -> float | None:
    """Three replicas; `mode` plain, healthy or kill. Returns the kill's time (kill mode)."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=1000)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    ports = [_free_port() for _ in range(3)]
    processes = [subprocess.Popen([sys.executable, __file__, "--replica", str(i), address, str(ports[i]),
                                   str(directory / f"r{i}.jsonl"), "0" if mode == "plain" else "1"],
                                  stdout=(directory / f"r{i}.log").open("w"), stderr=subprocess.STDOUT)
                 for i in range(3)]
    killed = None
    try:
        if mode == "kill":
            doomed = directory / "r2.jsonl"
            while not doomed.exists() or doomed.read_text().count("\n") < 10:
                time.sleep(0.005)
            killed = time.time()
            processes[2].send_signal(signal.SIGKILL)
        for process in processes:
            process.wait(timeout=300)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        lighthouse.shutdown()
    return killed


LIGHTHOUSE_PORT, STORE_PORT = 29610, 29611  # inside the hosts' namespaces, which have ports of their own


def run_on_hosts(mode: str, directory: Path, hosts: list[dict]) -> float | None:
    """run() with replica i on host i (a namespace), the Lighthouse on host 0; `mode` also "cut" (host 2's link
    set down after its 10th step). Returns the kill's or the cut's time."""
    def in_host(i: int, *command: str) -> list[str]:
        return ["ip", "netns", "exec", hosts[i]["ns"], sys.executable, __file__, *command]

    lighthouse = subprocess.Popen(in_host(0, "--lighthouse", str(LIGHTHOUSE_PORT)),
                                  stdout=(directory / "lighthouse.log").open("w"), stderr=subprocess.STDOUT)
    address = f"http://{hosts[0]['addr']}:{LIGHTHOUSE_PORT}"
    time.sleep(1.0)  # the Lighthouse binds
    processes = [subprocess.Popen(in_host(i, "--replica", str(i), address, str(STORE_PORT),
                                          str(directory / f"r{i}.jsonl"), "0" if mode == "plain" else "1",
                                          hosts[i]["addr"]),
                                  env={**os.environ, "GLOO_SOCKET_IFNAME": hosts[i]["dev"]},  # not the machine's name
                                  stdout=(directory / f"r{i}.log").open("w"), stderr=subprocess.STDOUT)
                 for i in range(3)]
    hit = None
    try:
        if mode in ("kill", "cut"):
            doomed = directory / "r2.jsonl"
            while not doomed.exists() or doomed.read_text().count("\n") < 10:
                time.sleep(0.005)
            hit = time.time()
            if mode == "kill":
                processes[2].send_signal(signal.SIGKILL)
            else:
                subprocess.run(["ip", "-n", hosts[2]["ns"], "link", "set", "dev", hosts[2]["dev"], "down"], check=True)
        for process in processes[:2]:
            process.wait(timeout=300)
    finally:
        for process in processes + [lighthouse]:
            if process.poll() is None:
                process.kill()
                process.wait()
    return hit


def lighthouse_main(port: int) -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100,
                              heartbeat_timeout_ms=1000)
    try:
        while True:
            time.sleep(1)
    finally:
        server.shutdown()


def _free_port() -> int:
    from phalanx.testing import free_port

    return free_port()


def _rows(directory: Path, replica_id: int) -> list:
    return [json.loads(line) for line in (directory / f"r{replica_id}.jsonl").read_text().splitlines()]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--replica":
        replica(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6] == "1", *sys.argv[7:8])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--lighthouse":
        lighthouse_main(int(sys.argv[2]))
        return
    from phalanx.tools.bench_compare import add_json_flag, write_figures  # not in the replicas: torchft's own

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--hosts", action="store_true", help="a replica per host: network namespaces (root)")
    add_json_flag(parser)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.hosts:
        on_hosts(args.kills)
        return
    figures = {}
    for mode in ("plain", "healthy"):
        with tempfile.TemporaryDirectory() as directory:
            run(mode, Path(directory))
            work = [row[2] for r in (0, 1) for row in _rows(Path(directory), r)[5:]]
        what = "forward, backward, exchange, quorum, commit" if mode == "healthy" else "forward, backward: compute only"
        print(f"{mode:<8} a step's work ({what}): median {1000 * statistics.median(work):.2f} ms", flush=True)
        figures[f"{mode} step ms"] = round(1000 * statistics.median(work), 2)
    for kill in range(args.kills):
        with tempfile.TemporaryDirectory() as directory:
            killed = run("kill", Path(directory))
            rows = [_rows(Path(directory), r) for r in (0, 1)]
        firsts = [min((row[1] for row in r if row[1] > killed and row[3]), default=None) for r in rows]
        dropped = sum(1 for r in rows for row in r if row[1] > killed and not row[3])
        took = None if None in firsts else max(firsts) - killed
        print(f"kill {kill + 1}: the next step both others committed came {took:.2f} s after the kill; "
              f"{dropped} step(s) not committed", flush=True)
        figures[f"kill {kill + 1} -> next step s"] = round(took, 2) if took is not None else "never"
    write_figures(args.json_path, figures)


def on_hosts(kills: int) -> None:
    from tests.helpers.namespaces import bridged_hosts

    with bridged_hosts("pht", 219, 3) as hosts:
        for mode in ("plain", "healthy"):
            with tempfile.TemporaryDirectory() as directory:
                run_on_hosts(mode, Path(directory), hosts)
                work = [row[2] for r in (0, 1) for row in _rows(Path(directory), r)[5:]]
            print(f"hosts {mode:<8} a step's work: median {1000 * statistics.median(work):.2f} ms", flush=True)
        for mode in ["kill"] * kills + ["cut"]:
            with tempfile.TemporaryDirectory() as directory:
                hit = run_on_hosts(mode, Path(directory), hosts)
                rows = [_rows(Path(directory), r) for r in (0, 1)]
            if mode == "cut":  # the link back up for the next round (none here: the last)
                subprocess.run(["ip", "-n", hosts[2]["ns"], "link", "set", "dev", hosts[2]["dev"], "up"], check=False)
            firsts = [min((row[1] for row in r if row[1] > hit and row[3]), default=None) for r in rows]
            dropped = sum(1 for r in rows for row in r if row[1] > hit and not row[3])
            took = "never" if None in firsts else f"{max(firsts) - hit:.2f} s"
            print(f"hosts {mode}: the next step both others committed came {took} after it; {dropped} step(s) not "
                  f"committed", flush=True)


if __name__ == "__main__":
    main()
