"""The commit round of the speakers' tree (world/generations/commit_tree.py), measured: the scale model's `hop`.

    PYTHONPATH=. python benchmarks/control_plane/tree_units.py [--speakers 2 4 8 16] [--steps 300]
        [--into benchmarks/results/UNITS.json]

H processes on this machine, one speaker each (a host's), on a Gloo group over the loopback and one TCPStore, commit
steps back to back through phalanx's own CommitTree and GlooLinks: each step starts at a barrier, and its round is the
time from the barrier to the last speaker knowing the outcome. The depth d of the tree (fan-out 8) is 1 up to 9
speakers, 2 up to 73; a round is 2 d hops (a vote up and the outcome down per level) and the root's claim, a store
round trip: hop = (round - claim) / 2 d, the median over the counts. `--into` adds {"tree": {...}} to a units file of
control_plane_units.py, which control_plane_model.py reads. One intra-op thread per process; on this 2-core machine
the processes share the cores, so a hop holds the wake-ups of the receiving threads as the cores allow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.control_plane.model_formulas import tree_depth
from phalanx.testing import free_port
from phalanx.world.generations.commit_tree import CommitTree, GlooLinks, outcome_value


def _speaker(rank: int, count: int, steps: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, count, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=count, timeout=timedelta(seconds=60))
    links = GlooLinks(dist.new_group(backend="gloo"), tuple(range(count)))
    tree = CommitTree({member: 1 for member in range(count)}, rank, links)
    rounds, claims = [], []

    def claim(number: int) -> bool:
        started = time.perf_counter()
        held = store.compare_set(f"outcome/{number}", "", outcome_value(number, True)).decode()
        claims.append(time.perf_counter() - started)
        return held == outcome_value(number, True)

    for number in range(1, steps + 1):
        dist.barrier()
        started = time.perf_counter()
        applied = tree.settle(number, 1, count, lambda n=number: claim(n), lambda: False,
                              lambda arriving: arriving.wait(30.0))
        rounds.append(time.perf_counter() - started)
        assert applied, f"step {number} was not applied"
    every = [None] * count
    dist.all_gather_object(every, (rounds, claims))
    if rank == 0:
        slowest = [max(r[0][n] for r in every) for n in range(steps)]
        Path(out).write_text(json.dumps({"round": statistics.median(slowest[steps // 10:]),
                                         "claim": statistics.median(every[0][1][steps // 10:])}))
    links.close()
    dist.destroy_process_group()


def measure(counts: list[int], steps: int) -> dict:
    rounds, claims, hops = {}, {}, []
    for count in counts:
        out = f"/tmp/phalanx-tree-units-{os.getpid()}-{count}.json"
        mp.spawn(_speaker, args=(count, steps, free_port(), out), nprocs=count)
        got = json.loads(Path(out).read_text())
        os.unlink(out)
        rounds[count], claims[count] = got["round"], got["claim"]
        hops.append((got["round"] - got["claim"]) / (2 * tree_depth(count)))
        print(f"{count} speakers (depth {tree_depth(count)}): a round {1e3 * got['round']:.2f} ms, the root's claim "
              f"{1e3 * got['claim']:.3f} ms", flush=True)
    return {"round": rounds, "claim": claims, "hop": statistics.median(hops), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speakers", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--into", type=Path, help="a units file (control_plane_units.py's) to add the figures to")
    args = parser.parse_args()
    tree = measure(args.speakers, args.steps)
    print(f"a hop: {1e3 * tree['hop']:.3f} ms (the median over the counts)")
    if args.into:
        units = json.loads(args.into.read_text()) if args.into.exists() else {}
        units["tree"] = tree
        args.into.write_text(json.dumps(units, indent=1))


if __name__ == "__main__":
    main()
