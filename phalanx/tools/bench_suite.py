"""`phalanx bench --suite cpu`: every benchmark scenario (benchmarks/scenarios.py) in turn, into one summary.

Each scenario runs as its own process from the checkout's root (the scenarios are its benchmarks/ scripts), one
thread per rank, under a timeout; one that fails or times out is reported with the tail of its output and the
suite goes on; one whose machine is missing (root, network namespaces, a GPU, torchft) is reported skipped, with
the reason. The summary is a JSON and a markdown table (scenario, key figures, wall time, status) under
bench-results/.

    phalanx bench --suite cpu                                  # or: make bench-all
    phalanx bench --suite cpu --only exchange.floor,host.overhead
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import BenchConfigError, explain

SUITES = ("cpu", "gpu", "all")
# What a scenario may need beyond a CPU and Python; where one is missing the scenario is skipped with this reason.
NEEDS = {
    "root": "root (network namespaces, tc)",
    "netns": "`ip netns` (iproute2)",
    "tc": "`tc` (iproute2) to shape links",
    "cuda": "a CUDA GPU and a CUDA build of torch",
    "torchft": "torchft beside phalanx (benchmarks/live_recovery/torchft_compare.py's docstring)",
}
SCHEMA = "phalanx-bench-suite/1"
TAIL_CHARS = 3000  # of a failed scenario's output, kept in the summary
GRACE_S = 15.0  # after the timeout's SIGTERM (namespace scripts tear their hosts down), before SIGKILL


@dataclass
class Outcome:
    name: str
    status: str  # "ok", "failed", "timed out", "skipped"
    wall_s: float = 0.0
    figures: dict = field(default_factory=dict)
    reason: str = ""  # why skipped, or how it failed
    tail: str = ""  # the end of its output, when it failed
    command: str = ""
    finished: str = ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx bench --suite", description="Run every benchmark scenario of a "
                                     "suite at a size for a 2-core machine, and write one JSON and one markdown "
                                     "summary.")
    parser.add_argument("--suite", choices=SUITES, required=True,
                        help="cpu: every scenario without a GPU; gpu: those that need one; all")
    parser.add_argument("--only", default=None, metavar="NAME[,NAME]",
                        help="run these scenarios only (of the suite); the summary keeps the others' last results")
    parser.add_argument("--list", action="store_true", help="list the suite's scenarios and commands; run nothing")
    parser.add_argument("--out", default="bench-results/suite", help="the summary's path without its suffix: "
                        "PATH.json, PATH.md, each scenario's output under PATH/ (default bench-results/suite)")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply every scenario's timeout by this (a slower machine; default 1)")
    return parser


def registry(root: Path):
    """The checkout's benchmarks/scenarios.py (the scenarios are the checkout's scripts, so is their list)."""
    path = root / "benchmarks" / "scenarios.py"
    if not path.exists():
        raise BenchConfigError(explain(
            "the benchmark suite runs from a checkout of phalanx", seen=f"no {path}",
            expected="the checkout's root as the current folder (benchmarks/, tests/)", fix="cd into the checkout."))
    spec = importlib.util.spec_from_file_location("benchmarks.scenarios", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def in_suite(scenarios, suite: str) -> list:
    """The scenarios of `suite` ("cpu": those that need no GPU; "gpu"; "all"), in the registry's order."""
    return [s for s in scenarios if suite == "all" or ("cuda" in s.needs) == (suite == "gpu")]


def select(scenarios, suite: str, only: str | None) -> list:
    """The scenarios to run; raises BenchConfigError naming the known ones for a name not in the suite."""
    every = {s.name for s in scenarios}
    scenarios = in_suite(scenarios, suite)
    if only is None:
        return scenarios
    names = [name.strip() for name in only.split(",") if name.strip()]
    known = {s.name for s in scenarios}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        elsewhere = [name for name in unknown if name in every]
        raise BenchConfigError(explain(
            f"--only names no scenario of the {suite} suite", seen=", ".join(unknown) or "an empty list",
            expected=f"a comma-separated subset of {', '.join(sorted(known))}",
            fix=(f"{', '.join(elsewhere)} belong(s) to another suite: --suite all. " if elsewhere else "")
            + "`phalanx bench --suite all --list` lists every scenario."))
    return [s for s in scenarios if s.name in names]


def missing(scenario, have=None) -> str:
    """Why `scenario` cannot run here ("" when it can). `have(need) -> bool` checks one need (tests pass their own)."""
    have = have or _have
    lacking = [need for need in scenario.needs if not have(need)]
    return "; ".join(NEEDS[need] for need in lacking)


def _have(need: str) -> bool:
    if need == "root":
        return hasattr(os, "geteuid") and os.geteuid() == 0
    if need in ("netns", "tc"):
        return shutil.which("ip" if need == "netns" else "tc") is not None
    if need == "torchft":
        return importlib.util.find_spec("torchft") is not None
    if need == "cuda":
        import torch

        return torch.cuda.is_available()
    raise ValueError(f"unknown need {need!r}: one of {sorted(NEEDS)}")


def scenario_env(root: Path) -> dict:
    """The environment of a scenario: the checkout on the path, one intra-op thread per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_"))}
    python_path = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env.update(PYTHONPATH=os.pathsep.join(python_path), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return env


class ScenarioProcess:
    """A scenario's process, in a session of its own so that a timeout stops its children too."""

    def __init__(self, command: list[str], cwd: Path, env: dict, log):
        self.popen = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def signal_all(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass


def run_scenario(scenario, root: Path, logs: Path, timeout_s: float, python: str = sys.executable, have=None,
                 start=ScenarioProcess) -> Outcome:
    """Run one scenario to its end (or its timeout); never raises for the scenario's own failure.

    `start(command, cwd, env, log)` starts it (a ScenarioProcess; the unit tests pass a stand-in)."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    reason = missing(scenario, have)
    if reason:
        return Outcome(scenario.name, "skipped", reason=f"needs {reason}", finished=started)
    logs.mkdir(parents=True, exist_ok=True)
    json_path = logs / f"{scenario.name}.json"
    json_path.unlink(missing_ok=True)
    command = [python, *scenario.command(str(json_path))]
    shown = " ".join(command[1:])
    log_path = logs / f"{scenario.name}.log"
    began = time.monotonic()
    with log_path.open("w") as log:
        process = start(command, root, scenario_env(root), log)
        timed_out = _wait(process, timeout_s)
    wall = time.monotonic() - began
    tail = log_path.read_text(errors="replace")[-TAIL_CHARS:]
    finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if timed_out:
        return Outcome(scenario.name, "timed out", wall, reason=f"no end after {timeout_s:.0f} s", tail=tail,
                       command=shown, finished=finished)
    if process.returncode != 0:
        return Outcome(scenario.name, "failed", wall, reason=f"exit code {process.returncode}", tail=tail,
                       command=shown, finished=finished)
    try:
        figures = read_figures(json_path)
    except (OSError, ValueError) as exc:
        return Outcome(scenario.name, "failed", wall, reason=f"no figures in {json_path}: {exc}", tail=tail,
                       command=shown, finished=finished)
    return Outcome(scenario.name, "ok", wall, figures=figures, command=shown, finished=finished)


def _wait(process, timeout_s: float) -> bool:
    """Wait for `process`; at the timeout, SIGTERM its whole session, then SIGKILL after GRACE_S. True if timed out."""
    try:
        process.wait(timeout_s)
        return False
    except subprocess.TimeoutExpired:
        pass
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 30.0)):
        process.signal_all(sig)
        try:
            process.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    return True


def read_figures(path: Path) -> dict:
    """The `figures` a scenario wrote (bench_compare.write_figures, or a list of such records)."""
    data = json.loads(path.read_text())
    records = data if isinstance(data, list) else [data]
    figures = {}
    for record in records:
        if isinstance(record, dict) and isinstance(record.get("figures"), dict):
            figures.update(record["figures"])
    if not figures:
        raise ValueError("the file holds no 'figures' mapping")
    return figures


# -- the summary ------------------------------------------------------------------------------------

def _figure(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def format_markdown(summary: dict) -> str:
    """The summary as a markdown table: scenario, key figures, wall time, status."""
    lines = [f"# Benchmark suite `{summary['suite']}`", "",
             f"{summary['date']}, {summary['host']}: {summary['cpu_count']} cores, Python {summary['python']}, load "
             f"average {_figure(summary.get('load_average_1min'))} at the end; {summary['ran']} scenario(s) ran in "
             f"{summary['wall_s'] / 60:.1f} min ({summary['counts']}).", "",
             "| scenario | key figures | wall s | status |", "| --- | --- | ---: | --- |"]
    for row in summary["scenarios"]:
        figures = "; ".join(f"{k} {_figure(v)}" for k, v in row["figures"].items()) or "-"
        status = row["status"] if not row["reason"] else f"{row['status']}: {row['reason']}"
        wall = f"{row['wall_s']:.0f}" if row["status"] != "skipped" else "-"
        lines.append(f"| `{row['name']}` | {figures.replace('|', '/')} | {wall} | {status.replace('|', '/')} |")
    failed = [row for row in summary["scenarios"] if row["status"] in ("failed", "timed out")]
    for row in failed:
        lines += ["", f"## `{row['name']}`: {row['status']}", "", f"`{row['command']}`", "", "```",
                  row["tail"].rstrip()[-1500:], "```"]
    return "\n".join(lines) + "\n"


def write_summary(outcomes: list[Outcome], out: Path, suite: str, wall_s: float, order: list[str],
                  keep: dict | None = None) -> dict:
    """Write PATH.json and PATH.md, a row per name of `order` run now or (`keep`, by name) before."""
    rows = {o.name: vars(o) for o in outcomes}
    merged = [rows.get(name) or (keep or {}).get(name) for name in order]
    merged = [row for row in merged if row is not None]
    counts = {}
    for row in merged:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    summary = {"schema": SCHEMA, "suite": suite, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
               # other work on the machine stretches every scenario: a load above the core count says it ran
               "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
               "ran": sum(o.status != "skipped" for o in outcomes), "wall_s": wall_s,
               "counts": ", ".join(f"{n} {s}" for s, n in counts.items()),
               "scenarios": merged}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    out.with_suffix(".md").write_text(format_markdown(summary))
    return summary


def _earlier(out: Path) -> dict:
    try:
        return {row["name"]: row for row in json.loads(out.with_suffix(".json").read_text())["scenarios"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def run_suite(scenarios: list, root: Path, out: Path, suite: str, timeout_scale: float = 1.0, say=print,
              keep: dict | None = None, order: list[str] | None = None, start=ScenarioProcess,
              listed: list[Outcome] = ()) -> dict:
    """Run `scenarios` in order with a progress line each (which, elapsed, ETA); write and return the summary
    (its rows in `order`, with `keep`'s earlier results of those not run now, and `listed`: rows not to run)."""
    order = order or [s.name for s in scenarios]
    began = time.monotonic()
    outcomes: list[Outcome] = list(listed)
    expected_done = 0.0
    for index, scenario in enumerate(scenarios):
        elapsed = time.monotonic() - began
        left = sum(s.expect_s for s in scenarios[index:])
        pace = elapsed / expected_done if expected_done > 0 else 1.0  # this machine against the 2-core VM
        say(f"[suite {index + 1}/{len(scenarios)}] {scenario.name}: {scenario.about} (elapsed {_clock(elapsed)}, "
            f"ETA {_clock(left * pace)})")
        outcome = run_scenario(scenario, root, out, scenario.timeout_s * timeout_scale, start=start)
        outcomes.append(outcome)
        if outcome.status != "skipped":
            expected_done += scenario.expect_s
        figures = "; ".join(f"{k} {_figure(v)}" for k, v in list(outcome.figures.items())[:4])
        detail = f"{outcome.wall_s:.0f} s" + (f": {figures}" if figures else "") + \
            (f" ({outcome.reason})" if outcome.reason else "")
        say(f"    {outcome.status}, {detail}")
        if outcome.status in ("failed", "timed out"):
            say("    " + "\n    ".join(outcome.tail.rstrip().splitlines()[-8:]))
        write_summary(outcomes, out, suite, time.monotonic() - began, order, keep)  # a stopped suite keeps what ran
    return write_summary(outcomes, out, suite, time.monotonic() - began, order, keep)


def main(argv: list[str]) -> int:
    """`phalanx bench --suite SUITE [--only NAMES] [--list] [--out PATH]`; returns the exit status (1 if any failed)."""
    root = Path.cwd()
    try:
        args = build_parser().parse_args(argv)
        known = registry(root).SCENARIOS
        scenarios = select(known, args.suite, args.only)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    except BenchConfigError as exc:
        print(f"phalanx bench --suite: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.list:
        for s in scenarios:
            needs = f"  [needs {', '.join(s.needs)}]" if s.needs else ""
            print(f"{s.name:<28} ~{s.expect_s:>4.0f} s  python {' '.join(s.argv)}{needs}")
        return 0
    out = Path(args.out)
    keep = _earlier(out) if args.only else None
    print(f"[suite] {args.suite}: {len(scenarios)} scenario(s), ~{sum(s.expect_s for s in scenarios) / 60:.0f} min "
          f"on the 2-core VM; outputs under {out}/", flush=True)
    # The CPU suite lists the GPU scenarios too, skipped: what a GPU machine would add (`--suite gpu` there).
    listed = [Outcome(s.name, "skipped", reason="a GPU scenario: `phalanx bench --suite gpu` on a machine with one")
              for s in in_suite(known, "gpu")] if args.suite == "cpu" and args.only is None else []
    summary = run_suite(scenarios, root, out, args.suite, args.timeout_scale, say=lambda line: print(line, flush=True),
                        keep=keep, order=[s.name for s in in_suite(known, "all" if listed else args.suite)],
                        listed=listed)
    print(f"\n{format_markdown(summary)}\nsummary: {out.with_suffix('.md')}, {out.with_suffix('.json')}", flush=True)
    return 1 if any(row["status"] in ("failed", "timed out") for row in summary["scenarios"]) else 0
