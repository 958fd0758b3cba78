"""DiLoCo's bytes and speed across namespace hosts: against exact phalanx DDP and torch DDP on a shaped link, and
against itself on an unshaped one.

    sudo PYTHONPATH=. python benchmarks/hosts/diloco_bench.py --hosts 2 --nproc-per-node 2 --link 300mbit \\
        [--every 50] [--compress int8] [--fragments 5] [--delay 2] [--batch-size 1] [--rounds 3] [--json out.json]

Builds N network namespaces on a bridge, each port shaped both ways to --link (benchmarks/hosts/xhost_net.py), and
runs examples/gpt's model in them (`phalanx run --nnodes N` per host, benchmarks/hosts/diloco_worker.py): torch
DDP, exact phalanx DDP (the two-level exchange), DiLoCo and compute-only. Then the same hosts without shaping,
DiLoCo alone; --rounds repeats the pair, the order alternating. Prints per variant the samples/s and the bytes that
crossed host 0's port per step (tx + rx, the kernel's counters over the timed steps, headers included), and the
bars: DiLoCo's bytes at most 1/100 of exact DDP's, its samples/s at least 5x torch DDP's on the shaped link and at
least 0.9x its own unshaped. Needs root (namespaces, tc); removes everything it made, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    parser.add_argument("--rounds", type=int, default=1,
                        help="shaped and unshaped jobs this many times, the order alternating; figures are medians of "
                             "the rounds' ratios")
    parser.add_argument("--json", default=None, help="write the figures and the raw results here")
    parser.add_argument("--timeout", type=float, default=900, help="per job")
    args = parser.parse_args()
    with open("/proc/loadavg") as handle:
        load = handle.read().split()[:3]
    print(f"load before: {' '.join(load)}", flush=True)
    rounds, links = [], {}
    for r in range(args.rounds):  # shaped and unshaped jobs back to back, the order alternating: pairs alike
        got = {}
        for shaped in ((True, False) if r % 2 == 0 else (False, True)):
            variants = "torch,exact,diloco,compute" if shaped else "diloco"
            got[shaped], links[shaped] = job(args.hosts, args.link if shaped else None, args.nproc_per_node, variants,
                                             args)
            print(f"round {r + 1}, {args.link if shaped else 'unshaped'} (measured {links[shaped][0][0]:.0f} Mbit/s): "
                  f"DiLoCo {got[shaped]['variants']['diloco']['wall_s'] / args.every * 1e3:.1f} ms a step", flush=True)
        rounds.append(summarize(got[True], got[False]))
    report(rounds, args)
    with open("/proc/loadavg") as handle:
        print(f"\nload after: {' '.join(handle.read().split()[:3])}")
    figures = {name: round(statistics.median(r["figures"][name] for r in rounds), 4) for name in rounds[0]["figures"]}
    write_figures(args.json, figures, args=vars(args), links={str(k): v for k, v in links.items()}, load_before=load,
                  rounds=rounds)


def summarize(shaped: dict, unshaped: dict) -> dict:
    """One round's samples/s and host 0's bytes per step of every variant, and its figures (ratios of this round)."""
    rows = {**shaped["variants"], "diloco unshaped": unshaped["variants"]["diloco"]}
    batch = shaped["samples_per_step"]
    speed = {name: record["steps"] * batch / record["wall_s"] for name, record in rows.items()}
    traffic = {name: per_step(record) for name, record in rows.items()}
    figures = {"diloco/exact bytes per step": traffic["diloco"]["both"] / traffic["exact"]["both"],
               "diloco/torch samples/s": speed["diloco"] / speed["torch"],
               "diloco shaped/unshaped samples/s": speed["diloco"] / speed["diloco unshaped"],
               "diloco/compute samples/s": speed["diloco"] / speed["compute"],
               "exact/torch samples/s": speed["exact"] / speed["torch"]}
    return {"speed": speed, "traffic": traffic, "figures": figures, "params": shaped["params"], "batch": batch,
            "steps": {name: record["steps"] for name, record in rows.items()}, "shaped": shaped, "unshaped": unshaped}


def report(rounds: list, args) -> None:
    """Medians over rounds: each variant's samples/s and bytes, then each figure (a median of per-round ratios)."""
    first = rounds[0]
    print(f"\n{args.hosts} hosts x {args.nproc_per_node} ranks, {args.link}; examples/gpt {first['params'] / 1e6:.2f}M "
          f"parameters ({4 * first['params'] / 1e6:.1f} MB fp32), {first['batch']} sequences of {args.block_size} "
          f"per step; DiLoCo H={args.every} compress={args.compress} fragments={args.fragments} delay={args.delay}; "
          f"medians over {len(rounds)} round(s)")
    print(f"  {'variant':16} {'steps':>5} {'step ms':>8} {'samples/s':>9} {'host 0 MB/step tx':>17} {'rx':>7} "
          f"{'tx+rx':>7}")
    for name in first["speed"]:
        speed = statistics.median(r["speed"][name] for r in rounds)
        t = {k: statistics.median(r["traffic"][name][k] for r in rounds) for k in ("tx", "rx", "both")}
        print(f"  {name:16} {first['steps'][name]:5d} {first['batch'] / speed * 1e3:8.1f} {speed:9.2f} "
              f"{t['tx'] / 1e6:17.4f} {t['rx'] / 1e6:7.4f} {t['both'] / 1e6:7.4f}")
    bars = {"diloco/exact bytes per step": ("<=", 0.01), "diloco/torch samples/s": (">=", 5.0),
            "diloco shaped/unshaped samples/s": (">=", 0.9)}
    print()
    for name in first["figures"]:
        values = [r["figures"][name] for r in rounds]
        value = statistics.median(values)
        verdict = ""
        if name in bars:
            sign, bar = bars[name]
            verdict = f"  (bar {sign} {bar}: {'met' if (value <= bar if sign == '<=' else value >= bar) else 'MISSED'})"
        print(f"  {name:34} {value:.4f}  rounds {', '.join(f'{v:.3f}' for v in values)}{verdict}")

if __name__ == "__main__":
    main()
