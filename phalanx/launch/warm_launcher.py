"""A server that imported torch once and forks `phalanx` commands from it: PHALANX_WARM_LAUNCHER.

Every `phalanx run` imports torch before it does anything: 3-4 s of CPU a launch, most of what a short
job costs, and most of what a sweep or a test suite that launches hundreds of jobs costs. Start the
server once and point the variable at its socket:

    python -m phalanx.launch.warm_launcher --socket /tmp/phalanx-warm.sock &
    export PHALANX_WARM_LAUNCHER=/tmp/phalanx-warm.sock

Each `phalanx` command then hands its arguments, environment, working directory and standard streams
to the server, which forks a process that runs the command as a fresh one would (the same code, the
same exit status, the run's own environment) while the command stays to pass on the signals it gets
and to exit as that process exits. A command runs fresh instead, and says why in one line, where a
forked one could differ from it: an environment that differs from the server's in what is read while
torch is imported (thread counts, the allocator, Python's settings), another Python or checkout of
phalanx, other namespaces (`ip netns exec`, `unshare`), another cgroup (srun, a memory limit), other
resource limits, CPU affinity, niceness, umask or user. A server that cannot be reached is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

ENV = "PHALANX_WARM_LAUNCHER"
forked_command = False  # True in a command forked from the server (its phalanx modules are its own imports)
MAX_REQUEST = 1 << 20  # bytes: argv, the environment and the process's context, as JSON
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_REPLY_TIMEOUT = 30.0  # s for the server to fork or decline: past it the command runs fresh
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_NPROC",
           "RLIMIT_MEMLOCK", "RLIMIT_CPU", "RLIMIT_FSIZE")


def _say(text: str) -> None:
    print(f"phalanx: {text}", file=sys.stderr, flush=True)


def context() -> dict:
    """What a process inherits besides its environment and that a fork from the server would not share with the
    command: compared item by item, and any difference runs the command fresh."""
    found = {"python": [sys.executable, sys.version], "phalanx": os.path.dirname(os.path.dirname(__file__)),
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
    if hasattr(os, "sched_getaffinity"):
        found["cpus"] = sorted(os.sched_getaffinity(0))
    for kind in ("net", "uts", "mnt", "ipc", "pid", "user", "cgroup"):
        with contextlib.suppress(OSError):
            found[f"{kind} namespace"] = os.stat(f"/proc/self/ns/{kind}").st_ino
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as handle:
        found["cgroup"] = handle.read()
    return found


# -- the command's side --------------------------------------------------------------------------------------

def hand_over(argv: list[str]) -> int | None:
    """In a `phalanx` command: run it in a process forked from the server named by PHALANX_WARM_LAUNCHER and
    return its exit code; None when the command should run here, fresh (no server, or a difference)."""
    from .warm_start import _REEXECUTED

    path = os.environ.get(ENV)
    if not path or forked_command or os.environ.get(_REEXECUTED):  # (the last: a fresh one, started again)
        return None
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        channel.connect(path)
    except OSError as error:
        channel.close()
        _say(f"the warm launcher {path} ({ENV}) cannot be reached ({error.strerror or error}): starting fresh")
        return None
    child, pending = None, []

    def forward(signum, _frame):
        if child is None:
            pending.append(signum)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    previous = {number: signal.signal(number, forward) for number in _FORWARDED}
    request = {"argv": argv, "sys_argv": sys.argv, "orig_argv": getattr(sys, "orig_argv", sys.argv),
               "path0": sys.path[0] if sys.path else "", "env": dict(os.environ), "cwd": os.getcwd(),
               "unbuffered": bool(getattr(sys.stdout, "write_through", False)),  # python -u
               "context": context()}
    try:
        socket.send_fds(channel, [json.dumps(request).encode()], [0, 1, 2])
        channel.settimeout(_REPLY_TIMEOUT)
        reply = json.loads(channel.recv(4096) or b'{"cold": "the server closed the connection"}')
    except (OSError, ValueError) as error:
        reply = {"cold": f"the server did not answer ({error})"}
    if "cold" in reply:
        channel.close()
        for number, handler in previous.items():
            signal.signal(number, handler)
        _say(f"starting fresh, not from the warm launcher {path}: {reply['cold']}")
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
        while _alive(child):
            time.sleep(0.1)
        _say(f"the warm launcher {path} ended before the command (pid {child}): its exit code is unknown (1)")
        return 1
    code = json.loads(message)["exit"]
    if code < 0:  # the command's process died of a signal: so does this one, as a fresh command would have
        for number in {*_FORWARDED, -code} - {signal.SIGKILL, signal.SIGSTOP}:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        return 128 - code
    return code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the server's side ---------------------------------------------------------------------------------------

def serve(path: str, idle_exit: float = 0.0) -> None:
    """Import what every command imports, then fork one process per request until SIGTERM or SIGINT (or
    `idle_exit` seconds without a request or a running command)."""
    from . import warm_start

    warm_start._preload_here()  # the allocator the commands' workers get: chosen when a process starts
    import torch._dynamo  # noqa: F401 - torch, what every command is spared, and what a training loop imports

    from . import run, worker_entry  # noqa: F401 - run: torch elastic's modules, argparse, the launcher's own

    server_env = worker_entry._environment_at_exec()
    own = context()
    # phalanx's modules read the environment as they are imported: each command imports them afresh, with its
    # own (torch's and the standard library's stay: they are what the fork is for).
    for name in [name for name in sys.modules if name == "phalanx" or name.startswith("phalanx.")]:
        del sys.modules[name]
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
    print(f"phalanx warm launcher: serving on {path} (pid {os.getpid()}); set {ENV}={path}", flush=True)
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
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if listener in readable:
                idle_since = time.monotonic()
                started = _take(listener, server_env, own, [listener, wake_read, wake_write, *commands.values()])
                if started is not None:
                    commands[started[0]] = started[1]
            if commands:
                idle_since = time.monotonic()
    finally:
        unlink_ours()


def _take(listener: socket.socket, server_env: dict, own: dict, ours: list) -> tuple[int, socket.socket] | None:
    """Answer one command: fork its process, or tell it to run fresh. In the forked child this never returns."""
    channel, _ = listener.accept()
    fds: list[int] = []
    try:
        channel.settimeout(5.0)
        _, uid, _ = struct.unpack("3i", channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        if uid != os.getuid():
            raise ValueError(f"user {uid}'s command, and this server runs as user {os.getuid()}")
        message, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 3)
        request = json.loads(message)
        env = _as_fresh(request["env"])
        reason = _difference(request["context"], own) or _import_time_difference(env, server_env)
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
            _become_command(request, fds, env)
        finally:
            os._exit(70)  # only if becoming the command failed before it ran
    for handle in fds:
        os.close(handle)
    print(json.dumps({"started": pid, "argv": request["argv"], "cwd": request["cwd"]}), flush=True)
    channel.settimeout(None)
    try:
        channel.send(json.dumps({"pid": pid}).encode())
    except OSError:  # the command is already gone: so is the reason to run it
        os.kill(pid, signal.SIGKILL)
    return pid, channel


def _as_fresh(env: dict) -> dict:
    """The environment a fresh command would run with once `phalanx` preloaded its workers' allocator into
    itself (warm_start._preload_here executes the command again with LD_PRELOAD set)."""
    from ..allocator import worker_preload
    from ..errors import WorldConfigError
    from .warm_start import _REEXECUTED

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


def _difference(theirs: dict, own: dict) -> str | None:
    for key in sorted(set(theirs) | set(own)):
        if theirs.get(key) != own.get(key):
            return f"its {key} differs from the server's"
    return None


# Read by the interpreter as it starts, and applied by _become_command as the command's own.
_APPLIED_IN_THE_FORK = {"PYTHONUNBUFFERED"}


def _import_time_difference(env: dict, server_env: dict) -> str | None:
    from .worker_entry import read_at_import

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


def _become_command(request: dict, fds: list, env: dict) -> None:
    """In the forked child: the process `python -m phalanx ARGV` would have been, until it exits."""
    import io

    signal.set_wakeup_fd(-1)
    for number in (signal.SIGCHLD, signal.SIGTERM, *_FORWARDED):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets it at start: KeyboardInterrupt
    os.setsid()  # out of the server's process group: what is sent to the server is not sent to the commands
    for target, handle in enumerate(fds):
        os.dup2(handle, target)
        os.close(handle)
    os.chdir(request["cwd"])
    from .worker_entry import _replace_environment

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
    import importlib

    for name in ("sitecustomize", "usercustomize"):  # run again with the command's environment
        if sys.modules.pop(name, None) is not None:
            importlib.import_module(name)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # its own seed, as a fresh process draws (Python's random reseeds itself at fork)
    from .worker_entry import _end_without_teardown, _exit_status

    importlib.import_module(__name__).forked_command = True  # the command's own import: it hands over no further
    try:
        from ..cli import main

        code = main(request["argv"])
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        _end_without_teardown(130)
    except BaseException:  # noqa: B902 - printed as the interpreter prints an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    _end_without_teardown(_exit_status(code))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.launch.warm_launcher", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", required=True, help="the UNIX socket to serve on; PHALANX_WARM_LAUNCHER names it")
    parser.add_argument("--idle-exit", type=float, default=0.0, metavar="SECONDS",
                        help="end after this long without a request or a running command (default: 0, never)")
    args = parser.parse_args(argv)
    serve(os.path.abspath(args.socket), args.idle_exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
