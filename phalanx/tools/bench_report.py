"""What `phalanx bench` reports: step-time summaries, ratios, the text table, JSON and a PNG chart.

Pure functions over the result dictionary that the benchmark ranks build (see bench.py), so the
report can be produced wherever the results end up (the launching parent, or rank 0).
"""

from __future__ import annotations

import json
import os
import platform
import socket
from datetime import datetime, timezone
from pathlib import Path

import torch

from .bench_compare import paired_ratio, summarize  # noqa: F401 (summarize: part of the report's API)

SCHEMA = "phalanx-bench/1"
VARIANT_LABELS = {"torch": "torch DDP", "phalanx": "phalanx DDP", "phalanx-gloo": "phalanx (Gloo)",
                  "compute": "compute-only"}
# numerator, denominator: phalanx against torch's C++ reducer, and against the no-communication floor
RATIOS = (("phalanx", "torch"), ("phalanx-gloo", "torch"), ("phalanx", "compute"), ("torch", "compute"))


def ratios(variants: dict) -> dict:
    """Each available ratio of median step times, e.g. {"phalanx/torch": 0.97}."""
    return {f"{top}/{bottom}": variants[top]["median_ms"] / variants[bottom]["median_ms"]
            for top, bottom in RATIOS if top in variants and bottom in variants}


def paired_ratios(variants: dict) -> dict:
    """Each ratio taken per round (block medians of the same round), then the median over rounds."""
    return {f"{top}/{bottom}": paired_ratio(variants[top]["block_medians_ms"], variants[bottom]["block_medians_ms"])
            for top, bottom in RATIOS if top in variants and bottom in variants}


def _millions(count: int) -> str:
    return f"{count / 1e6:.2f}M"


def _grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    # first column (the name) left-aligned, numbers right-aligned
    lines = ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                       for i, (cell, width) in enumerate(zip(row, widths)))
             for row in [header, ["-" * w for w in widths], *rows]]
    return "\n".join(lines)


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def format_table(results: dict) -> str:
    """The human-readable summary printed at the end of a run."""
    config = results["config"]
    variants = config["variants"]
    title = (f"phalanx bench: {config['nproc']} process(es) x {config['threads']} thread(s), {config['backend']} on "
             f"{config['device']}; {config['blocks']} interleaved blocks x {config['steps']} timed steps "
             f"(+{config['warmup']} warm-up) per variant; median step time in ms, slowest rank per step")
    environment = results.get("environment", {})
    if environment.get("load_average_1min_at_end") is not None:
        load = environment["load_average_1min_at_end"]
        title += (f"\nhost: {environment['cpu_count']} cores, load average {load:.1f} at the end "
                  "(a load above the core count means other work shared the cores)")
    header = ["model", "params", "tensors", "batch"] + [VARIANT_LABELS[v] + " ms" for v in variants]
    ratio_names = [f"{a}/{b}" for a, b in RATIOS if a in variants and b in variants]
    header += ratio_names
    rows = []
    for model in results["models"]:
        row = [model["name"], _millions(model["params"]), str(model["tensors"]), str(model["batch_per_rank"])]
        row += [f"{model['variants'][v]['median_ms']:.2f}" for v in variants]
        row += [f"{model['ratios'][name]:.3f}" for name in ratio_names]
        rows.append(row)
    parts = [title, _grid(header, rows)]
    parts.append(_format_allreduce(results.get("allreduce", {})))
    return "\n\n".join(p for p in parts if p)


def _format_allreduce(section: dict) -> str:
    status = section.get("status")
    if status == "not installed":
        return ("all-reduce bandwidth: the shared-memory transport is not installed "
                "(phalanx.tools.bench_allreduce is missing)")
    if status != "ok":
        return ""
    rows = section["rows"]
    if not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)):
        return f"all-reduce bandwidth:\n{rows!r}"
    header = []
    for row in rows:
        header += [key for key in row if key not in header]
    body = [[_number(row.get(key, "")) for key in header] for row in rows]
    return "all-reduce bandwidth:\n" + _grid(header, body)


def write_json(results: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def write_chart(results: dict, path: Path) -> Path | None:
    """A bar chart of step times relative to compute-only (or torch DDP); None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display on a training host
    import matplotlib.pyplot as plt

    variants = results["config"]["variants"]
    baseline = "compute" if "compute" in variants else variants[0]
    models = results["models"]
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(2.2 + 1.8 * len(models), 4))
    for i, variant in enumerate(variants):
        xs = [m + (i - (len(variants) - 1) / 2) * width for m in range(len(models))]
        times = [model["variants"][variant]["median_ms"] for model in models]
        heights = [t / model["variants"][baseline]["median_ms"] for t, model in zip(times, models)]
        bars = ax.bar(xs, heights, width, label=VARIANT_LABELS[variant])
        for bar, t in zip(bars, times):
            ax.annotate(f"{t:.1f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(models)), [model["name"] for model in models])
    ax.set_ylabel(f"median step time / {VARIANT_LABELS[baseline]}")
    config = results["config"]
    ax.set_title(f"{config['nproc']} x {config['threads']} thread(s), {config['backend']}, {config['device']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def environment(device: torch.device) -> dict:
    """Where and when a benchmark ran: date, host, versions, CPU, threads, load (and the GPU on a GPU run)."""
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "threads_per_process": torch.get_num_threads(),
            # Other work on the host inflates every variant; a high load says to take the run with salt.
            "load_average_1min_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
