"""The `phalanx` command's launcher, readied before anything imports torch: given the allocator its workers get,
torch imported once, then forked into the node's fork server before any thread starts (cli.py, `phalanx run`).

A process's allocator is chosen when it starts, so the launcher executes itself again with it preloaded, which
costs milliseconds then; the server it forks, and every worker forked from that, share its import of torch.
"""

from __future__ import annotations

import os
import sys
import threading

from .server import WorkerServer, WorkerStart


def prepare_launcher(argv: list[str]) -> WorkerServer | WorkerStart | None:
    """For the `phalanx` command, before anything imports torch: preload the workers' allocator into this
    process (by executing it again, once), import torch, fork the server. None where it cannot fork (the
    launcher then starts a server as a fresh process, or its workers fresh)."""
    _preload_here()
    import torch  # the launcher's own import, which the server and every worker share

    if not hasattr(os, "fork") or threading.active_count() > 1 or _spawn_asked(argv):
        return None
    # What a training loop imports after init() and would otherwise pay for in every worker, inside its
    # first step: torch imports torch._dynamo (and sympy) at the first optimizer.zero_grad() or step.
    import torch._dynamo  # noqa: F401

    return WorkerServer.fork_here()


def _spawn_asked(argv: list[str]) -> bool:
    """`--start-method spawn` among the launcher's arguments (read before argparse, which imports torch's
    launcher modules; a script's own argument of that spelling only costs the fork server its preload)."""
    for at, token in enumerate(argv):
        if token in ("--start-method=spawn", "--start_method=spawn"):
            return True
        if token in ("--start-method", "--start_method") and argv[at + 1:at + 2] == ["spawn"]:
            return True
    return False


_REEXECUTED = "PHALANX_LAUNCHER_PRELOADED"


def _preload_here() -> None:
    """Give this process the allocator its workers will get, so that the workers forked from it have it: a
    process's allocator is chosen when it starts, so start this one again with LD_PRELOAD set."""
    from ... import allocator
    from ...errors import WorldConfigError

    if os.environ.get(_REEXECUTED) or not sys.platform.startswith("linux"):
        return
    try:
        preload = allocator.worker_preload()
    except WorldConfigError:  # a bad PHALANX_ALLOCATOR: the launcher reports it, as it always did
        return
    if preload is None:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.environ["LD_PRELOAD"] = preload
    os.environ[_REEXECUTED] = "1"
    os.execv(sys.executable, sys.orig_argv)
