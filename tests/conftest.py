"""What every test of phalanx shares: where the checkout is, how to run a command, a clean environment,
and the three tiers of the suite.

One folder per tier; every test is marked with its folder's tier (pytest_collection_modifyitems):

    tests/unit/   `unit`   one process: no child process (tests/unit/conftest.py fails a test that
                           starts one), no process group beyond an in-process one; the tier runs in
                           seconds.
    tests/ranks/  `ranks`  library code in several processes: ranks started by phalanx.testing.run_ranks
                           or phalanx.spawn, forked children, DataLoader workers, a script killed
                           mid-save. Every test states its world size in its docstring.
    tests/e2e/    `e2e`    phalanx as a user runs it: `phalanx run` and torchrun, `phalanx demo` and
                           `phalanx bench`, the README, the examples, exact resume after a kill. Also
                           marked `slow` (the suite's older name for these tests).

    pytest tests/unit            # the unit tier alone
    pytest -m "not e2e"          # unit and ranks
    pytest -m "not trainers"     # all but phalanx inside Accelerate and Lightning (the trainers extra)
    pytest                       # everything, one test after another
    python -m tests.suite        # everything, as `make test` runs it: stages side by side (tests/suite.py)

Across the tiers, a test file may carry a marker of its own: `trainers` (tests/e2e/test_accelerate.py,
test_lightning.py; they skip without the trainers extra, except under CI), `torch_suite`; and a test may be
marked `waiting` (it checks a bound on time: tests/suite.py runs these alone), `latency` (its time is SLURM's
daemons waiting, with no bound on time checked: run beside the compute stage) or
`smoke` (the one test of its capability that `make test-quick` runs). CONTRIBUTING.md says which to run when.

tests/helpers/ holds modules that test files of several tiers import, tests/e2e/jobs/ the scripts the
e2e tests start. `tests` is a package: test modules import `tests.conftest` and `tests.helpers.*` by
name, and so do the ranks run_ranks starts (they import the test module to find their function).
This file is not a test module: it runs nothing at import.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the checkout: README.md, examples/, phalanx/
TESTS = ROOT / "tests"
TIERS = ("unit", "ranks", "e2e")
LONGEST = ("e2e/test_bench.py", "e2e/test_stop.py", "e2e/test_examples.py")  # minutes each: dealt out first


# -- the tiers -------------------------------------------------------------------------------------

def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (and e2e tests `slow` too); a test module outside the tiers is an error."""
    for item in items:
        try:
            parts = item.path.relative_to(TESTS).parts
        except ValueError:  # not one of ours
            continue
        tier = parts[0] if len(parts) > 1 else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.path}: a test module belongs in one of tests/{{{','.join(TIERS)}}}/ "
                                    f"(see tests/conftest.py)")
        item.add_marker(tier)
        if tier == "e2e":
            item.add_marker("slow")
    # The longest files first (e2e, then ranks, then the many short unit tests): under pytest-xdist a long
    # file dealt out last would leave the other workers idle while it runs alone (tests/suite.py). The waiting
    # stage deals its tests one by one: those marked `waiting(seconds=N)`, the longest first (~10 s less).
    items.sort(key=lambda item: (-_seconds(item),
                                 -TIERS.index(_tier(item)) if _tier(item) in TIERS else 0,
                                 item.path.relative_to(TESTS).as_posix() not in LONGEST if _tier(item) else True))


def _seconds(item) -> float:
    """How long a `waiting` test takes, as its mark says (`pytest.mark.waiting(seconds=20)`); 0 if unsaid."""
    mark = item.get_closest_marker("waiting")
    return float(mark.kwargs.get("seconds", 0)) if mark is not None else 0.0


class _GroupInNodeId:
    """pytest-xdist 3.8's `--dist loadgroup` deals tests out by the xdist_group it appends to each node id, which
    it writes to `item._nodeid`; pytest 9.2 reads node ids from `item._id` instead, so the group never reached
    the scheduler: every test went to any worker, and a module fixture meant to run once for its group ran
    on each (test_steplog.py's run three times, test_slurm.py's clusters). Last of the collection hooks, after
    xdist's: the id xdist wrote becomes the item's."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        from _pytest.nodeid import NodeId

        for item in items:
            grouped = item.__dict__.get("_nodeid")
            if isinstance(grouped, str) and grouped != item.nodeid and hasattr(item, "_id"):
                item._id = NodeId.parse(grouped)


def _tier(item) -> str | None:
    try:
        parts = item.path.relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else None


# -- what each test costs in CPU ------------------------------------------------------------------
# The suite is bound by the machine's cores, not by waiting: tests/suite.py reports the tests that use
# the most CPU. Counted: this process, the children it waited for (a launch and everything under it),
# and the ranks run_ranks forked (multiprocessing's fork server reaps them: its children's CPU). Not
# counted: the commands the warm servers fork, shared by the workers (below); the report's busy cores are.

def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    try:
        from multiprocessing import forkserver

        server = forkserver._forkserver._forkserver_pid
        if server:
            with open(f"/proc/{server}/stat") as handle:  # utime, stime, cutime, cstime: fields 14-17
                fields = handle.read().rsplit(")", 1)[1].split()
            total += sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (ImportError, AttributeError, OSError, ValueError):
        pass
    return total


_CPU_AT_SETUP = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_SETUP] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _CPU_AT_SETUP in item.stash:  # into the JUnit XML with the teardown's report
        item.user_properties.append(("cpu_s", round(_cpu_seconds() - item.stash[_CPU_AT_SETUP], 2)))
        # which worker ran it and when it ended: tests/suite.py reports each worker's last test (the stage's tail)
        item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))
        item.user_properties.append(("ended_at", round(time.time(), 1)))


# -- a clean environment ---------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _restore_environment():
    """After each test, os.environ and the working directory are as they were before it: a variable a
    test sets (or a folder it moves to) never reaches the next test."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    yield
    for name in [name for name in os.environ if name not in saved_env]:
        del os.environ[name]
    for name, value in saved_env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    os.chdir(saved_cwd)


@pytest.fixture
def log_records():
    """What phalanx's logger says during the test (it may not propagate to the root logger)."""
    import phalanx

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, level = Keep(), phalanx.logger.level
    phalanx.logger.addHandler(handler)
    phalanx.logger.setLevel(logging.INFO)
    yield records
    phalanx.logger.removeHandler(handler)
    phalanx.logger.setLevel(level)


def warnings_of(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


# -- warm launches -------------------------------------------------------------------------------
# The `phalanx` commands the e2e tests start (clean_env, run_command) run in forks of a server that imported
# torch once (`phalanx warm`, phalanx/warm.py): ~4 s of CPU less a launch, the largest cost of the suite. One
# server per set of the variables read while torch is imported (OMP_NUM_THREADS set or not, say), shared by
# the pytest-xdist workers of a run: pytest's main process makes the run's folder (pytest_configure), the
# first worker to need a set starts its server there under a lock, and the main process stops them all at the
# end (pytest_unconfigure). A server costs ~6 s of CPU: one per worker and set was ~14 servers a stage.
# A command in a network namespace runs forked inside it (the server, root's, enters it); one whose context
# differs otherwise (a cgroup, SLURM, a pid namespace) runs fresh and says why, as does every command under
# PHALANX_TEST_FRESH=1 (CONTRIBUTING.md).

WARM_FOLDER = "PHALANX_TEST_WARM_FOLDER"  # the run's servers: a folder per set, with its socket, log and pid
WARM_IDLE_EXIT = 600  # seconds without a command before a server ends (another starts on the next command)
# Variables of pytest's own: no command reads them, and a server serves every worker.
_PYTEST_VARIABLES = ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                     "PYTEST_XDIST_TESTRUNUID")
_OWN_WARM_FOLDER = pytest.StashKey[str]()
_started_servers: list[subprocess.Popen] = []  # the servers this process started (reaped at the end)


def pytest_configure(config):
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):  # a pytest-xdist worker, --dist loadgroup
        config.pluginmanager.register(_GroupInNodeId(), "phalanx-group-in-node-id")
    if WARM_FOLDER not in os.environ and not hasattr(config, "workerinput"):  # pytest's main process
        import tempfile

        os.environ[WARM_FOLDER] = tempfile.mkdtemp(prefix="phalanx-warm-")  # its workers inherit it
        config.stash[_OWN_WARM_FOLDER] = os.environ[WARM_FOLDER]


def pytest_unconfigure(config):
    folder = config.stash.get(_OWN_WARM_FOLDER, None)
    if folder is not None:
        stop_warm_servers(folder)
        os.environ.pop(WARM_FOLDER, None)


def with_warm_launcher(env: dict) -> dict:
    """`env` for a `phalanx` command, with PHALANX_WARM_LAUNCHER naming the server for its import-time
    variables (started on first use); unchanged under PHALANX_TEST_FRESH=1 or when the server did not start."""
    for name in _PYTEST_VARIABLES:
        env.pop(name, None)
    if os.environ.get("PHALANX_TEST_FRESH") == "1":
        return env
    from phalanx.launch.worker_entry import read_at_import  # the standard library only: no torch here

    key = tuple((name, env[name]) for name in read_at_import(env, {}))
    socket_path = _warm_server(dict(key))
    if socket_path:
        env["PHALANX_WARM_LAUNCHER"] = socket_path
    return env


def _run_folder() -> str:
    """The folder of this test run's warm servers, removed at its end (pytest_unconfigure)."""
    folder = os.environ.get(WARM_FOLDER)
    if folder is None:  # not under pytest (a script that imports this file): a folder of this process's own
        import atexit
        import tempfile

        folder = os.environ[WARM_FOLDER] = tempfile.mkdtemp(prefix="phalanx-warm-")
        atexit.register(stop_warm_servers, folder)
    return folder


def run_temp_dir() -> str:
    """TMPDIR for commands that may be SIGKILLed before they remove their temporary files: a folder of the
    run's, removed at its end. One for the whole run, not one per test: TMPDIR is read while torch is
    imported, so each value would need a warm server of its own (~6 s of CPU to start)."""
    path = os.path.join(_run_folder(), "tmp")
    os.makedirs(path, exist_ok=True)
    return path


def _warm_server(env: dict) -> str | None:
    """The socket of the run's server for `env` (the variables read at import), started if none runs."""
    import fcntl
    import hashlib
    import json
    import sys

    folder = _run_folder()
    server_dir = os.path.join(folder, hashlib.sha1(json.dumps(sorted(env.items())).encode()).hexdigest()[:16])
    socket_path = os.path.join(server_dir, "launcher.sock")
    with open(f"{server_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker starts it; the others wait for its socket
        if _running_server(server_dir) and os.path.exists(socket_path):
            return socket_path
        os.makedirs(server_dir, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)  # a server that ended idle
        with open(os.path.join(server_dir, "server.log"), "a") as log:
            # --idle-exit: a server whose run ended without pytest_unconfigure ends on its own.
            server = subprocess.Popen([sys.executable, "-m", "phalanx", "warm", "--socket", socket_path,
                                       "--idle-exit", str(WARM_IDLE_EXIT)],
                                      env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        _started_servers.append(server)
        with open(os.path.join(server_dir, "pid"), "w") as handle:
            handle.write(str(server.pid))
        deadline = time.monotonic() + 120
        while not os.path.exists(socket_path) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return socket_path if os.path.exists(socket_path) else None


def _running_server(server_dir: str) -> int | None:
    """The pid of the server in `server_dir` while it runs (not ended, not a zombie), else None."""
    try:
        with open(os.path.join(server_dir, "pid")) as handle:
            pid = int(handle.read())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def stop_warm_servers(folder: str) -> None:
    """End the servers of `folder` (each ends once the commands it runs have ended), then remove it."""
    import glob

    pids = [pid for pid in map(_running_server, glob.glob(os.path.join(folder, "*", ""))) if pid]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    for server in _started_servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=max(0.1, deadline - time.monotonic()))
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    for pid in filter(_alive, pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    """phalanx.diagnose.recorder.pid_alive, without its import of torch into pytest's main process."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# -- running a command -----------------------------------------------------------------------------

def checkout_on_pythonpath(*first: str | Path) -> str:
    """PYTHONPATH for a child process: `first`, then this checkout (so `import phalanx` and
    `import tests.helpers...` find it), then whatever PYTHONPATH this process had."""
    return os.pathsep.join(filter(None, [*map(str, first), str(ROOT), os.environ.get("PYTHONPATH")]))


def run_in_session(command: list, cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    """Run `command` in a session of its own (so that a timeout stops a launcher and every worker it started,
    by the process group): (exit code, stdout+stderr); fail with the output on a timeout."""
    process = subprocess.Popen([str(c) for c in command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{command} did not finish within {timeout}s; output:\n{output}")
    return process.returncode, output


def run_command(command: list, cwd: Path, *, env: dict | None = None, timeout: float = 60,
                warm: bool = True) -> str:
    """Run `command`; return stdout+stderr; fail with the output on a non-zero exit or a timeout.

    Used by the tests that drive phalanx as a user does: `phalanx run`, `phalanx demo`, the examples
    and the README's commands. `warm=False`: the command runs no `phalanx` command, itself or in a script
    it starts, so no warm launcher is named, nor started for its import-time variables (~6 s of CPU).
    """
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": checkout_on_pythonpath(), **(env or {})}
    if warm:
        environment = with_warm_launcher(environment)
    returncode, output = run_in_session(command, cwd, environment, timeout)
    assert returncode == 0, f"{command} exited with {returncode}; output:\n{output}"
    return output
