"""`phalanx report RUN_DIR`: a StepLog's steps.jsonl drawn into one PNG: loss, throughput, step time across ranks.

    phalanx report runs/my-job                  # finds runs/my-job/**/steps.jsonl, writes runs/my-job/report.png
    phalanx report runs/my-job --out curves.png

The third panel is the spread of the ranks' busy time per step (min to max, the median drawn), with
the wall step time above it: a wide band is a straggler, and the slowest rank is named where it
stayed the same for most of the run. matplotlib is in the `examples` extra.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from .outputs import JSONL_NAME, jsonl_files, read_records


def find_jsonl(run_dir: Path) -> Path | None:
    """The newest records file of RUN_DIR (steps.jsonl, or the last one started beside it: steps.2.jsonl, ...),
    else the newest below RUN_DIR."""
    direct = jsonl_files(run_dir)
    if direct:
        return direct[-1]
    found = sorted((path for pattern in (JSONL_NAME, "steps.*.jsonl") for path in run_dir.rglob(pattern)),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def draw(records: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figure, (loss_axis, speed_axis, time_axis) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss_axis.plot(steps, [r["loss"] if r["loss"] is not None else float("nan") for r in records], color="C0")
    loss_axis.set_ylabel("loss (all samples, all ranks)")
    loss_axis.set_title(title)
    speed_axis.plot(steps, [r["samples_per_s"] or float("nan") for r in records], color="C1", label="samples/s")
    speed_axis.set_ylabel("samples/s")
    if any(r.get("tokens_per_s") for r in records):
        tokens_axis = speed_axis.twinx()
        tokens_axis.plot(steps, [r["tokens_per_s"] or float("nan") for r in records], color="C2", label="tokens/s")
        tokens_axis.set_ylabel("tokens/s")
    ms = [1e3 * r["step_time"] for r in records]
    low, mid, high = ([1e3 * r[k] for r in records] for k in ("step_time_min", "step_time_median", "step_time_max"))
    time_axis.fill_between(steps, low, high, color="C3", alpha=0.25, label="busy time, min to max over ranks")
    time_axis.plot(steps, mid, color="C3", label="busy time, median rank")
    time_axis.plot(steps, ms, color="0.3", linestyle="--", linewidth=1, label="step (wall)")
    slowest, count = Counter(r["slowest_rank"] for r in records).most_common(1)[0]
    if records[0].get("world_size", 1) > 1:
        time_axis.set_title(f"slowest rank: {slowest} in {count} of {len(records)} records", fontsize=9)
    time_axis.set_ylabel("ms per step")
    time_axis.set_xlabel("step")
    time_axis.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phalanx report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the StepLog's log_dir, or a folder above it")
    parser.add_argument("--out", type=Path, default=None, help="the PNG to write (default RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    path = find_jsonl(args.run_dir)
    if path is None:
        print(f"phalanx report: no {JSONL_NAME} in or below {args.run_dir}; px.StepLog(log_dir) writes it there",
              file=sys.stderr)
        return 2
    records = [r for r in read_records(path) if isinstance(r.get("step"), int)]
    if not records:
        print(f"phalanx report: {path} holds no records yet", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401 - only whether it is there
    except ImportError:
        print("phalanx report: drawing needs matplotlib, which is not installed: pip install 'phalanx[examples]' "
              "(or pip install matplotlib)", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "report.png"
    draw(records, out, f"{path.parent.name}: {len(records)} records, steps {records[0]['step']}-{records[-1]['step']}")
    print(f"phalanx report: {out} ({len(records)} records from {path})")
    return 0
