"""A scale model of live recovery's control plane, from unit costs measured here, to thousands of ranks: per rank and
step (store operations, connections, segments), the store's load, the time to name a loss, the regroup.

    sudo PYTHONPATH=. python benchmarks/control_plane/control_plane_model.py [--units FILE | --unit-hosts 2 4 8 16]
        [--measured benchmarks/results/control_plane_before.json] [--per-host 8] [--pause 0.15] [--step 0.17]
        [--design today|new|new-host]

The unit costs come from benchmarks/control_plane/control_plane_units.py (namespace hosts; `--units FILE` reads a
saved set): a store operation's round trip `rtt` and the store's CPU per operation `s` (its service time: one thread
serves every operation in turn), TCP segments per operation (`seg_op` back to back, plus `seg_ack` for the delayed
ACK that closes a burst of them), a connection probe (`t_p`, `q` segments), an idle kept connection's keepalive
segments per second (`keep`), the commit's reads per rank `r` (rounds among N <= 16 clients, each after a small Gloo
all-reduce), a regroup's two Gloo groups among N (`G2(N)`: made as the survivors make them, after the agreement's
decision, one after the other), a kept watch's end after a SIGKILL (`t_end`: the killed process's sockets closed, the
watcher's thread woken: this machine's scheduling, under its load; one victim alone for the extrapolation, and where
the model is compared with the runs, a host's victims killed together beside the runs' other ranks, at the nearest
layout measured: watch_end.py --per-host L --beside H). With `--measured`
(benchmarks/control_plane/control_plane.py's --json), `r` is read from the namespace runs instead: a rank's own store
connection's segments per step, less the rest of the formula below (the runs' ranks come to the commit further apart
than the rounds' clients: more reads); the extrapolation takes the largest run's. phalanx's own constants: a waiting
rank looks every WATCH = 0.02 s (every 0.1 s in the designs before the tree, as the code they describe did), the
heartbeat window WINDOW = 4 s, a silent probe waits PROBE_TIMEOUT = 0.1 s, a kept
watch ticks every TICK = 0.25 s and ends when a tick stays unacknowledged for WINDOW (TCP_USER_TIMEOUT), the deciding
survivor of an agreement makes AGREE_OPS = 8 store operations once every survivor is listed (its append, a check for
a decision, a read of the list, 3 for the verdicts, its proposal, a read of the decision).

P ranks, L per host; launch rank 0 leads every step by w seconds (`--pause`: the benchmark's slow rank), a step takes
T; f = (P - 1) / P of the ranks wait on it. A look takes X; a waiting rank looks c = max{k : k WATCH + (k - 1) X <= w}
times a step. One host (P = L) has no commit and no store operation per step: the shared-memory exchange ends alike
on every rank, and a peer is checked by its pid.

Per rank and step, healthy:
  today   X = (P - L) t_p + rtt (the look reads the commit counter, then probes every member on another host in turn)
          store ops  O = 1 + r + f c             (the commit's add and reads; one read per look)
          connections K = f c (P - L)
          segments   S = seg_op O + seg_ack (1 + f c) + q K
  new     X = rtt (one read of the generation's trouble counter; the watch is the kernel's)
          O = u (1 + 2) + f c, u = 1 (a commit per rank) or 1/L (one per host, its ranks agreeing in shared memory:
          what phalanx does, world/generations/host_board.py): the commit's add, then one wait the store answers once
          the last rank (host) adds, then one read of the counter; the namespace runs count one rank's own store
          connection on local rank 0, its host's leader (u = 1 there)
          K = 0
          S = seg_op O + seg_ack (u + f c) + 2 T / TICK   (one kept watch per rank: it sends a byte every TICK =
          0.25 s and acknowledges the byte of the rank that watches it)
  tree    (phalanx now: new with 1/L, then from a generation's second step the speakers' tree, commit_tree.py)
          X = 0 (a look asks what the watch's thread heard on the generation's alarm key: no store operation)
          O = 0 (the root decides alone; a rank in doubt after a loss asks the store, on the loss's path only)
          K = 0
          S = (seg_op + seg_ack) (O + 2 (H - 1) / P) + 2 T / TICK   (H = P / L speakers: each of the tree's H - 1
          edges carries a vote up and the outcome down a step, counted at both its ends); a host's speaker, whose
          connections the runs count (local rank 0), carries its host's share: 2 (H - 1) / H in place of 2 (H - 1) / P
  the store: P O operations per step, busy P O s / T of the time.
A healthy commit's delay, once the last host is ready (H hosts):
  new-host  3 rtt + 2 H s      (an add, the wait, a read, behind the store's service of every host's add and read)
  tree      2 d hop            (d = the tree's depth, fan-out 8, 3 at 512 hosts: a message up and one down per
                                level; `hop` from tree_units.py, rtt / 2 when not measured)

Named (worst case, from the loss to the first rank that names it; then to every waiting rank knowing it):
  today, process gone   WATCH + X                   (a look's scan reaches its beacon, refused; a Gloo peer that
                                                     sees the reset gives the step up: the others see it at a look)
  today, host cut off   WINDOW + WATCH + X + L PROBE_TIMEOUT   (silent probes, each waiting out its timeout)
  new, process gone     t_end + 2 rtt               (its watcher's connection ends: the kernel closes the killed
                                                     process's sockets, the watcher's thread wakes; the verdict: 2
                                                     store ops; the runs read the watcher's line, just before them)
  new, host cut off     WINDOW + TICK + t_end + 2 rtt  (a tick sent within TICK of the cut stays unacknowledged)
  new: every waiting rank knows it WATCH + rtt later (its next look); today each rank finds it by its own look;
  tree: rtt + P s + WATCH later (the alarm key set, the store waking every member's thread in turn, then a look);
  one host: a peer's pid is read at most every LOOK_EVERY = 0.05 s (watch.py).
Regroup (from the loss named to the ranks left training on new groups; what world/generations/ does):
  R = E + A + G2(S) + F, S = P - L survivors (a host lost)
  E         the deciding survivor's wait for the last one to enter, + rtt: each enters at its next look (one blocked
            in the commit's wait is woken at once, by the `done` keys the watcher sets). Before the tree: a whole
            look (WATCH, the worst case). Tree: the looks' phases taken as independent and uniform, the expected
            wait past the decider's own look, WATCH n / (2 (n + 2)) with n = S - 1 (model_formulas.last_entry); 0
            when the survivors entered their waits together and look in phase, or when the decider enters last: the
            kill runs' (struck right after the victim's step, their rank 0, which decides, is in its pause; it was
            the last to enter in all of them), which the comparison takes; WATCH at the worst (the last survivor's
            look just missed the alarm)
  A, today  P rtt + P^2 s + (P - L) t_p             (each polls every member's key, P of them at once at the store,
                                                     and probes; a host cut off: + L PROBE_TIMEOUT, silent probes)
  A, new    AGREE_OPS rtt + S s                     (the survivor that decides, the first in rank order, once every
                                                     survivor is listed; the store serves the S appends)
  A, tree   the same + FORM_OPS rtt + S s           (then, the groups made, the formation: each survivor adds to a
                                                     counter, the last one sets the key the others wait on)
  G2(S)     the main group, then the control group (generations/current.py meet: two Gloo groups, one after the
            other, on the one store): from the units' `first` (the decision, its 20 ms polls, the main group) and
            `second`, fitted as group_model.py says: lazy groups, as phalanx makes them, cost the store k ops per pair
            that their connect joins (a ring's and a broadcast tree's, at most 2 + log2 S peers per rank) and the time
            of its 1 + log2 S steps; full-mesh groups (each rank reads every member's address: k S (S - 1) ops) are
            shown beside them, and taken when the units measured no lazy ones. The lazy groups' unit is the loss
            runs' workers' (group_units.py: the job's ranks make them beside the launchers and the store, as a
            regroup does) when the units file has it, else control_plane_units.py's small clients'; the workers'
            at the layout measured nearest L (ranks a host: on this machine the layout moves it too, the launchers
            and the pairs within a host against across hosts), fitted over the ranks measured at that layout.
  F         the models and loaders rebuilt (the DDP model's regroup is most of it; measured: the run summary's regroup
            less the workers' line's)
Where the namespace runs overlap (N <= 16 ranks), the model is evaluated with their own wait per step (w = each
step's time less the step's own work, the step time with live recovery off less the pause) and compared. The bar is
taken on a rank's control-plane connections (its store connections and the kept watch it opened, ss's per-socket
segments both ways): the kernel's on-minus-off, shown beside them, also holds Gloo's segments, which move with the
on and off runs' step times. The runs' regroup is rank 0's (its "lost ranks" line, the launcher's summary): rank 0
decides, and waits for the last survivor to enter, up to a look (E above); the runs' parts
show that wait, then A, then each group. Today's runs name a loss by rank 0's line, which comes only once rank 0 looks,
after its pause: the model's figure there is pause + the worst case above; the new design's runs by the watcher's
verdict.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.control_plane.model_agreement import agreement, followers_seconds, loss_rows
from benchmarks.control_plane.model_formulas import (
    WAITED_COMMIT,
    Units,
    commit_delay,
    named,
    own_segments,
    per_step,
    regroup,
)

DESIGNS = {"today": "today", "new": "new, a commit per rank", "new-host": "new, a commit per host, in the store",
           "tree": "now, a commit per host, along the speakers' tree"}  # --design
SHOWN = ("today", "new-host", "tree")  # the scale table's: before, the store's commit per host, phalanx now


def scale_table(units: Units, per_host: int, pause: float, step: float, followers: float, r=None) -> str:
    lines = ["| ranks (hosts x ranks) | design | store ops / rank / step | connections / rank / step | "
             "segments / rank / step | the store: ops / step (busy) | a healthy commit's delay: ms (% of the step) | "
             "process gone: named / all know (s) | host cut off: named / all know (s) | regroup, a process gone: "
             "full-mesh groups / lazy groups (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ranks in (8, 64, 512, 4096):
        hosts = max(1, ranks // per_host)
        for design in SHOWN:
            got = per_step(units, design, ranks, per_host, [pause], step, r)
            kill, cut = (named(units, design, ranks, per_host, how) for how in ("kill", "cut"))
            delay = commit_delay(units, design, ranks, per_host)
            lines.append(
                f"| {ranks} ({hosts} x {per_host}) | {DESIGNS[design]} | {got['ops']:.2f} | "
                f"{got['connections']:.2f} | {got['segments']:.1f} | {got['store_ops']:.0f} "
                f"({100 * got['store_busy']:.0f} %) | "
                f"{'-' if delay is None else f'{1e3 * delay:.2f} ({100 * delay / step:.1f} %)'} | "
                f"{kill[0]:.3f} / {kill[1]:.2f} | {'-' if cut is None else f'{cut[0]:.2f} / {cut[1]:.2f}'} | "
                f"{_seconds(regroup(units, design, ranks, per_host, followers, lazy=False))} / "
                f"{_seconds(regroup(units, design, ranks, per_host, followers)) if units.lazy else '-'} |")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _waits(row: dict) -> list[float]:
    """The slow rank's lead in each step of a run: the step's time less the step's own work (with live recovery off,
    the step time less the pause)."""
    own_work = row["off"]["step_seconds"] - row["pause"]
    return [d - own_work for d in row["durations"]["on"]] or [row["pause"]]


def overlap_table(units: Units, measured: list[dict], followers: float, design: str = "today") -> str:
    """The model against the namespace runs of `design` ("today": the commit's reads fitted from each run; "new":
    nothing fitted)."""
    lines = ["| hosts x ranks | connections added: measured / model (agreement) | a rank's store segments: measured / "
             "model with the rounds' reads | the commit's reads per rank: rounds / runs | segments added: measured / "
             "model with the runs' reads (agreement) | looks per waiting rank and step |",
             "| --- | --- | --- | --- | --- | --- |"]
    if design != "today":
        lines = ["| hosts x ranks | connections added: measured / model (agreement) | a rank's store segments: "
                 "measured / model (agreement) | a rank's control plane, its store connections, its watch and the "
                 "commit tree's, segments both ways (local rank 0, its host's speaker): measured / model (agreement) | "
                 "segments added, the kernel's on - off: measured / model (agreement) | looks per waiting rank and "
                 "step |",
                 "| --- | --- | --- | --- | --- | --- |"]
    for row in (r for r in measured if r["kind"] == "steady" and "rank_store" in r["on"]):
        ranks, per_host = row["hosts"] * row["per_host"], row["per_host"]
        waits, step = _waits(row), row["on"]["step_seconds"]
        add = row["added"]
        if design != "today":
            got = per_step(units, design, ranks, per_host, waits, step)
            # the runs count local rank 0's store connection: its own commit, or its host's as the leader
            looks = (ranks - 1) / ranks * got["looks"]
            if design == "tree":  # no store operation in a healthy step; the looks ask no store
                store_model = 0.0
            else:
                store_model = units.seg_op * (1 + WAITED_COMMIT + looks) + units.seg_ack * (1 + looks)
            own = own_segments(row)
            lines.append(f"| {row['hosts']} x {per_host} | {add['connections']:.2f} / {got['connections']:.2f} "
                         f"({agreement(got['connections'], add['connections'])}) | {row['on']['rank_store']:.1f} / "
                         f"{store_model:.1f} ({agreement(store_model, row['on']['rank_store'])}) | "
                         f"{own:.1f} / {got['speaker_segments']:.1f} ({agreement(got['speaker_segments'], own)}) | "
                         f"{add['segments']:.1f} / {got['segments']:.1f} "
                         f"({agreement(got['segments'], add['segments'])}) | {got['looks']:.2f} |")
            continue
        rounds = per_step(units, "today", ranks, per_host, waits, step)
        r_runs = units.reads_in_runs(row, waits)
        got = per_step(units, "today", ranks, per_host, waits, step, r_runs)
        store_model = units.seg_op * rounds["ops"] + units.seg_ack * (1 + (ranks - 1) / ranks * rounds["looks"])
        lines.append(f"| {row['hosts']} x {per_host} | {add['connections']:.2f} / {got['connections']:.2f} "
                     f"({agreement(got['connections'], add['connections'])}) | {row['on']['rank_store']:.1f} / "
                     f"{store_model:.1f} | {units.r(ranks):.1f} / {r_runs:.1f} | {add['segments']:.1f} / "
                     f"{got['segments']:.1f} ({agreement(got['segments'], add['segments'])}) | {got['looks']:.2f} |")
    losses = loss_rows(units, [r for r in measured if r["kind"] == "loss"], followers, design)
    if losses:
        lines += ["", "| hosts x ranks | lost | runs | named: measured / model (agreement) | regroup, rank 0's line: "
                  "measured / model (agreement) | its agreement, the last survivor awaited / main group / "
                  "control group / the meeting's end: measured / model | regroup with models and loaders: measured / "
                  "model (agreement) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in losses:
        (hosts, per_host, how), (detected, model_named) = row["key"], row["named"]
        # the first of the victims to exit (their sockets closed a little before: the verdict), in the runs and in
        # the unit the naming was taken from
        first_out = f"; the first victim out: {row['first_out'][0]:.3f} / {row['first_out'][1]:.3f}" \
            if row["first_out"] else ""
        cells = [f"{row[f][0]:.3f} / {row[f][1]:.3f} ({agreement(row[f][1], row[f][0])})" for f in ("regroup",
                                                                                                      "summary")]
        lines.append(f"| {hosts} x {per_host} | {how} | {row['runs']} | {detected:.3f} / {model_named:.3f} "
                     f"({agreement(model_named, detected)}){first_out} | {cells[0]} | "
                     f"{' / '.join(f'{m:.3f}' for m in row['spans'])} / "
                     f"{' / '.join(f'{m:.3f}' for m in row['parts'])} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=Path, help="unit costs saved by control_plane_units.py (else measured now)")
    parser.add_argument("--unit-hosts", type=int, nargs="+", default=[2, 4, 8, 16],
                        help="client counts to measure the units at (default 2 4 8 16)")
    parser.add_argument("--measured", type=Path, nargs="+", default=[],
                        help="benchmarks/control_plane/control_plane.py's --json files, to compare at N <= 16 (the "
                        "loss runs: those of the last file that has some, the code the model follows)")
    parser.add_argument("--per-host", type=int, default=8, help="ranks per host in the extrapolation (default 8)")
    parser.add_argument("--pause", type=float, default=0.15, help="the slow rank's lead per step (default 0.15 s)")
    parser.add_argument("--step", type=float, default=0.17, help="the step time (default 0.17 s)")
    parser.add_argument("--design", choices=list(DESIGNS), default="today",
                        help="the design the --measured runs ran: 'today' (the commit polled, a probe per peer), "
                             "'new' (the kept watch, the commit waited for, one per rank), 'new-host' (one per "
                             "host, its ranks agreeing in shared memory, in the store) or 'tree' (per host, along "
                             "the speakers' tree after a generation's first step: phalanx now)")
    from phalanx.tools.bench_compare import add_json_flag, write_figures

    add_json_flag(parser)
    args = parser.parse_args()
    if args.units:
        raw = json.loads(args.units.read_text())
    else:
        from benchmarks.control_plane.control_plane_units import measure

        raw = measure(args.unit_hosts)
        print(json.dumps(raw))
    units = Units(raw)
    files = [json.loads(path.read_text()) for path in args.measured]
    losses = next((rows for rows in reversed(files) if any(r["kind"] == "loss" for r in rows)), [])
    measured = [r for rows in files for r in rows if r["kind"] != "loss"] + [r for r in losses if r["kind"] == "loss"]
    followers = followers_seconds(measured)
    runs = [r for r in measured if r["kind"] == "steady" and "rank_store" in r["on"]]
    largest = max(runs, key=lambda r: (r["hosts"] * r["per_host"], -r["per_host"]), default=None)
    r_scale = units.reads_in_runs(largest, _waits(largest)) if largest and args.design == "today" else None
    print(f"units: store op {1e6 * units.rtt:.0f} us round trip, {1e6 * units.s:.1f} us of the store's CPU, "
          f"{units.seg_op:.1f} + {units.seg_ack:.1f} segments; probe {1e6 * units.t_p:.0f} us, {units.q:.1f} "
          f"segments; keepalive {units.keep:.1f} segments/s; commit reads per rank "
          f"{', '.join(f'{n}: {v:.1f}' for n, v in sorted(units.reads.items()))}; a regroup's Gloo groups, full "
          f"mesh: {units.full_mesh.describe()}; lazy, made by the {units.lazy_by}: "
          f"{units.lazy.describe() if units.lazy else 'not measured'}; "
          f"{''.join(f'at {n} ranks a host: {fit.describe()}; ' for n, fit in units.layouts.items() if n != 1)}"
          f"a kept watch's end after a kill {1e3 * units.t_end:.1f} ms (as the runs meet it: "
          f"{', '.join(f'{1e3 * units.end(n, here=True)[0]:.1f} ms at {n} a host' for n in sorted(units.ends_here))})"
          f"; models and loaders {followers:.3f} s\n")
    reads = (f"the commit's reads per rank as the run at {largest['hosts']} x {largest['per_host']} shows them "
             f"({r_scale:.1f})" if r_scale is not None else "the commit's reads per rank as the rounds show them")
    layout = units.layout(args.per_host)
    groups_at = f", the workers' groups as made at {layout} rank(s) a host" if layout is not None else ""
    print(f"extrapolated: {args.per_host} ranks per host, the slow rank {args.pause} s ahead, steps of {args.step} s, "
          f"{reads}{groups_at}\n")
    print(scale_table(units, args.per_host, args.pause, args.step, followers, r_scale))
    hosts = 4096 // args.per_host
    got = per_step(units, args.design, 4096, args.per_host, [args.pause], args.step, r_scale)
    kill = named(units, args.design, 4096, args.per_host, "kill")
    delay = commit_delay(units, args.design, 4096, args.per_host)
    write_figures(args.json_path, {"4096 ranks: store ops / rank / step": round(got["ops"], 2),
                                   **({"a healthy commit's delay ms": round(1e3 * delay, 2)} if delay else {}),
                                   "segments / rank / step": round(got["segments"], 1),
                                   "a process gone, all know s": round(kill[1], 2),
                                   "regroup s": round(regroup(units, args.design, 4096, args.per_host, followers), 2),
                                   "hosts": hosts})
    if measured:
        print(f"\nthe model ({DESIGNS[args.design]}) against the namespace runs, what live recovery adds per rank "
              "and step:\n")
        print(overlap_table(units, measured, followers, args.design))


if __name__ == "__main__":
    main()
