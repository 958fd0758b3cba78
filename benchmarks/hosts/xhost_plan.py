"""The cost model past this machine, and its predictions against what benchmarks/hosts/xhost_bench.py measured.

    PYTHONPATH=. python benchmarks/hosts/xhost_plan.py --calibration n2.json [--measured n2.json n3.json]
        [--chart docs/img/xhost-model.png]

Prints a markdown table of one all-reduce of S bytes (no overlap), flat ring against hierarchical, for
N = 2..64 hosts of L ranks at 10 and 100 Gbit/s links: the shared-memory constants come from the
calibration run (this machine), the links' from the arguments (a datacenter LAN: 90 % of the line
rate as TCP goodput, 25 us per ring step). With `--measured`, draws predicted against measured step
times of every (model, variant, hosts) in those runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from phalanx.tools.bench_compare import add_json_flag, write_figures
from phalanx.tools.cost_model import calibrate, plan


def table(cal, size: float, local: int, rates_gbit: list[float], alpha: float, goodput: float) -> str:
    lines = ["| hosts N | " + " | ".join(f"{r:g} Gbit/s flat ms | hier ms | hier/flat" for r in rates_gbit) + " |",
             "| ---: | " + " | ".join("---: | ---: | ---:" for _ in rates_gbit) + " |"]
    for hosts in (2, 4, 8, 16, 32, 64):
        cells = []
        for rate in rates_gbit:
            link = replace(cal, net_alpha=alpha, link_bytes_per_s=rate * 1e9 / 8 * goodput)
            times = plan(size, hosts, local, link)
            cells.append(f"{times['flat'] * 1e3:.1f} | {times['hier'] * 1e3:.1f} | {times['hier'] / times['flat']:.2f}")
        lines.append(f"| {hosts} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    top = 0.0
    for run in runs:
        hosts = run["result"]["hosts"]
        for model, rows in run["summary"].items():
            for variant, row in rows.items():
                if "predicted_ms" not in row:
                    continue
                marker = {"flat": "s", "hier": "o"}[variant]
                color = {2: "tab:blue", 3: "tab:orange", 4: "tab:green"}.get(hosts, "tab:gray")
                ax.scatter(row["step_ms"], row["predicted_ms"], marker=marker, color=color)
                ax.annotate(f"{model} {variant} N={hosts}", (row["step_ms"], row["predicted_ms"]), fontsize=7,
                            xytext=(4, -8), textcoords="offset points")
                top = max(top, row["step_ms"], row["predicted_ms"])
    top *= 1.1
    ax.plot([0, top], [0, top], color="black", linewidth=0.8, label="predicted = measured")
    ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="gray", alpha=0.15, label="within 15 %")
    ax.set_xlabel("measured step (ms, median of the slowest rank)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("Cost model, calibrated at N=2 (2 ranks per host)")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", required=True, help="an xhost_bench.py JSON whose microbenchmarks calibrate")
    parser.add_argument("--measured", nargs="*", default=[])
    parser.add_argument("--chart", default=None)
    parser.add_argument("--size-mb", type=float, default=100.0, help="gradient bytes all-reduced (default 100 MB)")
    parser.add_argument("--local", type=int, default=8, help="ranks per host (default 8)")
    parser.add_argument("--alpha-us", type=float, default=25.0, help="seconds per ring step on the LAN, in us")
    parser.add_argument("--goodput", type=float, default=0.9, help="TCP goodput as a share of the line rate")
    add_json_flag(parser)
    args = parser.parse_args()
    with open(args.calibration) as handle:
        source = json.load(handle)["result"]
    cal = calibrate(source["calibration"], source["hosts"])
    print(f"shared memory (measured here): {cal.shm_bytes_per_s / 1e9:.2f} GB/s + {cal.shm_alpha * 1e3:.2f} ms; "
          f"links: {args.alpha_us:g} us per ring step, {args.goodput:.0%} of the line rate")
    print(f"\nOne all-reduce of {args.size_mb:g} MB, {args.local} ranks per host:\n")
    print(table(cal, args.size_mb * 1e6, args.local, [10, 100], args.alpha_us * 1e-6, args.goodput))
    figures = {}
    for rate in (10, 100):
        link = replace(cal, net_alpha=args.alpha_us * 1e-6, link_bytes_per_s=rate * 1e9 / 8 * args.goodput)
        for hosts in (2, 64):
            times = plan(args.size_mb * 1e6, hosts, args.local, link)
            figures[f"{rate} Gbit/s hier/flat @{hosts}"] = round(times["hier"] / times["flat"], 2)
    write_figures(args.json_path, figures)
    if args.chart and args.measured:
        runs = []
        for path in args.measured:
            with open(path) as handle:
                runs.append(json.load(handle))
        chart(runs, args.chart)
        print(f"\nchart: {args.chart}")


if __name__ == "__main__":
    main()
