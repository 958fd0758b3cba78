"""A regroup's two Gloo groups as the workers of a namespace run make them: the scale model's group unit under the
load the loss runs have (their launchers, the store, each worker's watch threads), for control_plane_model.py.

    sudo PYTHONPATH=. python benchmarks/control_plane/group_units.py [--hosts 2 4 8 16] [--per-host 1]
        [--rounds 5] [--jobs 1] [--into UNITS] [--json FILE]

control_plane_units.py measures the groups with small clients, one per namespace host and nothing else running; the
loss runs (control_plane.py --kill / --cut) make them in phalanx's workers, beside the launchers and the store on
the machine's cores. Here, for each host count, the job of those runs (tests/e2e/jobs/control_plane_job.py, live
recovery on, `--per-host` ranks a host) trains its steps, then every rank does `--rounds` times what a regroup's
meeting does once the survivors agreed (job's time_groups): rank 0 stores a decision, the others see it at their
looks, each makes the main and the control group (generations/current.py generation_group, on one store client of
its own, as meet makes them) and waits for all to have made them (agreement.groups_formed). Per round: `first`, the
decision to the last rank's main group; `second`, from there to the last rank's control group; `third`, from there
to rank 0's new watch set up (the formation, rank 0 saying who it is, its watch); and each rank's CPU in each part
(`cpu_first`, ...). Printed, beside the clients' of UNITS; with `--into`, the medians go into UNITS (a
control_plane_units.py file): a rank a host as `group_lazy_workers[N]`, with its store operations per pair
(`store_segs`, taken from its `group_lazy[N]`), and `--per-host L` as `group_lazy_workers_by_layout[L][ranks]`. The
model takes them in place of the clients', at the layout nearest the one it models (group_model.py), and says which
it used: on this machine, how long the groups take depends on the layout as well as the ranks (the launchers, and
the pairs within a host against across hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from phalanx.tools.bench_compare import add_json_flag, write_figures
from tests.helpers.control_plane import Job
from tests.helpers.namespaces import bridged_hosts

STEPS = 6  # the loop's steps before the rounds: the world settled, its watch set up


def measure(count: int, rounds: int, work: Path, per_host: int = 1, jobs: int = 1) -> dict:
    """`count` namespace hosts, `per_host` ranks each: the rounds' parts, from every rank's groups file, over `jobs`
    jobs (each its own hosts and processes). Per round: `first`, the decision to the last rank's main group;
    `second`, from there to the last rank's control group; `third`, from there to rank 0's new watch set up (it
    decides, and its line is the runs' regroup: the formation, then meet's last part); each rank's CPU in each, the
    mean over the ranks."""
    found, cpu = [], []
    for number in range(jobs):
        with bridged_hosts("pgu", 224, count) as hosts:
            job = Job(hosts, work / f"groups-{count}x{per_host}-{number}", per_host, True, STEPS, (1, 2), 0.0,
                      job_args=("--group-rounds", str(rounds)))
            try:
                job.wait()
            finally:
                job.stop()
        per_rank = [[[float(v) for v in line.split()] for line in (job.run_dir / f"groups-{rank}.txt").read_text()
                     .splitlines()] for rank in range(count * per_host)]
        for made in zip(*per_rank):  # a round on each rank: (decided, main, control, formed, watched, the 4 CPUs)
            main, control = max(m[1] for m in made), max(m[2] for m in made)
            found.append((main - made[0][0], control - main, made[0][4] - control))
            cpu.append([statistics.mean(m[5 + part] for m in made) for part in (0, 1)]
                       + [statistics.mean(m[7] + m[8] for m in made)])
    row = {name: statistics.median(f[part] for f in found) for part, name in enumerate(("first", "second", "third"))}
    row.update({f"cpu_{name}": statistics.median(c[part] for c in cpu)
                for part, name in enumerate(("first", "second", "third"))})
    return {**row, "cores": len(os.sched_getaffinity(0)), "jobs": jobs,
            "rounds": [[round(value, 4) for value in f] for f in found]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8, 16], help="host counts (default 2 4 8 16)")
    parser.add_argument("--per-host", type=int, default=1, help="ranks per host (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="groups made per host count and job; medians "
                        "(default 5)")
    parser.add_argument("--jobs", type=int, default=1, help="jobs per host count, their rounds pooled (default 1): "
                        "on 2 cores one job's medians move by 10-20 %% from the next's")
    parser.add_argument("--into", type=Path, help="a control_plane_units.py file, updated in place")
    add_json_flag(parser)
    args = parser.parse_args()
    units = json.loads(args.into.read_text()) if args.into else {}
    clients = {int(n): v for n, v in units.get("group_lazy", {}).items()}
    missing = [n for n in args.hosts if n not in clients]
    if args.into and missing and args.per_host == 1:
        parser.error(f"--into: {args.into} has no group_lazy for {missing} hosts (control_plane_units.py --hosts "
                     f"{' '.join(map(str, args.hosts))} measures them): its store operations per pair are needed")
    if args.per_host == 1:
        workers = units.setdefault("group_lazy_workers", {})
    else:  # keyed by ranks; the store operations per pair are the one-rank-a-host rounds' (the same groups)
        workers = units.setdefault("group_lazy_workers_by_layout", {}).setdefault(str(args.per_host), {})
    with tempfile.TemporaryDirectory() as directory:
        for count in args.hosts:
            row = measure(count, args.rounds, Path(directory), args.per_host, args.jobs)
            ranks, beside = count * args.per_host, ""
            if ranks in clients:
                row["store_segs"] = clients[ranks]["store_segs"]
                beside = (f"; the clients' {1e3 * clients[ranks]['first']:.1f} + "
                          f"{1e3 * clients[ranks]['second']:.1f} ms")
            workers[str(ranks)] = row
            print(f"{count} x {args.per_host}: the workers' groups {1e3 * row['first']:.1f} ms (main, from the "
                  f"decision) + {1e3 * row['second']:.1f} ms (control) + {1e3 * row['third']:.1f} ms (formed, "
                  f"watched), each rank's CPU {1e3 * row['cpu_first']:.1f} + {1e3 * row['cpu_second']:.1f} + "
                  f"{1e3 * row['cpu_third']:.1f} ms{beside}", flush=True)
    write_figures(args.json_path, {f"{n} ranks, {args.per_host} a host, groups ms":
                                   round(1e3 * (row["first"] + row["second"]), 1) for n, row in workers.items()},
                  group_lazy_workers=workers)
    if args.into:
        args.into.write_text(json.dumps(units, indent=1) + "\n")


if __name__ == "__main__":
    main()
