"""The suite as `make test` and `make test-quick` run it: stages of tests that run side by side, grouped
by what their tests wait on, then one report of the slowest tests and the total.

    python -m tests.suite                 # everything (make test)
    python -m tests.suite --quick         # the unit tier and one smoke test per capability, in one stage
                                          # (make test-quick)
    python -m tests.suite -- -x -k shm    # anything after -- goes to every pytest call

A stage is one pytest call with pytest-xdist; the stages of a phase run at once, the phases one after another.
  phase 1
    compute   tests whose time is CPU work (imports, training steps): one worker per core and two
              more (their launches also wait); a test file stays on one worker, so a module fixture
              that launches once serves all of the file's checks.
    torch-suite  beside compute: torch's own DDP tests (test_torch_ddp_suite.py), in one process of its own,
              the only one that imports torch's test harness (~4 s of CPU each worker paid to collect them).
    latency   beside compute: tests marked `latency` (tests/conftest.py), whose time is another
              program's waiting (SLURM's daemons scheduling and requeueing jobs) and which check no
              bound on time. Their output is printed when they end.
  phase 2
    waiting   tests marked `waiting`: their time is heartbeats, grace periods, shaped links, and they
              check that something happened within a bound, or measure a time. Three at a time, each
              dealt on its own, alone on the machine, so that load does not stretch the times they check.
The report comes from each stage's JUnit XML: pytest's own --durations sees one stage only. It also says
how busy the machine's cores were in each phase (/proc/stat): on 2 cores the suite is bound by its CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tests.conftest import WARM_FOLDER, stop_warm_servers

ROOT = Path(__file__).resolve().parents[1]
SLOWEST = 15
TORCH_SUITE = "tests/e2e/test_torch_ddp_suite.py"


@dataclass
class Stage:
    name: str
    marks: str  # pytest -m expression
    workers: int
    dist: str  # how pytest-xdist deals the tests: loadfile (a file to one worker), loadgroup (a test each); no
    #           with 0 workers: the tests run in the pytest process itself
    paths: list[str]  # where to collect: each worker imports every test module there (~17 s of CPU for all)
    quiet: bool = False  # beside another stage: its output goes to a file, printed when it ends
    ignore: tuple[str, ...] = ()  # files under `paths` that another stage runs


def files_marking(marker: str) -> list[str]:
    """The test files that mark a test or the module with `marker`: the only ones a stage of it collects."""
    pattern = re.compile(rf"pytest\.mark\.{marker}\b")
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                  if pattern.search(path.read_text()))


def phases(quick: bool, cores: int) -> list[list[Stage]]:
    if quick:  # one stage: a smoke test is never a waiting one (CONTRIBUTING.md)
        return [[Stage("quick", "unit or smoke", cores, "loadfile", ["tests/unit", *files_marking("smoke")])]]
    # compute: two workers more than the cores, as its e2e tests wait on rendezvous, polls and sockets for a
    # good part of their time (with one more, 2 cores stayed idle a fifth of the stage: 1331 s of CPU in 838 s).
    # latency: SLURM's tests spent ~360 s of the waiting stage's ~900 s of test time on SLURM's own intervals
    # (a requeue alone is two minutes) with ~20 s of CPU of their own; one worker per xdist_group, so that
    # each requeue test gets its own cluster.
    # waiting: three at a time, each test dealt on its own (a file whose tests share a
    # module fixture keeps them together with pytest.mark.xdist_group). Six side by side failed 9 of 28 when
    # every worker started as a fresh interpreter (3 s stall timeouts fired while a rank still imported
    # torch); workers now start as forks in milliseconds (launch/forkserver/), launchers as forks of a
    # warm launcher (tests/conftest.py), and a rank in its start-up that uses the CPU is not stalled. Four at
    # a time stretched the planted straggler (26.9 ms for 20 +- 30 %) and a fresh start in a namespace.
    # torch-suite: torch's own DDP tests, whose harness (torch.testing._internal, torch._dynamo) costs ~4 s of CPU
    # to import; every worker that collected the file paid it. One process of its own, beside compute, pays it once.
    return [[Stage("compute", "not waiting and not latency", cores + 2, "loadfile", ["tests"], ignore=(TORCH_SUITE,)),
             Stage("torch-suite", "not waiting and not latency", 0, "no", [TORCH_SUITE], quiet=True),
             Stage("latency", "latency", 3, "loadgroup", files_marking("latency"), quiet=True)],
            [Stage("waiting", "waiting", 3, "loadgroup", files_marking("waiting"))]]


def start_stage(stage: Stage, extra: list[str], report: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pytest", "-q", "-m", stage.marks, "-n", str(stage.workers),
               "--dist", stage.dist, f"--junitxml={report}", *extra, *stage.paths,
               *(f"--ignore={path}" for path in stage.ignore)]
    print(f"\n== stage {stage.name}: {' '.join(command[1:])}" + (f" (output: {log})" if stage.quiet else ""),
          flush=True)
    if not stage.quiet:
        return subprocess.Popen(command, cwd=ROOT, env=writing_bytecode(os.environ))
    with open(log, "w") as output:
        return subprocess.Popen(command, cwd=ROOT, env=writing_bytecode(os.environ), stdout=output,
                                stderr=subprocess.STDOUT)


def busy_cores() -> tuple[float, float]:
    """(seconds the machine's cores were busy, seconds they were idle) since boot, from /proc/stat's cpu line;
    (0, 0) where there is no /proc/stat."""
    try:
        fields = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / ticks, idle / ticks  # guest time is already in user


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


class PhaseLoad(NamedTuple):
    names: str  # its stages
    seconds: float
    busy: float  # of the machine's cores, in seconds
    idle: float


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


def summarize(results: list[StageResult], loads: list[PhaseLoad], total: float) -> str:
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
    lines.append("== how busy the machine's cores were (all processes, /proc/stat)")
    for load in loads:
        share = load.busy / (load.busy + load.idle) if load.busy + load.idle else 0.0
        lines.append(f"{load.names:>16}: {load.seconds:6.0f}s wall, cores busy {share:4.0%} "
                     f"({load.busy:.0f}s of CPU)")
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
    results, loads = [], []
    # The JUnit XML of each stage stays in pytest's (git-ignored) cache folder, to be read after the run.
    folder = ROOT / ".pytest_cache" / "suite"
    folder.mkdir(parents=True, exist_ok=True)
    # One folder of warm launchers for every stage (tests/conftest.py): a server one stage started serves the
    # next stage's commands too, instead of each stage importing torch again into servers of its own (~6 s of
    # CPU each, and the first command of a waiting test would wait for it). Ended and removed at the end.
    scratch = scratch_in_memory()
    own_warm_folder = None
    if WARM_FOLDER not in os.environ:
        own_warm_folder = os.environ[WARM_FOLDER] = tempfile.mkdtemp(prefix="phalanx-warm-")
    try:
        run_phases(args, folder, results, loads)
    finally:
        if own_warm_folder is not None:
            stop_warm_servers(own_warm_folder)
            os.environ.pop(WARM_FOLDER, None)
        if scratch is not None:
            os.environ.pop("TMPDIR", None)
            shutil.rmtree(scratch, ignore_errors=True)
    print(summarize(results, loads, time.monotonic() - started), flush=True)
    # 5: pytest found no test to run in a stage (a -k that selects only the other stage's tests)
    return 0 if all(result.code in (0, 5) for result in results) else 1


def scratch_in_memory() -> str | None:
    """A folder on /dev/shm (memory) made every stage's TMPDIR, unless TMPDIR is set already: pytest's tmp_path,
    tempfile's folders and what the tests' processes write there (checkpoints, logs, ~1.3 GB over the suite, each
    save fsynced) never wait on the machine's disk, which other machines' work shares. None (the default place)
    where /dev/shm is not a writable folder."""
    if os.environ.get("TMPDIR") or not os.access("/dev/shm", os.W_OK):
        return None
    folder = tempfile.mkdtemp(prefix="phalanx-suite-", dir="/dev/shm")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # tempfile reads TMPDIR again
    return folder


def run_phases(args, folder: Path, results: list, loads: list) -> None:
    """Each phase's stages side by side, one phase after another; appends to `results` and `loads`."""
    for phase in phases(args.quick, args.cores):
        began, busy_before, start = time.time(), busy_cores(), time.monotonic()
        running = []
        for stage in phase:
            if not stage.paths:  # no file marks its tests (pytest would collect every file to find none)
                continue
            report, log = folder / f"{stage.name}.xml", folder / f"{stage.name}.log"
            report.unlink(missing_ok=True)
            running.append((stage, report, log, start_stage(stage, args.pytest_args, report, log)))
        while running:
            for entry in [entry for entry in running if entry[3].poll() is not None]:
                running.remove(entry)
                stage, report, log, process = entry
                if stage.quiet:
                    print(f"\n== stage {stage.name}'s output\n{log.read_text(errors='replace')}", flush=True)
                results.append(StageResult(stage, process.returncode, time.monotonic() - start,
                                           read_report(report), began))
            time.sleep(0.2)
        busy_after = busy_cores()
        loads.append(PhaseLoad(" + ".join(stage.name for stage in phase), time.monotonic() - start,
                               busy_after[0] - busy_before[0], busy_after[1] - busy_before[1]))


if __name__ == "__main__":
    sys.exit(main())
