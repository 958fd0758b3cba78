"""The scale model against the namespace loss runs (control_plane.py --kill / --cut): per lost host, the naming and
the regroup as the runs measured them (medians) and as the model gives them from the units of the same hour; set by
set, and pooled over several sets, each its own units and runs.

    PYTHONPATH=. python benchmarks/control_plane/model_agreement.py --sets UNITS:LOSSES [UNITS:LOSSES ...]
        [--design tree] [--json FILE]

On this machine's 2 cores one set's figures are ms-scale timings of processes sharing the cores: a set's medians move
by 10-20 points from the next hour's, on the units' side (a job's groups) and on the runs' (a named loss 13-20 ms).
The pooled agreement is the mean of the sets' model figures against the mean of their runs' medians: the model's
error with that noise averaged out, where one set's shows it too. control_plane_model.py prints one set's
comparison beside its scale table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.control_plane.model_formulas import F_DEFAULT, Units, named, regroup_parts

FIGURES = ("named", "regroup", "summary")  # the loss named; rank 0's regroup; the regroup with models and loaders


def loss_rows(units: Units, measured: list[dict], followers: float, design: str) -> list[dict]:
    """Per (hosts, ranks a host, how lost) of the runs in `measured`: the runs' medians and the model's figures,
    {"key", "runs", "named": (measured, model), "regroup": ..., "summary": ..., "spans": rank 0's parts measured,
    "parts": the model's, "first_out": (the runs' first victim out, the unit's) or None}."""
    losses: dict[tuple, list[dict]] = {}
    for row in measured:
        if row["kind"] == "loss" and row.get("detected") is not None:
            losses.setdefault((row["hosts"], row["per_host"], row["how"]), []).append(row)
    found = []
    for (hosts, per_host, how), rows in losses.items():
        ranks = hosts * per_host
        if design == "today":  # the runs read it from rank 0's line, and rank 0 (the slow rank) looks after its pause
            model_named = rows[0].get("pause", 0.15) + named(units, "today", ranks, per_host, how)[0]
        else:  # the runs read the watcher's verdict, the first rank to name it
            model_named = named(units, design, ranks, per_host, how, here=True)[0]
        # a kill strikes right after the victim's step, rank 0 (the slow rank, which decides) in its pause: it enters
        # the agreement last (a cut is named WINDOW later, at any point of rank 0's step)
        enter, agree, main, control, end = regroup_parts(units, design, ranks, per_host, how, here=True,
                                                         decider_last=how == "kill" and design != "today")
        parts = [enter + agree, main, control, end]  # rank 0 decides once the last survivor entered (E)
        spans = [_rank0_span(rows, part) for part in ("agree", "main", "control")]
        spans.append(statistics.median(_meeting_end(r) for r in rows))
        exited = [seconds for seconds in (_first_exit(r, per_host) for r in rows) if seconds is not None]
        teardown = units.end(per_host, here=True)[1]
        first_out = (statistics.median(exited), teardown) if how == "kill" and exited and teardown is not None \
            and design != "today" else None
        found.append({"key": (hosts, per_host, how), "runs": len(rows),
                      "named": (statistics.median(r["detected"] for r in rows), model_named),
                      "regroup": (statistics.median(r["regroup"] for r in rows), sum(parts)),
                      "summary": (statistics.median(r.get("regroup_summary") or r["regroup"] for r in rows),
                                  sum(parts) + followers),
                      "spans": spans, "parts": parts, "first_out": first_out})
    return found


def agreement(model: float, measured: float) -> str:
    if abs(measured) < 1e-9:
        return "-"
    return f"{100 * (model / measured - 1):+.0f} %"


def _first_exit(row: dict, per_host: int) -> float | None:
    """Seconds from a kill to the first of its host's victims exiting (its sockets closed just before: it names the
    loss), None if not known: runs from before each victim's exit was kept have only the last one's, which is the
    first where a host has one victim."""
    each = (row.get("victim") or {}).get("exited_each")
    if each:
        return each[0]
    return row.get("exited") if per_host == 1 else None


def _meeting_end(row: dict) -> float:
    """Seconds from rank 0's control group made to its meeting's end (the formation, the new watch), nan if not
    timed."""
    rank0 = (row.get("parts") or {}).get("rank0", {})
    return rank0["meet"][1] - rank0["control"][1] if "meet" in rank0 and "control" in rank0 else float("nan")


def _rank0_span(rows: list[dict], part: str) -> float:
    """The median seconds rank 0 spent in `part` of the regroup (control_plane.py's `parts`), nan if not timed."""
    timed = [(r.get("parts") or {}).get("rank0", {}).get(part) for r in rows]
    spans = [span[1] - span[0] for span in timed if span]
    return statistics.median(spans) if spans else float("nan")


def followers_seconds(measured: list[dict]) -> float:
    """The models' and loaders' part of a regroup, from the loss runs (the summary's regroup less the line's)."""
    parts = [r["regroup_summary"] - r["regroup"] for r in measured
             if r["kind"] == "loss" and r.get("regroup_summary") is not None and r.get("regroup") is not None]
    return statistics.median(parts) if parts else F_DEFAULT


def set_rows(units_path: Path, losses_path: Path, design: str) -> list[dict]:
    """loss_rows() of one set: its units file and its loss runs' file."""
    measured = [r for r in json.loads(losses_path.read_text()) if r["kind"] == "loss"]
    return loss_rows(Units(json.loads(units_path.read_text())), measured, followers_seconds(measured), design)


def pooled(sets: list[list[dict]]) -> list[dict]:
    """Per key found in any set, per figure: (the mean of the sets' measured medians, the mean of their model
    figures), and how many sets had it."""
    keys = list(dict.fromkeys(row["key"] for rows in sets for row in rows))
    found = []
    for key in keys:
        rows = [row for rows in sets for row in rows if row["key"] == key]
        found.append({"key": key, "sets": len(rows),
                      **{figure: tuple(statistics.mean(row[figure][side] for row in rows) for side in (0, 1))
                         for figure in FIGURES}})
    return found


def table(sets: list[list[dict]], names: list[str]) -> str:
    lines = ["| hosts x ranks | lost | set | named: measured / model (agreement) | rank 0's regroup | with models and "
             "loaders |", "| --- | --- | --- | --- | --- | --- |"]
    for row in pooled(sets):
        for name, rows in [*zip(names, sets), (f"pooled ({row['sets']} sets)", [row])]:
            for one in (r for r in rows if r["key"] == row["key"]):
                hosts, per_host, how = one["key"]
                cells = [f"{one[f][0]:.3f} / {one[f][1]:.3f} ({agreement(one[f][1], one[f][0])})" for f in FIGURES]
                lines.append(f"| {hosts} x {per_host} | {how} | {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", required=True, metavar="UNITS:LOSSES",
                        help="a units file (control_plane_units.py's, with watch_end.py's and group_units.py's "
                             "--into) and the loss runs of the same hour (control_plane.py --json), ':' between")
    parser.add_argument("--design", default="tree", help="the design the runs ran (control_plane_model.py's "
                        "--design; default tree, phalanx now)")
    from phalanx.tools.bench_compare import add_json_flag, write_figures

    add_json_flag(parser)
    args = parser.parse_args()
    pairs = []
    for given in args.sets:
        units, _, losses = given.partition(":")
        if not losses:
            parser.error(f"--sets {given!r}: expected UNITS:LOSSES, two files with ':' between")
        pairs.append((Path(units), Path(losses)))
    sets = [set_rows(units, losses, args.design) for units, losses in pairs]
    print(table(sets, [losses.stem for _, losses in pairs]))
    write_figures(args.json_path, {f"{h} x {p} {how}, {figure}: model / runs - 1, %":
                                   round(100 * (row[figure][1] / row[figure][0] - 1), 1)
                                   for row in pooled(sets) for (h, p, how) in [row["key"]] for figure in FIGURES})


if __name__ == "__main__":
    main()
