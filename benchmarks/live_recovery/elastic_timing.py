"""Elastic membership's costs, measured: a node lost, a node back, and the goodput of such a run.

    sudo PYTHONPATH=. python benchmarks/live_recovery/elastic_timing.py [--rounds 3] [--step-seconds 0.1] [--epochs 20]

Builds two network namespaces joined by a veth pair (a random tag; torn down at the end, also on
failure), and runs tests/e2e/jobs/elastic_job.py (96 samples, batches of 4 per rank, a checkpoint
every 2 steps) under `phalanx run --nnodes 1:2 --nproc-per-node 1 --min-world-size 0` (the restart from the newest
checkpoint; live recovery is benchmarks/live_recovery/live_recovery_timing.py) on both. Per round: host B's
launcher and workers are SIGKILLed after 8 steps at world size 2; 3 s after host A's first step alone,
the same command starts on host B again. Measured from the job's own per-step timestamps:
- death -> first step at the smaller world (the node-loss detection, the regrouping, the restore);
- grow: the joining launcher's start -> the first step at the larger world (its interpreter and
  imports, the agreed save on A, the new round, both restores);
- the goodput host A's run summary reports for the whole run, beside an uninterrupted 2-host run's.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from phalanx.tools.bench_compare import add_json_flag, write_figures
from tests.helpers.namespaces import veth_hosts

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "e2e" / "jobs" / "elastic_job.py"


def start(host, master, port, run_dir, args, nnodes="1:2", node_rank=None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_"))}
    temp = Path(run_dir) / "tmp"  # a SIGKILLed launcher's temporary folders go with the run's
    temp.mkdir(parents=True, exist_ok=True)
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), TMPDIR=str(temp))
    rank = ("--node-rank", str(node_rank)) if node_rank is not None else ()
    command = ["ip", "netns", "exec", host["ns"], sys.executable, "-m", "phalanx", "run", "--nnodes", nnodes, *rank,
               "--nproc-per-node", "1", "--master-addr", master, "--master-port", str(port), "--rdzv-timeout", "60",
               "--min-world-size", "0",
               str(JOB), str(run_dir), "--step-seconds", str(args.step_seconds), "--epochs", str(args.epochs)]
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_tree(process: subprocess.Popen) -> None:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    todo, found = [process.pid], []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=30)


def rows(run_dir: Path) -> list[tuple[int, int, float]]:
    """(step, world size, wall time) per line the job logged."""
    path = run_dir / "samples.log"
    if not path.exists():
        return []
    return [(int(f[1]), int(f[2]), float(f[3])) for f in (line.split() for line in path.read_text().splitlines())
            if len(f) >= 4]


def wait_for(condition, processes, limit=300.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            raise RuntimeError("the run ended or stalled before the moment measured")
        time.sleep(0.02)


def goodput(output: str) -> float:
    found = re.findall(r"goodput ([\d.]+) %", output)
    return float(found[0]) if found else float("nan")


def uninterrupted(hosts, port, args) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        nodes = [start(host, hosts[0]["addr"], port, run_dir, args, nnodes="2", node_rank=i)
                 for i, host in enumerate(hosts)]
        outputs = [node.communicate(timeout=600)[0] for node in nodes]
    return goodput(outputs[0])


def one_round(hosts, port, args) -> dict:
    master = hosts[0]["addr"]
    with tempfile.TemporaryDirectory() as temp:
        run_dir = Path(temp)
        a, b = start(hosts[0], master, port, run_dir, args), start(hosts[1], master, port, run_dir, args)
        b_again = None
        try:
            wait_for(lambda: sum(w == 2 for _, w, _ in rows(run_dir)) >= 8, [a, b])
            kill_tree(b)
            died = time.time()
            wait_for(lambda: any(w == 1 for _, w, _ in rows(run_dir)), [a])
            alone = next(t for _, w, t in rows(run_dir) if w == 1)
            time.sleep(max(0.0, alone + 3.0 - time.time()))
            joined = time.time()
            b_again = start(hosts[1], master, port, run_dir, args)
            wait_for(lambda: any(w == 2 and t > joined for _, w, t in rows(run_dir)), [a, b_again])
            grown = next(t for _, w, t in rows(run_dir) if w == 2 and t > joined)
            out_a = a.communicate(timeout=600)[0]
            b_again.communicate(timeout=600)
        finally:
            for process in (a, b, b_again):
                if process is not None and process.poll() is None:
                    kill_tree(process)
    lost = re.search(r"lost \(no heartbeat", out_a) is not None
    # host A's own figures: from the change it saw (a node named lost; a node seen waiting) to the first step
    said = [float(x) for x in re.findall(r"([\d.]+) s from the change to the first step", out_a)]
    return {"death_to_step": alone - died, "grow": grown - joined, "goodput": goodput(out_a), "named": lost,
            "said": said,
            "summary": [line for line in out_a.splitlines() if line.startswith("phalanx run: ")
                        and "[rank" not in line][-6:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=20)
    add_json_flag(parser)
    args = parser.parse_args()
    port = 29700 + uuid.uuid4().int % 200
    print(f"load before: {os.getloadavg()}")
    try:
        with veth_hosts("pxb", 215) as hosts:
            results = []
            for i in range(args.rounds):
                reference = uninterrupted(hosts, port, args)
                result = one_round(hosts, port, args)
                result["reference"] = reference
                results.append(result)
                print(f"round {i}: death -> first step at world 1 {result['death_to_step']:.1f} s; start of the "
                      f"joining node -> first step at world 2 {result['grow']:.1f} s; goodput "
                      f"{result['goodput']:.1f} % (uninterrupted {reference:.1f} %); host A said {result['said']} s "
                      f"from the change it saw to the first step (lost, grown)", flush=True)
    finally:
        print(f"load after: {os.getloadavg()}")
    for key, label in (("death_to_step", "death -> first step at the smaller world"),
                       ("grow", "joining launcher's start -> first step at the larger world")):
        values = [r[key] for r in results]
        print(f"{label}: median {statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f})")
    print(f"goodput of the node-loss run (host A): median {statistics.median(r['goodput'] for r in results):.1f} %"
          f"; uninterrupted: median {statistics.median(r['reference'] for r in results):.1f} %")
    print("host A's last lines (last round):\n  " + "\n  ".join(results[-1]["summary"]))
    write_figures(args.json_path, {"death -> step s": round(statistics.median(r["death_to_step"] for r in results), 1),
                                   "grow s": round(statistics.median(r["grow"] for r in results), 1),
                                   "goodput %": round(statistics.median(r["goodput"] for r in results), 1),
                                   "uninterrupted goodput %": round(statistics.median(r["reference"] for r in results),
                                                                    1)}, rounds=results)

if __name__ == "__main__":
    main()
