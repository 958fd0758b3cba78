"""DiLoCo's bytes and speed across namespace hosts: against exact phalanx DDP and torch DDP on a shaped link, and
against itself on an unshaped one.

    sudo PYTHONPATH=. python benchmarks/hosts/diloco_bench.py --hosts 2 --nproc-per-node 2 --link 300mbit \\
        [--every 50] [--compress int8] [--fragments 5] [--delay 2] [--batch-size 1] [--json out.json]

Builds N network namespaces on a bridge, each port shaped both ways to --link (benchmarks/hosts/xhost_net.py),
and runs examples/gpt's model in them (`phalanx run --nnodes N` per host, benchmarks/hosts/diloco_worker.py):
torch DDP, exact phalanx DDP (the two-level exchange), DiLoCo and compute-only. Then the same hosts without
shaping, DiLoCo alone. Prints per variant the samples/s and the bytes that crossed host 0's port per step (tx +
rx, the kernel's counters over the timed steps, headers included), and the bars: DiLoCo's bytes at most 1/100
of exact DDP's, its samples/s at least 5x torch DDP's on the shaped link and at least 0.9x its own unshaped.
Needs root (namespaces, tc); removes everything it made, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from xhost_bench import run_job
from xhost_net import Hosts

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from phalanx.tools.bench_compare import write_figures  # noqa: E402

WORKER = ROOT / "benchmarks" / "hosts" / "diloco_worker.py"
MODEL_FLAGS = ("every", "compress", "fragments", "delay", "steps", "n_layer", "d_model", "block_size", "batch_size")


def job(count: int, rate: str | None, nproc: int, variants: str, args) -> tuple[dict, list]:
    """The worker's results on `count` fresh hosts with ports shaped to `rate` (None: unshaped), and the links'
    (Mbit/s, round trip ms) from host 0 to host 1."""
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in MODEL_FLAGS]
    with Hosts(count, rate) as hosts:
        links = [hosts.measure(0, 1)]
        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(scratch, "result.json")
            run_job(hosts, nproc, ["--variants", variants, *flags], out, args.timeout, worker=WORKER)
            return json.loads(Path(out).read_text()), links


def per_step(record: dict, host: int = 0) -> dict:
    traffic = record["hosts"][host]
    return {"tx": traffic["tx_bytes"] / record["steps"], "rx": traffic["rx_bytes"] / record["steps"],
            "both": (traffic["tx_bytes"] + traffic["rx_bytes"]) / record["steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--link", default="300mbit", help="tc rate of every host's port, both ways")
    parser.add_argument("--every", type=int, default=50, help="DiLoCo's H")
    parser.add_argument("--compress", default="int8", help="int8, fp16 or none")
    parser.add_argument("--fragments", type=int, default=5, help="DiLoCo's F (streaming)")
    parser.add_argument("--delay", type=int, default=2, help="DiLoCo's D, below H/F")
    parser.add_argument("--steps", type=int, default=4, help="timed steps of torch DDP, exact DDP, compute-only")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step per rank")
    parser.add_argument("--json", default=None, help="write the figures and the raw results here")
    parser.add_argument("--timeout", type=float, default=900, help="per job")
    args = parser.parse_args()
    with open("/proc/loadavg") as handle:
        load = handle.read().split()[:3]
    print(f"load before: {' '.join(load)}", flush=True)
    shaped, links = job(args.hosts, args.link, args.nproc_per_node, "torch,exact,diloco,compute", args)
    print(f"shaped {args.link}: measured {links[0][0]:.0f} Mbit/s, rtt {links[0][1]:.2f} ms", flush=True)
    unshaped, open_links = job(args.hosts, None, args.nproc_per_node, "diloco", args)
    print(f"unshaped: measured {open_links[0][0]:.0f} Mbit/s, rtt {open_links[0][1]:.2f} ms", flush=True)

    rows = {**shaped["variants"], "diloco unshaped": unshaped["variants"]["diloco"]}
    batch = shaped["samples_per_step"]
    print(f"\n{args.hosts} hosts x {args.nproc_per_node} ranks, {args.link}; examples/gpt "
          f"{shaped['params'] / 1e6:.2f}M "
          f"parameters ({4 * shaped['params'] / 1e6:.1f} MB fp32), {batch} sequences of {args.block_size} per step; "
          f"DiLoCo H={args.every} compress={args.compress} fragments={args.fragments} delay={args.delay}")
    print(f"  {'variant':16} {'steps':>5} {'step ms':>8} {'samples/s':>9} {'host 0 MB/step tx':>17} {'rx':>7} "
          f"{'tx+rx':>7}")
    speed, traffic = {}, {}
    for name, record in rows.items():
        speed[name] = record["steps"] * batch / record["wall_s"]
        traffic[name] = per_step(record)
        t = traffic[name]
        print(f"  {name:16} {record['steps']:5d} {record['wall_s'] / record['steps'] * 1e3:8.1f} {speed[name]:9.2f} "
              f"{t['tx'] / 1e6:17.4f} {t['rx'] / 1e6:7.4f} {t['both'] / 1e6:7.4f}")
    figures = {"diloco/exact bytes per step": traffic["diloco"]["both"] / traffic["exact"]["both"],
               "diloco/torch samples/s": speed["diloco"] / speed["torch"],
               "diloco shaped/unshaped samples/s": speed["diloco"] / speed["diloco unshaped"],
               "diloco/compute samples/s": speed["diloco"] / speed["compute"],
               "exact/torch samples/s": speed["exact"] / speed["torch"]}
    bars = {"diloco/exact bytes per step": ("<=", 0.01), "diloco/torch samples/s": (">=", 5.0),
            "diloco shaped/unshaped samples/s": (">=", 0.9)}
    print()
    for name, value in figures.items():
        bar = bars.get(name)
        verdict = ""
        if bar:
            met = value <= bar[1] if bar[0] == "<=" else value >= bar[1]
            verdict = f"  (bar {bar[0]} {bar[1]}: {'met' if met else 'MISSED'})"
        print(f"  {name:34} {value:.4f}{verdict}")
    with open("/proc/loadavg") as handle:
        print(f"\nload after: {' '.join(handle.read().split()[:3])}")
    write_figures(args.json, {k: round(v, 4) for k, v in figures.items()}, args=vars(args), links=links,
                  unshaped_links=open_links, load_before=load, speed=speed, traffic=traffic, shaped=shaped,
                  unshaped=unshaped)


if __name__ == "__main__":
    main()
