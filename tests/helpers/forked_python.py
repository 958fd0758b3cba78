"""`python script.py ARGS` for tests of what a script does, not of how a process starts: the script runs in a
process forked from this test process's fork server (phalanx.spawn), which imported torch, torch._dynamo and
phalanx once, instead of in a new interpreter that imports them again (~6.5 s of CPU a run: torch, and
torch._dynamo at the first optimizer torch builds).

The script runs as `__main__` the way `phalanx run` runs a forked worker (launch/worker_entry.py): its own
argv, sys.path[0] and working folder, exactly the environment given (no world variables), and it ends as the
interpreter ends it (non-daemon threads joined, atexit handlers run, files flushed, Python's exit code). Its
stdout and stderr come back apart, as from subprocess.run(capture_output=True).

`start_python` is the same as subprocess.Popen: the script runs on while the test goes on (pid, poll, wait,
kill, returncode), its stdout and stderr in one log file.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from phalanx.launch import worker_entry

# spawn()'s own choice of how to start a process (our fork server, another allocator's spawn): private, but a
# process the test goes on beside needs exactly that choice, and spawn() waits for its processes.
from phalanx.launch.spawn import _context, _preloaded, spawn


def run_python(args: list, *, cwd, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True), forked.
    `args`: a script and its arguments, or "-m", a module and its arguments."""
    args = [str(arg) for arg in args]
    with tempfile.TemporaryDirectory(prefix="forked-python-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        [code] = spawn(_as_main, 1, (args, str(cwd), dict(env), str(out), str(err)), init=False, timeout=timeout,
                       start_method="forkserver")
        return subprocess.CompletedProcess([sys.executable, *args], code, out.read_text(), err.read_text())


def start_python(args: list, *, cwd, env: dict, log: Path) -> Forked:
    """subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=log, stderr=STDOUT), forked."""
    args = [str(arg) for arg in args]
    with _preloaded(env) as preload:  # the fork server starts with the allocator the script would get
        context = _context("forkserver", preload)
        process = context.Process(target=_run_on, args=(args, str(cwd), dict(env), str(log), str(log)),
                                  name=f"python {args[0]}", daemon=False)
        process.start()
    return Forked(process, args)


class Forked:
    """A script start_python started: what subprocess.Popen gives of it. Its exit code is Python's for the
    script, or minus the signal that killed it."""

    def __init__(self, process, args: list):
        self._process, self.args, self.pid = process, [sys.executable, *args], process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def _as_main(_rank: int, args: list, cwd: str, env: dict, out: str, err: str) -> int:
    _become_fresh(cwd, env, out, err)
    try:
        worker_entry.main(args)
        code = 0
    except SystemExit as exc:
        code = worker_entry.exit_status(exc.code)
    # multiprocessing's own exit function (an atexit handler) waits for the queue that carries this return
    # value: it runs after the return, as the process ends, not with the script's handlers.
    atexit.unregister(multiprocessing.util._exit_function)
    worker_entry.finish_as_python_does()
    return code


def _run_on(args: list, cwd: str, env: dict, out: str, err: str) -> None:
    """start_python's process: the script, then the end a forked worker of `phalanx run` has (never returns)."""
    _become_fresh(cwd, env, out, err)
    atexit.unregister(multiprocessing.util._exit_function)  # it would join the server's other children
    worker_entry.run_forked(args)


def _become_fresh(cwd: str, env: dict, out: str, err: str) -> None:
    """This fork as a new `python` started with `env` in `cwd` would be, its stdout and stderr in `out` and `err`
    (one file, written in order, where they are the same)."""
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read as torch was imported, in the server: applied as a fresh process would
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    opened = {}
    for stream, fd, path in ((sys.stdout, 1, out), (sys.stderr, 2, err)):
        stream.flush()
        if path not in opened:
            opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened[path], fd)
    for descriptor in opened.values():
        os.close(descriptor)
    os.chdir(cwd)
