"""A regroup's two Gloo groups as the workers of a namespace run make them: the scale model's group unit under the
load the loss runs have (their launchers, the store, each worker's watch threads), for control_plane_model.py.

    sudo PYTHONPATH=. python benchmarks/control_plane/group_units.py [--hosts 2 4 8 16] [--rounds 5] [--into UNITS]
        [--json FILE]

control_plane_units.py measures the groups with small clients, one per namespace host and nothing else running; the
loss runs (control_plane.py --kill / --cut) make them in phalanx's workers, beside 16 launchers and the store on the
machine's cores. Here, for each N, the job of those runs (tests/e2e/jobs/control_plane_job.py, live recovery on, a
rank per host) trains its steps, then every rank makes a regroup's main and control groups `--rounds` times, as a
regroup makes them (generations/current.py generation_group), after a decision rank 0 stores and the others see at
their looks (job's time_groups). Per round: `first`, the decision to the last rank's main group; `second`, from there
to the last rank's control group. Printed, beside the clients' of UNITS; with `--into`, the medians go into UNITS (a
control_plane_units.py file) as `group_lazy_workers[N]`, with its store operations per pair (`store_segs`, taken from
its `group_lazy[N]`): the model takes them in place of the clients' (group_model.py), and says which it used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from phalanx.tools.bench_compare import add_json_flag, write_figures
from tests.helpers.control_plane import Job
from tests.helpers.namespaces import bridged_hosts

STEPS = 6  # the loop's steps before the rounds: the world settled, its watch set up


def measure(count: int, rounds: int, work: Path) -> dict:
    """`count` namespace hosts, a rank each: the rounds' (first, second), from every rank's groups file."""
    with bridged_hosts("pgu", 224, count) as hosts:
        job = Job(hosts, work / f"groups-{count}", 1, True, STEPS, (1, 2), 0.0,
                  job_args=("--group-rounds", str(rounds)))
        try:
            job.wait()
        finally:
            job.stop()
    per_rank = [[[float(v) for v in line.split()] for line in (job.run_dir / f"groups-{rank}.txt").read_text()
                 .splitlines()] for rank in range(count)]
    found = []
    for made in zip(*per_rank):  # a round: (decided, main made, control made) on each rank
        main = max(m for _, m, _ in made)
        found.append((main - made[0][0], max(c for _, _, c in made) - main))
    return {"first": statistics.median(f for f, _ in found), "second": statistics.median(s for _, s in found),
            "rounds": [[round(f, 4), round(s, 4)] for f, s in found]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8, 16], help="host counts (default 2 4 8 16)")
    parser.add_argument("--rounds", type=int, default=5, help="groups made per host count; medians (default 5)")
    parser.add_argument("--into", type=Path, help="a control_plane_units.py file, updated in place")
    add_json_flag(parser)
    args = parser.parse_args()
    units = json.loads(args.into.read_text()) if args.into else {}
    clients = {int(n): v for n, v in units.get("group_lazy", {}).items()}
    missing = [n for n in args.hosts if n not in clients]
    if args.into and missing:
        parser.error(f"--into: {args.into} has no group_lazy for {missing} hosts (control_plane_units.py --hosts "
                     f"{' '.join(map(str, args.hosts))} measures them): its store operations per pair are needed")
    workers = units.setdefault("group_lazy_workers", {})
    with tempfile.TemporaryDirectory() as directory:
        for count in args.hosts:
            row = measure(count, args.rounds, Path(directory))
            beside = ""
            if count in clients:
                row["store_segs"] = clients[count]["store_segs"]
                beside = (f"; the clients' {1e3 * clients[count]['first']:.1f} + "
                          f"{1e3 * clients[count]['second']:.1f} ms")
            workers[str(count)] = row
            print(f"{count} hosts: the workers' groups {1e3 * row['first']:.1f} ms (main, from the decision) + "
                  f"{1e3 * row['second']:.1f} ms (control){beside}", flush=True)
    write_figures(args.json_path, {f"{n} hosts groups ms": round(1e3 * (row["first"] + row["second"]), 1)
                                   for n, row in workers.items()}, group_lazy_workers=workers)
    if args.into:
        args.into.write_text(json.dumps(units, indent=1) + "\n")


if __name__ == "__main__":
    main()
