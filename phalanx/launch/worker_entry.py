"""The first code each worker of `phalanx run` executes: run the user's script or module, record its failure.

An uncaught exception is written, as the user's own traceback, to the file torch elastic names in
TORCHELASTIC_ERROR_FILE, so the launcher can print the failing rank's traceback last. The launcher
starts this file by path (`python -u worker_entry.py [-m] target args...`): it imports nothing
from phalanx, so the user's `import phalanx` is the first one and sees a fresh environment.
"""

import atexit
import ctypes
import faulthandler
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback

# runpy is a frozen module on recent Pythons: its frames name "<frozen runpy>", not a path.
_OUR_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}


def _user_traceback(exc: BaseException) -> str:
    """The traceback as Python would print it for `python script.py`, without our and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in _OUR_FILES
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in _OUR_FILES):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _record(exc: BaseException, text: str) -> None:
    """Write torch elastic's error-file format, atomically, so the launcher never reads half a file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path + ".tmp", "w") as handle:
            json.dump(data, handle)
        os.replace(path + ".tmp", path)
    except OSError as error:  # a full disk must not hide the user's own exception
        print(f"phalanx: could not write the error file {path}: {error}", file=sys.stderr)


def _answer_stack_signal() -> None:
    """From the first line of the worker on, `phalanx run` can ask for its stacks, even before (or without)
    phalanx.init(): the signal and the file are diagnose/stacks.py's (STACK_SIGNAL, stack_path)."""
    directory, rank = os.environ.get("PHALANX_RUN_DIR"), os.environ.get("RANK")
    if not directory or rank is None:
        return
    number = os.environ.get("PHALANX_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    attempt = os.path.join(directory, f"attempt-{number}")
    try:
        os.makedirs(attempt, mode=0o700, exist_ok=True)
        handle = open(os.path.join(attempt, f"rank-{rank}.stack"), "a")
    except OSError:
        return
    faulthandler.register(signal.SIGRTMIN + 6, file=handle, all_threads=True, chain=False)
    _kept.append(handle)


_kept: list = []


def _flush_open_files() -> None:
    """Flush every file the script left open, as `python script.py` does when its `__main__` is torn down: a
    script run through runpy keeps its globals alive to the end (a thread's function holds them), so its files
    would otherwise never be flushed. Registered first, so it runs after the script's own atexit handlers. A
    forked worker sees only the objects made since its fork: the server froze its own (serve)."""
    for stream in gc.get_objects():
        if isinstance(stream, io.IOBase):
            try:
                if not stream.closed:
                    stream.flush()
            except Exception:  # a broken pipe, a file closed underneath: the teardown ignores them too
                pass


def main(argv: list) -> None:
    atexit.register(_flush_open_files)
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: worker_entry.py [-m] target [args...]")
    target, args = argv[0], argv[1:]
    _answer_stack_signal()
    # Same sys.path[0] as `python script.py` / `python -m module` would have (not this directory).
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    sys.argv = [target, *args]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(target), run_name="__main__")
    except SystemExit:
        raise  # an exit code the user chose: not a crash to report
    except KeyboardInterrupt as exc:  # Ctrl-C, or the launcher passing on its SIGINT: show where it stopped
        sys.stderr.write(_user_traceback(exc))
        sys.exit(130)
    except BaseException as exc:  # noqa: B902 - every crash must reach the launcher
        text = _user_traceback(exc)
        _record(exc, text)
        sys.stderr.write(text)
        sys.stderr.flush()
        sys.exit(1)


def run_forked(argv: list) -> None:
    """A worker forked from the server: run the script as `main` does, then end the process as the interpreter
    ends `python script.py` (its non-daemon threads joined, atexit handlers run, every open file flushed, the
    exit code Python would give), without tearing down the heap it shares with the server. That teardown
    writes every object's refcount, so in a fork it copies every page torch's import touched: about 2 s of CPU
    a worker, at the end of every run and every stop (measured: docs/launching.md "How workers start")."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exit_status(exc.code)
    _end_without_teardown(code)


def exit_status(code) -> int:
    """What the interpreter exits with for `sys.exit(code)`: None is 0, an int itself, anything else printed to
    stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:  # a closed stderr must not change the exit code
        pass
    return 1


def _end_without_teardown(code: int) -> None:
    finish_as_python_does()
    os._exit(code)


def finish_as_python_does() -> None:
    """What the interpreter does at the end of `python script.py`, short of tearing down its heap."""
    import threading

    threading._shutdown()  # what Py_Finalize does first: wait for the non-daemon threads
    atexit._run_exitfuncs()  # then atexit: logging.shutdown, weakref.finalize, the user's own, _flush_open_files
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # as above
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # C's stdio buffers (a C++ library's output), which exit() would flush
    except (OSError, AttributeError):
        pass


# What a worker's environment may hold differently from the fork server's: variables read when a worker
# starts its process group or its device, never while torch is imported. The names torch elastic sets per
# worker (torch/distributed/elastic/agent/server/local_elastic_agent.py) and phalanx's own; SLURM's (phalanx
# reads them as the world starts, torch never) and Accelerate's (read as it is imported: no server imports it).
_READ_LATER = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
               "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
               "PWD", "OLDPWD", "SHLVL", "_"}  # and the shell's own bookkeeping
_READ_LATER_PREFIXES = ("TORCHELASTIC_", "PHALANX_", "TORCH_NCCL_", "NCCL_", "GLOO_", "TP_SOCKET_IFNAME", "SLURM_",
                        "ACCELERATE_")
MAX_REQUEST = 1 << 20  # bytes of one request: argv, cwd and the whole environment, as JSON


def read_at_import(env: dict, server_env: dict) -> list:
    """The variables in which `env` differs from the server's and that a fresh worker could read before its
    first line runs: while it imports torch (thread counts, the allocator, Python's own settings)."""
    names = set(env) ^ set(server_env) | {name for name in env if name in server_env and env[name] != server_env[name]}
    return sorted(name for name in names
                  if name not in _READ_LATER and not name.startswith(_READ_LATER_PREFIXES))


def serve(fd: int, server_env: dict | None = None) -> list:
    """The fork server's loop. Returns only in a forked worker, with the worker's argv for `main`.
    `server_env`: the environment the server stands for (default: the one it was started with)."""
    import torch  # noqa: F401 - the import every forked worker is spared (done already in a forked launcher)

    server_env = _environment_at_exec() if server_env is None else server_env
    # Everything imported so far is every worker's, read-only: out of the collector's sight, a worker's
    # collections and its end (run_forked) touch none of it, so its pages stay shared.
    gc.collect()
    gc.freeze()
    channel = socket.socket(fileno=fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears of exits
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to pass on, not ours to die of
    # A worker's parent is this server, not the launcher: what a worker (or anyone) sends to its parent to
    # stop the run, the launcher gets. Dying of it would lose the workers' exit codes.
    launcher = os.getppid()
    for number in _PASSED_TO_LAUNCHER:
        signal.signal(number, lambda signum, _: _pass_on(signum, launcher))
    signal.set_wakeup_fd(wake_write)
    while True:
        readable, _, _ = select.select([channel, wake_read], [], [])
        if wake_read in readable:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
            _report_exits(channel)
        if channel not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 2)
        if not message:  # the launcher is gone: its workers live on (they are not ours to end)
            os._exit(0)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            for handle in (channel.detach(), wake_read, wake_write):
                os.close(handle)
            return _become_worker(request, fds, server_env)
        for handle in fds:
            os.close(handle)
        channel.send(json.dumps({"pid": pid}).encode())


_PASSED_TO_LAUNCHER = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def _pass_on(signum: int, launcher: int) -> None:
    if os.getppid() == launcher:  # not once the launcher is gone (its pid may be another process's by then)
        try:
            os.kill(launcher, signum)
        except ProcessLookupError:
            pass


def _environment_at_exec() -> dict:
    """The environment this server was started with: what a fresh worker would start with, before anything
    run at start-up (a .pth file, an import) changed os.environ."""
    try:
        with open("/proc/self/environ", "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    return dict(os.fsdecode(entry).split("=", 1) for entry in entries if b"=" in entry)


def _replace_environment(env: dict) -> None:
    """os.environ and the C environment become `env` exactly: also without variables that a library set in
    the server with setenv(3), which os.environ never saw."""
    os.environ.clear()
    try:
        ctypes.CDLL(None).clearenv()
    except (OSError, AttributeError):
        pass
    os.environ.update(env)


def _report_exits(channel: socket.socket) -> None:
    """Reap every worker that ended and tell the launcher its exit code, as Popen.returncode gives it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become_worker(request: dict, fds: list, server_env: dict) -> list:
    """In the forked child: the process a fresh `python -u worker_entry.py ARGV` would have been."""
    signal.set_wakeup_fd(-1)
    for number in (signal.SIGCHLD, *_PASSED_TO_LAUNCHER):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets it at start: KeyboardInterrupt
    os.setsid()  # as torch elastic's Popen(start_new_session=True): the launcher signals the group
    for target, handle in zip(request["streams"], fds):
        os.dup2(handle, target)
        os.close(handle)
    os.chdir(request["cwd"])
    env, argv = request["env"], request["argv"]
    if read_at_import(env, server_env):
        os.execve(sys.executable, [sys.executable, "-u", os.path.abspath(__file__), *argv], env)
    _replace_environment(env)
    # As `python -u` has them (a server forked from the launcher has the launcher's, maybe buffered): every
    # line reaches the log file at once, and nothing is lost when the worker is killed.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                  errors=sys.stdout.errors, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                  errors="backslashreplace", write_through=True)
    start_as_fresh()
    return argv


def start_as_fresh() -> None:
    """In a fork of a server, after its environment became its own: what a fresh interpreter would have done
    with that environment. Python ran site customization when the server started, with the server's: run it
    again (a sitecustomize that reads RANK, say; path configuration files, .pth, are not run again). NumPy's
    global generator was seeded once, in the server (torch imported it): each fork draws its own seed, as a
    fresh process does (Python's random reseeds itself at fork)."""
    for name in ("sitecustomize", "usercustomize"):
        if sys.modules.pop(name, None) is not None:
            importlib.import_module(name)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def forget_phalanx_modules() -> None:
    """Drop phalanx's modules from a server about to fork: they read the environment as they are imported, so
    each fork imports them afresh with its own (torch's and what torch imported stay: they are what the fork
    is for)."""
    for name in [name for name in sys.modules if name == "phalanx" or name.startswith("phalanx.")]:
        del sys.modules[name]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        run_forked(serve(int(sys.argv[2])))  # returns in each forked worker only
    else:
        main(sys.argv[1:])
