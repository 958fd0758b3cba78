"""What live recovery's control plane costs per rank and step, and how fast it notices a host lost, on namespace hosts.

    sudo PYTHONPATH=. python benchmarks/control_plane/control_plane.py [--hosts 2 4 8 16] [--per-host 1] [--steps 20]
        [--pause 0.15] [--rounds 1] [--kill] [--cut] [--cut-host stopped|runs] [--loss-rounds 1] [--json FILE]
        [--label TEXT]

N network namespaces on a bridge (root needed), `phalanx run --nnodes N --node-rank i --nproc-per-node L` on each,
tests/e2e/jobs/control_plane_job.py: the loop of docs/data.md with a tiny model, launch rank 0 sleeping `--pause` s
a step (the others wait on it in their collectives, where a waiting rank looks for a lost peer). Each host's kernel
TCP counters (its namespace's /proc/net/snmp: workers, launcher and the store on host 0 alike) are read by the job at
the ends of step 5 and step 5 + `--steps`. Each N runs with live recovery on (`--min-world-size` = the ranks of all
hosts but one) and off (`--min-world-size 0`), `--rounds` times each, alternating (medians); the table says, per rank
and step, the TCP connections opened (ActiveOpens) and segments sent (OutSegs) with it on and off and what it adds,
the segments host 0 (the store's) received per step, and the mean step time on / off.

`--kill` / `--cut`: at each N, live recovery on, the last host's launcher and workers are SIGKILLed (by pid, together),
or its link is set down, after its 8th step. A cut host's launcher and workers are SIGSTOPped as its link goes down
(`--cut-host stopped`, the default): on real hosts they would go on running on cores of their own, while here they
would share the survivors' 2 (`--cut-host runs` lets them, and the JSON's `victim` says what share of a core they
took). The table says when the ranks left named the loss (a watcher's "found rank R gone" record when phalanx logs one,
at DEBUG; else the "lost ranks [...] ... regrouped in X s" line less X), their regroup (that line's X, rank 0's; and
the run summary's, models and loaders included), the last survivor on the new groups and done with its models and
loaders (from the regroup's parts, timed on every survivor), and their next step, all from the moment of the kill or
the cut, against the issue's bounds at N = 16: a process gone named within 1 s, a host cut off within the heartbeat
window + 1 s (5 s), the regroup done within 2 s of that. `--json FILE`: the figures appended to FILE (a JSON list), for
benchmarks/control_plane/control_plane_model.py to compare against; besides the table's, each run's step times and the
segments per step on one rank's own connections to the store (`rank_store`, both ways), on the kept watch it opened
(`rank_watch`) and on its other connections (`rank_other`: Gloo's pairs), from ss's per-socket counters; a loss's
regroup parts (`parts`).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.control_plane.model_formulas import own_segments
from phalanx.world.liveness import SILENT_WINDOW
from tests.helpers.control_plane import Figures, loss_run, run_job
from tests.helpers.namespaces import bridged_hosts

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = {"kill": 1.0, "cut": SILENT_WINDOW + 1.0}  # seconds to name the loss, at N = 16
REGROUP_BOUND = 2.0  # seconds from the loss named to the regroup done


def _median(runs: list[Figures]) -> Figures:
    return Figures(**{name: statistics.median(getattr(run, name) for run in runs)
                      for name in ("connections", "segments", "store_host_in", "step_seconds", "rank_store",
                                   "rank_other", "rank_watch", "rank_other_data", "commit", "rank_tree")})


def measure(count: int, per_host: int, steps: int, pause: float, rounds: int, work: Path) -> dict:
    runs: dict[bool, list[Figures]] = {True: [], False: []}
    started = time.monotonic()
    with bridged_hosts("pcb", 222, count) as hosts:
        for round_number in range(rounds):
            for live in ((True, False) if round_number % 2 == 0 else (False, True)):
                runs[live].append(run_job(hosts, work / f"{count}x{per_host}-{round_number}-{live}",
                                          per_host=per_host, live=live, window=steps, pause=pause))
    on, off = _median(runs[True]), _median(runs[False])
    return {"hosts": count, "per_host": per_host, "steps": steps, "pause": pause, "rounds": rounds,
            "on": asdict(on), "off": asdict(off), "added": asdict(on.minus(off)),
            "durations": {"on": [d for run in runs[True] for d in run.durations],
                          "off": [d for run in runs[False] for d in run.durations]},
            "pairs": [{"on": asdict(a), "off": asdict(b)} for a, b in zip(runs[True], runs[False])],
            "seconds": time.monotonic() - started}


def lose(count: int, per_host: int, how: str, pause: float, work: Path, round_number: int,
         cut_host: str = "stopped") -> dict:
    started = time.monotonic()
    with bridged_hosts("pcb", 222, count) as hosts:
        loss = loss_run(hosts, work / f"{how}-{count}x{per_host}-{round_number}", how, per_host=per_host, pause=pause,
                        cut_host=cut_host)
    return {"hosts": count, "per_host": per_host, "pause": pause, **asdict(loss), "seconds": time.monotonic() - started}


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def steady_table(rows: list[dict]) -> str:
    lines = ["| hosts x ranks | connections opened: on / off / added | segments sent: on / off / added | "
             "store host's segments received per step: added | a rank's control plane (store, watch, tree), "
             "segments both ways | Gloo's, on / off (of them data) | step time on / off (s) | "
             "a rank's commit per step (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        on, off, add = row["on"], row["off"], row["added"]
        lines.append(f"| {row['hosts']} x {row['per_host']} | {on['connections']:.2f} / {off['connections']:.2f} / "
                     f"**{add['connections']:.2f}** | {on['segments']:.1f} / {off['segments']:.1f} / "
                     f"**{add['segments']:.1f}** | {add['store_host_in']:.1f} | "
                     f"**{own_segments(row):.1f}** ({on['rank_store']:.1f}, {on['rank_watch']:.1f}, "
                     f"{on.get('rank_tree', 0.0):.1f}) | "
                     f"{on['rank_other']:.1f} / {off['rank_other']:.1f} ({on['rank_other_data']:.1f} / "
                     f"{off['rank_other_data']:.1f}) | {on['step_seconds']:.3f} / "
                     f"{off['step_seconds']:.3f} | {1e3 * on.get('commit', 0.0):.1f} |")
    return "\n".join(lines)


def loss_table(rows: list[dict]) -> str:
    lines = ["| hosts x ranks | lost | named after (s) | read from | regroup (s) | regroup, models and loaders "
             "too (s) | all survivors regrouped, and done with models and loaders, after named (s) | next step "
             "after (s) | bounds at N = 16: named, regroup |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        what = ("SIGKILL, launcher and workers" if row["how"] == "kill" else
                f"link down, its processes {(row.get('victim') or {}).get('cut_host', 'runs')}")
        parts, named = row.get("parts") or {}, row["detected"]
        done = [parts[part][3] - named if part in parts and named is not None else None
                for part in ("meet", "followers")]
        lines.append(f"| {row['hosts']} x {row['per_host']} | {what} | {_f(named)} | {row['detected_by']} | "
                     f"{_f(row['regroup'], 3)} | {_f(row['regroup_summary'], 3)} | {_f(done[0], 3)}, "
                     f"{_f(done[1], 3)} | {_f(row['next_step'])} | <= {BOUNDS[row['how']]:g} s, "
                     f"<= {REGROUP_BOUND:g} s |")
    return "\n".join(lines)


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def main() -> None:
    # A SIGTERM (a stopped benchmark) unwinds like Ctrl-C, so that the hosts' namespaces and bridge come down.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8, 16], help="host counts (default 2 4 8 16)")
    parser.add_argument("--per-host", type=int, default=1, help="ranks per host (default 1)")
    parser.add_argument("--steps", type=int, default=20, help="steady steps counted, after 5 (default 20)")
    parser.add_argument("--pause", type=float, default=0.15, help="seconds launch rank 0 sleeps a step (default 0.15)")
    parser.add_argument("--rounds", type=int, default=1, help="on/off pairs per host count; medians (default 1)")
    parser.add_argument("--kill", action="store_true", help="SIGKILL the last host whole, instead of the counts")
    parser.add_argument("--cut", action="store_true", help="set the last host's link down, instead of the counts")
    parser.add_argument("--cut-host", choices=("stopped", "runs"), default="stopped",
                        help="the cut host's processes: SIGSTOPped as its link goes down (default), or left running")
    parser.add_argument("--loss-rounds", type=int, default=1, help="losses of each kind per host count (default 1)")
    parser.add_argument("--json", type=Path, help="append the figures to this file (a JSON list)")
    parser.add_argument("--label", help="what code ran, for the table and the JSON (default: git's HEAD)")
    args = parser.parse_args()
    if min(args.hosts) < 2:
        parser.error("--hosts: at least 2 (live recovery goes on without one host)")
    steady, losses = [], []
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        for count in args.hosts:
            if args.kill or args.cut:
                for how in [h for h, asked in (("kill", args.kill), ("cut", args.cut)) if asked]:
                    for round_number in range(args.loss_rounds):
                        losses.append(lose(count, args.per_host, how, args.pause, work, round_number, args.cut_host))
                        print(json.dumps(losses[-1]), flush=True)
            else:
                steady.append(measure(count, args.per_host, args.steps, args.pause, args.rounds, work))
                print(json.dumps(steady[-1]), flush=True)
    commit = args.label or _commit()
    print(f"\nphalanx {commit}, {args.per_host} rank(s) per host, launch rank 0 sleeping {args.pause} s a step")
    if steady:
        print(f"per rank and step, over {args.steps} steady steps (live recovery on: --min-world-size = the ranks of "
              f"all hosts but one; off: 0):\n")
        print(steady_table(steady))
    if losses:
        print("\nthe last host lost after its 8th step (live recovery on), seconds from the kill or the cut:\n")
        print(loss_table(losses))
    if args.json:
        kept = json.loads(args.json.read_text()) if args.json.exists() else []
        kept += [{"kind": "steady", "commit": commit, **row, "figures": {
            f"{row['hosts']} hosts segments added": round(row["added"]["segments"], 1),
            f"{row['hosts']} hosts connections added": round(row["added"]["connections"], 2),
            f"{row['hosts']} hosts control plane segments": round(own_segments(row), 1)}} for row in steady]
        kept += [{"kind": "loss", "commit": commit, **row, "figures": {
            f"{row['how']} @{row['hosts']} named s": row["detected"] and round(row["detected"], 2),
            f"{row['how']} @{row['hosts']} regroup s": row["regroup"] and round(row["regroup"], 3),
            f"{row['how']} @{row['hosts']} next step s": row["next_step"] and round(row["next_step"], 2)}}
            for row in losses]
        args.json.write_text(json.dumps(kept, indent=1) + "\n")


if __name__ == "__main__":
    main()
