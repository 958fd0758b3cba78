"""Across hosts on one machine: torch DDP, phalanx flat and phalanx hierarchical, interleaved in one run.

    sudo PYTHONPATH=. python benchmarks/hosts/xhost_bench.py --hosts 2 --nproc-per-node 2 --link 300mbit \\
        [--models wide,gpt] [--blocks 3] [--steps 3] [--calibration run-at-2-hosts.json] [--json out.json]

Builds N network namespaces on a bridge, each port shaped both ways (benchmarks/hosts/xhost_net.py), checks
every link's rate and round trip before use, then starts `phalanx run --nnodes N` in each namespace
(benchmarks/hosts/xhost_worker.py). Prints per model: the median step (slowest rank) of every variant, the
ratios to torch DDP, the bytes each host sent and received per step (interface counters; TCP payload
= bytes - 66 per packet, with offloads off) against 2(N-1)/N * S and 2(P-1)/P * S, and the cost model's
prediction against the measured step (phalanx/tools/cost_model.py), calibrated by this run's
microbenchmarks, or by `--calibration` (another run's JSON: calibrated at N=2, predict N=3).
Needs root (namespaces, tc); removes everything it made, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xhost_net import Hosts

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from phalanx.tools.cost_model import calibrate, predict_step  # noqa: E402

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 32 (with timestamps): what a packet carries besides payload


WORKER = ROOT / "benchmarks" / "hosts" / "xhost_worker.py"


def run_job(hosts: Hosts, nproc: int, worker_args: list[str], out: str, timeout: float, worker: Path = WORKER) -> None:
    """`phalanx run` of `worker` in every host's namespace, each told its interface (--dev) and the output file."""
    # No phalanx or world settings of the caller's, but a warm launcher it names (docs/launching.md "Warm
    # launches"): each host's launcher is then forked from it, inside the host's namespace, in milliseconds.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PHALANX_", "TORCHELASTIC_", "SLURM_")) or k == "PHALANX_WARM_LAUNCHER"}
    env["PYTHONPATH"] = str(ROOT)
    port = str(29600 + secrets.randbelow(300))
    run_launchers([["ip", "netns", "exec", hosts.names[i], sys.executable, "-m", "phalanx", "run",
                    "--nnodes", str(hosts.count), "--node-rank", str(i), "--nproc-per-node", str(nproc),
                    "--master-addr", hosts.addrs[0], "--master-port", port, "--rdzv-timeout", "300",
                    str(worker), "--dev", hosts.devs[i], "--out", out, *worker_args]
                   for i in range(hosts.count)], env, timeout)


def run_launchers(commands: list[list[str]], env: dict, timeout: float) -> None:
    """Start one `phalanx run` a host, wait `timeout` seconds in all for every one to end, and end the job with the
    output of the first host that failed."""
    procs = []
    try:
        for command in commands:
            procs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    finally:  # a launcher stopped by SIGTERM stops its workers too; SIGKILL only if it does not end
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    failed = [i for i, p in enumerate(procs) if p.returncode]
    if failed:
        raise SystemExit(f"host {failed[0]} failed:\n{outputs[failed[0]][-4000:]}")


def report(result: dict, links: list, cal_source: dict | None, rate: str) -> dict:
    n, local = result["hosts"], result["local"]
    world = n * local
    cal = calibrate((cal_source or result)["calibration"], (cal_source or result)["hosts"])
    print(f"\n{n} hosts x {local} ranks, links {rate}: measured " +
          ", ".join(f"{i}->{(i + 1) % n} {mbit:.0f} Mbit/s rtt {rtt:.3f} ms" for i, (mbit, rtt) in enumerate(links)))
    print(f"calibration ({(cal_source or result)['hosts']} hosts): link {cal.link_bytes_per_s * 8 / 1e6:.0f} Mbit/s, "
          f"ring step {cal.net_alpha * 1e3:.2f} ms, shm {cal.shm_bytes_per_s / 1e9:.2f} GB/s + "
          f"{cal.shm_alpha * 1e3:.2f} ms")
    summary = {}
    for name, record in result["models"].items():
        size = record["grad_bytes"]
        theory = {"hier": 2 * (n - 1) / n * size, "flat": 2 * (world - 1) / world * size}
        theory["torch"] = theory["flat"]
        medians = {v: statistics.median(t) for v, t in record["times"].items()}
        print(f"\n{name}: S = {size / 1e6:.2f} MB of gradients")
        print(f"  {'variant':8} {'step ms':>9} {'/torch':>7} {'MB/host/step tx':>16} {'rx':>7} {'theory':>7} "
              f"{'dev %':>6} {'predicted ms':>13} {'err %':>6}")
        rows = {}
        for variant, median in medians.items():
            blocks = record["traffic"][variant]
            steps = len(record["times"][variant])
            tx = [sum(h["tx_bytes"] - HEADER_BYTES * h["tx_packets"] for h in [hosts[i] for hosts in blocks]) / steps
                  for i in range(n)]
            rx = [sum(h["rx_bytes"] - HEADER_BYTES * h["rx_packets"] for h in [hosts[i] for hosts in blocks]) / steps
                  for i in range(n)]
            row = {"step_ms": median * 1e3, "ratio_torch": median / medians["torch"] if "torch" in medians else None,
                   "tx_mb": [t / 1e6 for t in tx], "rx_mb": [r / 1e6 for r in rx]}
            line = f"  {variant:8} {median * 1e3:9.1f} {row['ratio_torch'] or 0:7.3f} " \
                   f"{max(tx) / 1e6:16.2f} {max(rx) / 1e6:7.2f}"
            if variant in theory:
                row["theory_mb"] = theory[variant] / 1e6
                row["deviation"] = max(abs(t - theory[variant]) for t in tx + rx) / theory[variant]
                line += f" {theory[variant] / 1e6:7.2f} {row['deviation'] * 100:6.2f}"
            if variant in record.get("phases", {}):
                phases = record["phases"][variant]
                buckets = [(b["bytes"], b["ready"]) for b in phases["buckets"]]
                compute = phases["fwd"] + phases["backward"] + phases["opt"]
                predicted = predict_step(buckets, phases["backward"], compute, n, local, cal, variant)
                row["predicted_ms"] = predicted * 1e3
                row["prediction_error"] = predicted / median - 1
                line += f" {predicted * 1e3:13.1f} {row['prediction_error'] * 100:6.1f}"
            print(line)
            rows[variant] = row
        summary[name] = rows
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--link", default="300mbit", help="tc rate of every host's port, both ways")
    parser.add_argument("--models", default="wide,gpt")
    parser.add_argument("--variants", default="torch,flat,hier,compute")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--calibration", default=None, help="a JSON of another run: its microbenchmarks calibrate")
    parser.add_argument("--json", default=None, help="write the raw results and the summary here")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    with open("/proc/loadavg") as handle:
        load = handle.read().split()[:3]
    print(f"load before: {' '.join(load)}")
    with Hosts(args.hosts, args.link) as hosts:
        tag = hosts.tag
        links = [hosts.measure(i, (i + 1) % args.hosts) for i in range(args.hosts)]
        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(scratch, "result.json")
            run_job(hosts, args.nproc_per_node, ["--models", args.models, "--variants", args.variants,
                                                  "--blocks", str(args.blocks), "--steps", str(args.steps)],
                    out, args.timeout)
            with open(out) as handle:
                result = json.load(handle)
    cal_source = None
    if args.calibration:
        with open(args.calibration) as handle:
            cal_source = json.load(handle)["result"]
    summary = report(result, links, cal_source, args.link)
    with open("/proc/loadavg") as handle:
        print(f"\nload after: {' '.join(handle.read().split()[:3])}")
    if args.json:
        with open(args.json, "w") as handle:
            figures = {f"{name} {variant}/torch": round(row["ratio_torch"], 3) for name, rows in summary.items()
                       for variant, row in rows.items() if variant != "torch" and row.get("ratio_torch")}
            figures.update({f"{name} {variant} bytes off theory %": round(100 * row["deviation"], 2)
                            for name, rows in summary.items() for variant, row in rows.items()
                            if variant == "hier" and "deviation" in row})
            json.dump({"figures": figures, "args": vars(args), "tag": tag, "links": links, "load_before": load,
                       "result": result, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
