"""`phalanx warm`: a server that imported torch once and forks `phalanx` commands from it (PHALANX_WARM_LAUNCHER).

Every `phalanx run` imports torch before it does anything: 3-4 s of CPU a launch, most of what a short
job costs, and most of what a sweep or a test suite that launches hundreds of jobs costs. Start the
server once and point the variable at its socket:

    phalanx warm --socket /tmp/phalanx-warm.sock &
    export PHALANX_WARM_LAUNCHER=/tmp/phalanx-warm.sock

Each `phalanx` command then hands its arguments, environment, working directory and standard streams
to the server, which forks a process that runs the command as a fresh one would (the same code, the
same exit status, the run's own environment) while the command stays to pass on the signals it gets
and to exit as that process exits (a command killed with SIGKILL takes the process and all it started
along). A command runs fresh instead, and says why in one line, where a
forked one could differ from it: an environment that differs from the server's in what is read while
torch is imported (thread counts, the allocator, Python's settings), another Python or checkout of
phalanx, another cgroup (srun, a memory limit), other resource limits, CPU affinity, niceness, umask or
user, or other namespaces. A server run by root enters a command's network, host-name, IPC and mount
namespaces (`ip netns exec`, `unshare --net --uts`) in the forked process where the command sees the same
Python, phalanx and torch files; other namespaces (pid, user, cgroup) run it fresh. A server that cannot
be reached is skipped.
The command's side is launch/warm_start.py (`hand_over`).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time

from .launch import warm_start

MAX_REQUEST = 1 << 20  # bytes: argv, the environment and the process's context, as JSON
# The namespaces a forked process enters (setns) to stand where its command stands; mnt last, as entering it
# moves the process's root and working directory to the namespace's (the command's directory is set after).
ENTERED = ("net", "uts", "ipc", "mnt")


def serve(path: str, command, idle_exit: float = 0.0) -> None:
    """Import what every command imports, then fork one process per request, each running `command(argv)`
    (the `phalanx` command's main), until SIGTERM or SIGINT (or `idle_exit` seconds without a request or a
    running command)."""
    warm_start._preload_here()  # the allocator the commands' workers get: chosen when a process starts
    import torch._dynamo  # noqa: F401 - torch, what every command is spared, and what a training loop imports

    from .launch import run, worker_entry  # noqa: F401 - run: torch elastic's modules, argparse, the launcher's own

    server_env = worker_entry._environment_at_exec()
    own = warm_start.context()
    worker_entry.forget_phalanx_modules()
    gc.collect()
    gc.freeze()  # out of the collector's sight: a command's collections leave the shared pages alone

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chmod(path, 0o600)
    bound = os.stat(path).st_ino

    def unlink_ours():  # not a socket that a server started since bound at the same path
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == bound:
                os.unlink(path)

    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    quit_now = []

    def end(signum, _frame):
        if quit_now:  # asked twice: end now, the commands run on without their exit codes
            os._exit(128 + signum)
        quit_now.append(signum)

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, end)
    print(f"phalanx warm: serving on {path} (pid {os.getpid()}); set {warm_start.WARM_LAUNCHER}={path}",
          flush=True)
    commands: dict[int, socket.socket] = {}  # pid -> the connection of the command it runs for
    killed: set[int] = set()  # killed for a command that was killed: their connections wait for the exit alone
    idle_since = time.monotonic()
    try:
        while not quit_now or commands:  # asked to end: no new command, the running ones end as they would
            timeout = None if idle_exit <= 0 else max(0.0, idle_since + idle_exit - time.monotonic())
            if timeout == 0.0 and not commands:
                break
            if quit_now and listener.fileno() >= 0:
                listener.close()
                unlink_ours()
            accepting = [listener] if listener.fileno() >= 0 else []
            watched = [channel for pid, channel in commands.items() if pid not in killed]
            readable, _, _ = select.select([*accepting, wake_read, *watched], [], [],
                                           1.0 if quit_now else timeout)
            if wake_read in readable:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_read, 512):
                        pass
                _report_exits(commands)
                killed &= set(commands)
            for channel in [c for c in readable if c not in (listener, wake_read)]:
                pid = next((p for p, c in commands.items() if c is channel), None)
                with contextlib.suppress(OSError):
                    if channel.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        continue
                if pid is not None:  # the command was killed (SIGKILL: nothing passed on): so is its process
                    killed.add(pid)
                    _kill_tree(pid)
            if listener in readable:
                idle_since = time.monotonic()
                started = _take(listener, server_env, own, [listener, wake_read, wake_write, *commands.values()],
                                command)
                if started is not None:
                    commands[started[0]] = started[1]
            if commands:
                idle_since = time.monotonic()
    finally:
        unlink_ours()


def _take(listener: socket.socket, server_env: dict, own: dict, ours: list,
          command) -> tuple[int, socket.socket] | None:
    """Answer one command: fork its process, or tell it to run fresh. In the forked child this never returns."""
    channel, _ = listener.accept()
    fds: list[int] = []
    namespaces: dict[str, int] = {}
    try:
        channel.settimeout(5.0)
        peer, uid, _ = struct.unpack("3i", channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
        if uid != os.getuid():
            raise ValueError(f"user {uid}'s command, and this server runs as user {os.getuid()}")
        message, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 3)
        request = json.loads(message)
        env = _as_fresh(request["env"])
        entered = _to_enter(request["context"], own)
        reason = _difference(request["context"], own, entered) or _import_time_difference(env, server_env)
        if not reason:
            namespaces = _open_namespaces(peer, entered)
    except (OSError, ValueError, KeyError) as error:
        reason, request, env = f"the request could not be read ({error})", None, None
    if reason:
        print(json.dumps({"fresh": reason}), flush=True)
        for handle in fds:
            os.close(handle)
        with contextlib.suppress(OSError):
            channel.send(json.dumps({"cold": reason}).encode())
        channel.close()
        return None
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)  # before its pipe is closed: a signal must not write to a reused number
            for handle in ours:
                os.close(handle if isinstance(handle, int) else handle.detach())
            channel.close()
            _become_command(request, fds, env, command, namespaces)
        finally:
            os._exit(70)  # only if becoming the command failed before it ran
    for handle in [*fds, *namespaces.values()]:
        os.close(handle)
    print(json.dumps({"started": pid, "argv": request["argv"], "cwd": request["cwd"]}), flush=True)
    channel.settimeout(None)
    try:
        channel.send(json.dumps({"pid": pid}).encode())
    except OSError:  # the command is already gone: so is the reason to run it
        os.kill(pid, signal.SIGKILL)
    return pid, channel


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process it started, and theirs: what `kill -9` of the command's process tree
    (a node lost, in a test) ends when the command is fresh. Twice, for what was forking meanwhile."""
    from .diagnose.stacks import descendants

    for _ in range(2):
        for member in descendants(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGKILL)


def _as_fresh(env: dict) -> dict:
    """The environment a fresh command would run with once `phalanx` preloaded its workers' allocator into
    itself (warm_start._preload_here executes the command again with LD_PRELOAD set)."""
    from .allocator import worker_preload
    from .errors import WorldConfigError
    from .launch.warm_start import _REEXECUTED

    env = dict(env)
    if env.get(_REEXECUTED) or not sys.platform.startswith("linux"):
        return env
    try:
        preload = worker_preload(env)
    except WorldConfigError:
        return env  # the command reports it, as a fresh one does
    if preload is not None:
        env.update({"LD_PRELOAD": preload, _REEXECUTED: "1"})
    return env


def _to_enter(theirs: dict, own: dict) -> list[str]:
    """The command's namespaces, of those a forked process can enter, that are not the server's: entering
    needs CAP_SYS_ADMIN (root's server); none for another user's server, whose commands there run fresh."""
    if os.geteuid() != 0 or not hasattr(os, "fork"):
        return []
    return [kind for kind in ENTERED if theirs.get(f"{kind} namespace") != own.get(f"{kind} namespace")]


def _difference(theirs: dict, own: dict, entered: list[str] = ()) -> str | None:
    skipped = {f"{kind} namespace" for kind in entered}
    for key in sorted(set(theirs) | set(own)):
        if key not in skipped and theirs.get(key) != own.get(key):
            return f"its {key} differs from the server's"
    return None


def _open_namespaces(pid: int, kinds: list[str]) -> dict[str, int]:
    """The command's namespaces of `kinds`, opened while it waits for the answer (an OSError: fresh)."""
    opened: dict[str, int] = {}
    try:
        for kind in kinds:
            opened[kind] = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        for handle in opened.values():
            os.close(handle)
        raise
    return opened


def _enter(namespaces: dict[str, int]) -> None:
    """In the forked child (one thread, as setns into a mount namespace requires): join the command's namespaces."""
    if not namespaces:
        return
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    for kind in ENTERED:
        if kind in namespaces:
            if libc.setns(namespaces[kind], 0) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"could not enter the command's {kind} namespace: {os.strerror(error)}")
            os.close(namespaces[kind])
    platform._uname_cache = None  # the host name may be the namespace's own (unshare --uts)


# Read by the interpreter as it starts, and applied by _become_command as the command's own.
_APPLIED_IN_THE_FORK = {"PYTHONUNBUFFERED"}


def _import_time_difference(env: dict, server_env: dict) -> str | None:
    from .launch.worker_entry import read_at_import

    differ = [name for name in read_at_import(env, server_env) if name not in _APPLIED_IN_THE_FORK]
    if differ:
        return f"its environment differs from the server's in {', '.join(differ[:5])}" + (
            f" and {len(differ) - 5} more" if len(differ) > 5 else "") + " (read while torch is imported)"
    return None


def _report_exits(commands: dict[int, socket.socket]) -> None:
    """Reap every command's process that ended, tell its command the exit status, and log it with its CPU
    time (its own and its reaped children's: the launcher, its fork server and its workers)."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"ended": pid, "exit": code, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}),
              flush=True)
        channel = commands.pop(pid, None)
        if channel is not None:
            with contextlib.suppress(OSError):
                channel.send(json.dumps({"exit": code}).encode())
            channel.close()


def _become_command(request: dict, fds: list, env: dict, command, namespaces: dict[str, int]) -> None:
    """In the forked child: the process `python -m phalanx ARGV` would have been, until it exits."""
    import io

    signal.set_wakeup_fd(-1)
    for number in (signal.SIGCHLD, signal.SIGTERM, *warm_start.FORWARDED):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets it at start: KeyboardInterrupt
    os.setsid()  # out of the server's process group: what is sent to the server is not sent to the commands
    with contextlib.suppress(OSError, AttributeError):  # its name in top and `ps -o comm` (its command line is ours)
        import ctypes

        ctypes.CDLL(None).prctl(15, ("phalanx " + " ".join(request["argv"][:1]))[:15].encode())  # PR_SET_NAME
    for target, handle in enumerate(fds):
        os.dup2(handle, target)
        os.close(handle)
    try:
        _enter(namespaces)
    except OSError as error:  # after the streams: the command says why it failed
        os.write(2, f"phalanx: the warm launcher could not start this command: {error.strerror}\n".encode())
        os._exit(70)
    os.chdir(request["cwd"])
    from .launch.worker_entry import _replace_environment

    _replace_environment(env)
    # As a fresh interpreter opens them: stdout line-buffered on a terminal and block-buffered elsewhere, stderr
    # line-buffered, both unbuffered under -u or PYTHONUNBUFFERED.
    unbuffered = request["unbuffered"] or bool(env.get("PYTHONUNBUFFERED"))
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding=encoding,
                                  errors=errors, line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding=encoding,
                                  errors="backslashreplace", line_buffering=True, write_through=unbuffered)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv, sys.orig_argv = list(request["sys_argv"]), list(request["orig_argv"])
    if sys.path:
        sys.path[0] = request["path0"]
    from .launch.worker_entry import _end_without_teardown, exit_status, start_as_fresh

    start_as_fresh()

    # The command's own imports, with its environment (the server's were dropped before it served).
    importlib.import_module(warm_start.__name__).forked_command = os.getpid()  # it hands over no further
    main = getattr(importlib.import_module(command.__module__), command.__name__)
    try:
        code = main(request["argv"])
    except SystemExit as exc:
        code = exit_status(exc.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        _end_without_teardown(130)
    except BaseException:  # noqa: B902 - printed as the interpreter prints an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    _end_without_teardown(exit_status(code))


def main(argv: list[str], command) -> int:
    """`phalanx warm`; `command` is the `phalanx` command's main, which each forked process runs."""
    parser = argparse.ArgumentParser(prog="phalanx warm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", required=True, help="the UNIX socket to serve on; PHALANX_WARM_LAUNCHER names it")
    parser.add_argument("--idle-exit", type=float, default=0.0, metavar="SECONDS",
                        help="end after this long without a request or a running command (default: 0, never)")
    args = parser.parse_args(argv)
    serve(os.path.abspath(args.socket), command, args.idle_exit)
    return 0
