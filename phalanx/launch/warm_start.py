"""Starting from a warm process: a `phalanx` command handed to a warm launcher (`phalanx warm`, phalanx/warm.py).

A command forked from a server that imported torch once starts in milliseconds, not seconds of CPU. It is handed
over (`hand_over`: its arguments, environment and streams sent, signals passed on, the exit status returned) only
where nothing it would inherit differs (`context`), else it runs here, fresh, as it would have. The workers of
`phalanx run`, forked from its launcher, are forkserver/'s; the `phalanx` command finds those names here too.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import sys
import time

# The `phalanx` command (cli.py) and `phalanx warm` (warm.py) import these from here, before torch loads.
from .forkserver.prepare import _REEXECUTED, _preload_here, prepare_launcher  # noqa: F401
from .forkserver.server import WorkerStart  # noqa: F401

WARM_LAUNCHER = "PHALANX_WARM_LAUNCHER"  # the socket of a `phalanx warm` server
forked_command = 0  # in a command forked from that server, its pid: it (and what it forks) hands over no further
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_WARM_REPLY_TIMEOUT = 30.0  # s for the server to fork or decline: past it the command runs fresh
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_NPROC",
           "RLIMIT_MEMLOCK", "RLIMIT_CPU", "RLIMIT_FSIZE")


def _tell(text: str) -> None:
    print(f"phalanx: {text}", file=sys.stderr, flush=True)


def context() -> dict:
    """What a process inherits besides its environment and that a fork from the server would not share with the
    command: compared item by item, and any difference runs the command fresh."""
    found = {"python": [sys.executable, sys.version],
             "phalanx": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             "flags": [sys.flags.optimize, sys.flags.isolated, sys.flags.no_site, sys.flags.no_user_site,
                       sys.flags.dont_write_bytecode, sys.flags.safe_path if hasattr(sys.flags, "safe_path")
                       else 0],
             "warnoptions": list(sys.warnoptions), "xoptions": sorted(map(str, sys._xoptions.items())),
             "user": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
             "limits": {name: list(resource.getrlimit(getattr(resource, name))) for name in _LIMITS
                        if hasattr(resource, name)},
             "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    umask = os.umask(0)
    os.umask(umask)
    found["umask"] = umask
    # The files themselves, not their paths: what a command in another mount namespace would load (a forked
    # one enters it, phalanx/warm.py, and runs the server's copy of them).
    found["code (Python, phalanx, torch files)"] = [_identity(path)
                                                    for path in (sys.executable, __file__, _torch_origin())]
    if hasattr(os, "sched_getaffinity"):
        found["cpus"] = sorted(os.sched_getaffinity(0))
    for kind in ("net", "uts", "mnt", "ipc", "pid", "user", "cgroup"):
        with contextlib.suppress(OSError):
            found[f"{kind} namespace"] = os.stat(f"/proc/self/ns/{kind}").st_ino
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as handle:
        found["cgroup"] = handle.read()
    return found


def _identity(path: str | None) -> list:
    try:
        status = os.stat(path)
        return [status.st_dev, status.st_ino]
    except (OSError, TypeError):
        return [path]


def _torch_origin() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("torch")  # found, not imported
    return spec.origin if spec else None


def hand_over(argv: list[str]) -> int | None:
    """In a `phalanx` command: run it in a process forked from the server named by PHALANX_WARM_LAUNCHER and
    return its exit code; None when the command should run here, fresh (no server, or a difference)."""
    path = os.environ.get(WARM_LAUNCHER)
    if not path or forked_command or os.environ.get(_REEXECUTED):  # (the last: a fresh one, started again)
        return None
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        channel.connect(path)
    except OSError as error:
        channel.close()
        _tell(f"the warm launcher {path} ({WARM_LAUNCHER}) cannot be reached ({error.strerror or error}): "
              "starting fresh")
        return None
    child, pending = None, []

    def forward(signum, _frame):
        if child is None:
            pending.append(signum)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    previous = {number: signal.signal(number, forward) for number in FORWARDED}
    request = {"argv": argv, "sys_argv": sys.argv, "orig_argv": getattr(sys, "orig_argv", sys.argv),
               "path0": sys.path[0] if sys.path else "", "env": dict(os.environ), "cwd": os.getcwd(),
               "unbuffered": bool(getattr(sys.stdout, "write_through", False)),  # python -u
               "context": context()}
    try:
        socket.send_fds(channel, [json.dumps(request).encode()], [0, 1, 2])
        channel.settimeout(_WARM_REPLY_TIMEOUT)
        reply = json.loads(channel.recv(4096) or b'{"cold": "the server closed the connection"}')
    except (OSError, ValueError) as error:
        reply = {"cold": f"the server did not answer ({error})"}
    if "cold" in reply:
        channel.close()
        for number, handler in previous.items():
            signal.signal(number, handler)
        _tell(f"starting fresh, not from the warm launcher {path}: {reply['cold']}")
        for number in pending:
            signal.raise_signal(number)
        return None
    child = reply["pid"]
    for number in pending:
        forward(number, None)
    channel.settimeout(None)
    message = channel.recv(4096)
    channel.close()
    if not message:  # the server died: the command's process runs on, its exit code is lost with the server
        from ..diagnose.recorder import pid_alive  # here: this module loads before torch, the recorder after

        while pid_alive(child):
            time.sleep(0.1)
        _tell(f"the warm launcher {path} ended before the command (pid {child}): its exit code is unknown (1)")
        return 1
    code = json.loads(message)["exit"]
    if code < 0:  # the command's process died of a signal: so does this one, as a fresh command would have
        for number in {*FORWARDED, -code} - {signal.SIGKILL, signal.SIGSTOP}:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        return 128 - code
    return code
