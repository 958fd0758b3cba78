"""The suite as `make test` and `make test-quick` run it: stages of tests that run side by side, grouped
by what their tests wait on, then one report of the slowest tests and the total.

    python -m tests.suite                 # everything (make test)
    python -m tests.suite --quick         # the unit tier and one smoke test per capability, in one stage
                                          # (make test-quick)
    python -m tests.suite -- -x -k shm    # anything after -- goes to every pytest call

A stage is one pytest call with pytest-xdist.
    compute   tests whose time is CPU work (imports, training steps): one worker per core and two
              more (their launches also wait); a test file stays on one worker, so a module fixture
              that launches once serves all of the file's checks.
    waiting   tests marked `waiting` (tests/conftest.py): their time is heartbeats, grace periods,
              shaped links and SLURM's daemons, and they check that something happened within a
              bound, or measure a time. Three at a time, each dealt on its own, never beside the
              compute stage, so a busy machine does not stretch the times they check.
The report comes from each stage's JUnit XML: pytest's own --durations sees one stage only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SLOWEST = 15


@dataclass
class Stage:
    name: str
    marks: str  # pytest -m expression
    workers: int
    dist: str  # how pytest-xdist deals the tests: loadfile (a file to one worker), loadgroup (a test each)
    paths: list[str]  # where to collect: each worker imports every test module there (~17 s of CPU for all)


def files_marking(marker: str) -> list[str]:
    """The test files that mark a test or the module with `marker`: the only ones a stage of it collects."""
    pattern = re.compile(rf"pytest\.mark\.{marker}\b")
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                  if pattern.search(path.read_text()))


def stages(quick: bool, cores: int) -> list[Stage]:
    if quick:  # one stage: a smoke test is never a waiting one (CONTRIBUTING.md)
        return [Stage("quick", "unit or smoke", cores, "loadfile", ["tests/unit", *files_marking("smoke")])]
    # compute: two workers more than the cores, as its e2e tests wait on rendezvous, polls and sockets for a
    # good part of their time (with one more, 2 cores stayed idle a fifth of the stage: 1331 s of CPU in 838 s).
    # waiting: three at a time, each test dealt on its own (a file whose tests share a
    # module fixture keeps them together with pytest.mark.xdist_group). Six side by side failed 9 of 28 when
    # every worker started as a fresh interpreter (3 s stall timeouts fired while a rank still imported
    # torch); workers now start as forks in milliseconds (launch/warm_start.py), launchers as forks of a
    # warm launcher (tests/conftest.py), and a rank in its start-up that uses the CPU is not stalled. Four at
    # a time stretched the planted straggler (26.9 ms for 20 +- 30 %) and a fresh start in a namespace.
    return [Stage("compute", "not waiting", cores + 2, "loadfile", ["tests"]),
            Stage("waiting", "waiting", 3, "loadgroup", files_marking("waiting"))]


def run_stage(stage: Stage, extra: list[str], report: Path) -> tuple[int, float]:
    command = [sys.executable, "-m", "pytest", "-q", "-m", stage.marks, "-n", str(stage.workers),
               "--dist", stage.dist, f"--junitxml={report}", *extra, *stage.paths]
    print(f"\n== stage {stage.name}: {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    code = subprocess.call(command, cwd=ROOT, env=writing_bytecode(os.environ))
    return code, time.monotonic() - started


def writing_bytecode(environ) -> dict:
    """`environ` without PYTHONDONTWRITEBYTECODE (which some shells and containers set): without caches, each
    of the suite's ~1000 processes compiles phalanx's modules again, and each pytest worker rewrites the
    assertions of every test module and of torch's big `*_test.py` files again (make test-quick: 61 s -> 46 s).
    The caches are git-ignored __pycache__ folders."""
    return {name: value for name, value in environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


class Case(NamedTuple):
    """One test case of a stage's JUnit XML (tests/conftest.py records cpu, worker and ended)."""
    seconds: float
    name: str  # the test id
    outcome: str  # passed, failure, error or skipped
    cpu: float  # of the test's process and the processes it started
    worker: str
    ended: float  # time.time() when it ended


class StageResult(NamedTuple):
    stage: Stage
    code: int
    seconds: float
    cases: list[Case]
    began: float  # time.time() when the stage started


def read_report(path: Path) -> list[Case]:
    if not path.exists():
        return []
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        found = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases.append(Case(float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}", outcome,
                          float(found.get("cpu_s", 0.0)), found.get("worker", "?"), float(found.get("ended_at", 0.0))))
    return cases


def summarize(results: list[StageResult], total: float) -> str:
    lines = [f"\n== the slowest {SLOWEST} tests of all stages"]
    cases = sorted((case for result in results for case in result.cases), reverse=True)
    lines += [f"{case.seconds:8.1f}s  {case.name}" for case in cases[:SLOWEST]]
    # On a machine of few cores the suite's wall time is its CPU over the cores: these are what to make cheaper.
    lines.append(f"== the {SLOWEST} tests that used the most CPU (the test's process and the processes it started)")
    lines += [f"{case.cpu:8.1f}s  {case.name}" for case in sorted(cases, key=lambda c: c.cpu, reverse=True)[:SLOWEST]]
    # A stage lasts as long as its busiest worker: a long file dealt out late shows here as one worker ending last.
    lines.append("== when each worker ended its last test (seconds into its stage)")
    for result in results:
        last: dict[str, Case] = {}
        for case in sorted((case for case in result.cases if case.ended), key=lambda case: case.ended):
            last[case.worker] = case
        lines += [f"{result.stage.name:>16} {worker:>6}: {case.ended - result.began:6.0f}s  {case.name}"
                  for worker, case in sorted(last.items(), key=lambda item: item[1].ended)]
    lines.append("== stages")
    for result in results:
        counts = {outcome: sum(1 for case in result.cases if case.outcome == outcome)
                  for outcome in ("passed", "failure", "error", "skipped")}
        lines.append(f"{result.stage.name:>16}: {result.seconds:6.0f}s wall, {result.stage.workers} workers, "
                     f"exit {result.code}, " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n)
                     + f"; {sum(case.cpu for case in result.cases):.0f}s of CPU")
    lines.append(f"== total: {total:.0f}s wall for {len(cases)} tests ({sum(case.seconds for case in cases):.0f}s "
                 f"of test time, {sum(case.cpu for case in cases):.0f}s of CPU)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the unit tier and one smoke test per capability")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="workers of the compute stage")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest call")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results = []
    # The JUnit XML of each stage stays in pytest's (git-ignored) cache folder, to be read after the run.
    folder = ROOT / ".pytest_cache" / "suite"
    folder.mkdir(parents=True, exist_ok=True)
    for stage in stages(args.quick, args.cores):
        report = folder / f"{stage.name}.xml"
        report.unlink(missing_ok=True)
        began = time.time()
        code, seconds = run_stage(stage, args.pytest_args, report)
        results.append(StageResult(stage, code, seconds, read_report(report), began))
    print(summarize(results, time.monotonic() - started), flush=True)
    # 5: pytest found no test to run in a stage (a -k that selects only the other stage's tests)
    return 0 if all(result.code in (0, 5) for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
