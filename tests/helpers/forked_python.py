"""`python script.py ARGS` for tests of what a script does, not of how a process starts: the script runs in a
process forked from this test process's fork server (phalanx.spawn), which imported torch, torch._dynamo and
phalanx once, instead of in a new interpreter that imports them again (~6.5 s of CPU a run: torch, and
torch._dynamo at the first optimizer torch builds).

The script runs as `__main__` the way `phalanx run` runs a forked worker (launch/worker_entry.py): its own
argv, sys.path[0] and working folder, exactly the environment given (no world variables), and it ends as the
interpreter ends it (non-daemon threads joined, atexit handlers run, files flushed, Python's exit code). Its
stdout and stderr come back apart, as from subprocess.run(capture_output=True).
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from phalanx.launch.spawn import spawn


def run_python(args: list, *, cwd, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True), forked.
    `args`: a script and its arguments, or "-m", a module and its arguments."""
    args = [str(arg) for arg in args]
    with tempfile.TemporaryDirectory(prefix="forked-python-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        [code] = spawn(_as_main, 1, (args, str(cwd), dict(env), str(out), str(err)), init=False, timeout=timeout,
                       start_method="forkserver")
        return subprocess.CompletedProcess([sys.executable, *args], code, out.read_text(), err.read_text())


def _as_main(_rank: int, args: list, cwd: str, env: dict, out: str, err: str) -> int:
    from phalanx.launch import worker_entry

    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read as torch was imported, in the server: applied as a fresh process would
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for stream, fd, path in ((sys.stdout, 1, out), (sys.stderr, 2, err)):
        stream.flush()
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(cwd)
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
