"""The commit round of the speakers' tree (world/generations/commit_tree.py), measured: the scale model's `hop`.

    PYTHONPATH=. python benchmarks/control_plane/tree_units.py [--speakers 2 4 8 16] [--steps 1000]
        [--into benchmarks/results/UNITS.json] [--json FILE]

H processes on this machine, one speaker each (a host's), commit steps back to back through phalanx's own CommitTree
and SocketLinks, each speaker voting as soon as it knows the step before: the root's time per step is a round, from
a vote to the next. The depth d of the tree (fan-out 8) is 1 up to 9 speakers, 2 up to 73; a round is 2 d hops (a
vote up and the outcome down per level: a segment over a kept connection, the receiving process woken; the root
decides alone, with no store operation). `hop` is taken from 2 speakers, round / 2, where each process has a core of
this 2-core machine, as a host has its own; beyond 2, the processes share the two cores and a round holds their
turns (shown, not fitted). `--into` adds {"tree": {...}} to a units file of control_plane_units.py, which
control_plane_model.py reads. One intra-op thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.control_plane.model_formulas import tree_depth
from phalanx.testing import free_port
from phalanx.tools.bench_compare import add_json_flag, write_figures
from phalanx.world.generations.commit_tree import CommitTree, SocketLinks, read_speakers


def _speaker(rank: int, count: int, steps: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, count, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=count, timeout=timedelta(seconds=60))
    links = SocketLinks("127.0.0.1")
    links.me = rank
    store.append("speakers", f"{rank}:1:{links.address},")
    dist.barrier()
    weights, links.addresses = read_speakers(store.get("speakers").decode())
    tree = CommitTree(weights, rank, links)
    dist.barrier()
    started = None
    for number in range(1, steps + 1):
        if number == steps // 10 + 1:  # past the first rounds (the pairs' first messages)
            started = time.perf_counter()
        applied = tree.settle(number, 1, count, lambda: False, lambda: None, lambda arriving: arriving.wait(30.0))
        assert applied, f"step {number} was not applied"
    round_seconds = (time.perf_counter() - started) / (steps - steps // 10)
    if rank == 0:
        Path(out).write_text(json.dumps({"round": round_seconds}))
    links.close()
    dist.destroy_process_group()


def measure(counts: list[int], steps: int) -> dict:
    rounds = {}
    for count in counts:
        out = f"/tmp/phalanx-tree-units-{os.getpid()}-{count}.json"
        mp.spawn(_speaker, args=(count, steps, free_port(), out), nprocs=count)
        rounds[count] = json.loads(Path(out).read_text())["round"]
        os.unlink(out)
        print(f"{count} speakers (depth {tree_depth(count)}): a round {1e3 * rounds[count]:.2f} ms", flush=True)
    first = min(counts)
    return {"round": rounds, "hop": rounds[first] / (2 * tree_depth(first)), "hop_from": first, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speakers", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--into", type=Path, help="a units file (control_plane_units.py's) to add the figures to")
    add_json_flag(parser)
    args = parser.parse_args()
    tree = measure(args.speakers, args.steps)
    write_figures(args.json_path, {"hop ms": round(1e3 * tree["hop"], 3),
                                   **{f"{n} speakers round ms": round(1e3 * r, 2) for n, r in tree["round"].items()}})
    print(f"a hop: {1e3 * tree['hop']:.3f} ms (from {tree['hop_from']} speakers)")
    if args.into:
        units = json.loads(args.into.read_text()) if args.into.exists() else {}
        units["tree"] = tree
        args.into.write_text(json.dumps(units, indent=1))


if __name__ == "__main__":
    main()
