"""Workers forked from a server that imported torch once: `phalanx run --start-method forkserver` (the default).

A fresh worker spends seconds of CPU importing torch before its first line, at every start and every
restart, on every rank of the node at once. The `phalanx` command, before it imports torch, gives the
launcher the workers' allocator (by executing itself again with it preloaded, which costs milliseconds
then), imports torch, and forks itself into the node's server (cli.py); each worker is then a fork of
that server (worker_entry.py `serve`):
its own session, environment, working directory, stdout and stderr, and the user's script run as
`python -u worker_entry.py` would run it. A worker whose environment differs from the server's in a
variable read while torch is imported executes a fresh interpreter instead (worker_entry.read_at_import).

torch elastic drives a worker through a Popen: `ForkedWorker` is that Popen for a forked one (pid, poll,
wait, signals); the server, its parent, reaps it and tells this process its exit code. Without a server
(it failed to start, or died) a worker starts as torch starts it, fresh, and the run says so once.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

from . import worker_entry

START_METHODS = ("forkserver", "spawn")
WORKER_ENTRY = os.path.abspath(worker_entry.__file__)
_REPLY_TIMEOUT = 60.0  # s for a fork to be answered: a server stuck this long is abandoned


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


class WorkerStart:
    """In a process forked from the server: the worker's argv for worker_entry.main."""

    def __init__(self, argv: list[str]):
        self.argv = argv


class WorkerServer:
    """The node's fork server, as the launcher sees it: `start` a worker, learn when each one exits.

    `fork_here()` makes it from the launcher itself, before any thread (cli.py, `phalanx run`): the server is
    then the launcher's own import of torch, shared, at no CPU of its own. `spawn()` starts it as a fresh
    interpreter that imports torch (when the launcher runs in another way: `phalanx.launch.run.run`)."""

    def __init__(self, channel: socket.socket, pid: int, environment: dict):
        # The server's environment, which a worker's is compared with (worker_entry.read_at_import).
        self.environment = environment
        self.channel, self.pid = channel, pid
        self.alive = True
        self._closed = False
        self._exits: dict[int, int] = {}
        self._replies: list[int] = []
        self._changed = threading.Condition()
        self._one_start = threading.Lock()  # one request in flight: each reply is the pid of the last request
        threading.Thread(target=self._listen, name="phalanx-fork-server", daemon=True).start()

    @classmethod
    def spawn(cls) -> WorkerServer:
        # os.environ as torch elastic copies it for a worker, passed whole (the C environment can hold
        # more: a library's setenv at import).
        environment = dict(os.environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its own session: a Ctrl-C at the terminal is the launcher's to pass on to the workers.
        process = subprocess.Popen([sys.executable, "-u", WORKER_ENTRY, "--serve", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), start_new_session=True, env=environment)
        theirs.close()
        return cls(ours, process.pid, environment)

    @classmethod
    def fork_here(cls) -> WorkerServer | WorkerStart:
        """Fork this process into the server. Returns the server here; a WorkerStart in each worker it forks
        (the caller then runs worker_entry.main and exits normally). Call it before any thread starts."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the fork prints what was buffered a second time
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid:
            theirs.close()
            return cls(ours, pid, dict(os.environ))
        ours.close()
        os.setsid()
        worker_entry.forget_phalanx_modules()  # a worker's `import phalanx` is its own
        return WorkerStart(worker_entry.serve(theirs.detach(), server_env=dict(os.environ)))

    def _listen(self) -> None:
        while True:
            try:
                packet = self.channel.recv(4096)
            except OSError:
                packet = b""
            with self._changed:
                if not packet:
                    self.alive = False
                    self._changed.notify_all()
                    return
                message = json.loads(packet)
                if "pid" in message:
                    self._replies.append(message["pid"])
                else:
                    self._exits[message["exited"]] = message["code"]
                self._changed.notify_all()

    def start(self, argv: list[str], env: dict, cwd: str, streams: dict[int, object]) -> ForkedWorker | None:
        """Fork a worker running `worker_entry.main(argv)`; None when the server cannot (the caller starts it fresh)."""
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "streams": list(streams)}).encode()
        fds = [handle.fileno() for handle in streams.values()]
        with self._one_start, self._changed:
            if not self.alive:
                return None
            try:
                socket.send_fds(self.channel, [request], fds)
            except OSError as exc:  # an environment too large for one packet, or the server gone
                _say(f"a worker starts fresh: the fork server could not take the request ({exc})")
                return None
            if not self._changed.wait_for(lambda: self._replies or not self.alive, _REPLY_TIMEOUT):
                _say(f"the fork server did not answer in {_REPLY_TIMEOUT:.0f} s: workers start fresh from now on")
                self.alive = False
            if not self._replies:
                return None
            return ForkedWorker(self, self._replies.pop())

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._code_locked(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while (code := self._code_locked(pid)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"worker {pid}", timeout)
                # Bounded: after the server's death, an exit is only seen by polling (see _code_locked).
                self._changed.wait(0.1 if left is None else min(left, 0.1))
            return code

    def _code_locked(self, pid: int) -> int | None:
        if pid in self._exits:
            return self._exits[pid]
        if not self.alive and not _running(pid):
            # The server died before reaping it: its exit code went with the server.
            self._exits[pid] = 1
            _say(f"worker {pid} ended after the fork server died: its exit code is unknown (taken as 1)")
        return self._exits.get(pid)

    def close(self) -> None:
        """End the server (workers it forked run on: they are torch elastic's to end). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.channel.shutdown(socket.SHUT_RDWR)
        self.channel.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # it exits at once on end of file
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    return
            if not _running(self.pid):
                return
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


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
    from .. import allocator
    from ..errors import WorldConfigError

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


def _running(pid: int) -> bool:
    """diagnose's pid_alive (a zombie has exited), imported here: this module loads before torch, recorder after."""
    from ..diagnose.recorder import pid_alive

    return pid_alive(pid)


class ForkedWorker:
    """What torch elastic uses of a `subprocess.Popen`, for a worker that the fork server forked."""

    def __init__(self, server: WorkerServer, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.wait_exit(self.pid, timeout)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@contextlib.contextmanager
def workers_from(server: WorkerServer | None):
    """While it is open, torch elastic's worker starts (in this process) go through `server`."""
    if server is None:
        yield
        return
    from torch.distributed.elastic.multiprocessing import api as elastic_processes

    original = elastic_processes.get_subprocess_handler
    handler = _forked_handler(server)
    elastic_processes.get_subprocess_handler = lambda **kwargs: handler(**kwargs)
    try:
        yield
    finally:
        elastic_processes.get_subprocess_handler = original


def _forked_handler(server: WorkerServer) -> type:
    """torch's handler of one worker, whose process comes from `server` when it can (torch is imported here:
    this module is imported before torch, by the `phalanx` command)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class ForkedHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict):
            forkable = len(args) >= 3 and args[0] == sys.executable and args[1] == "-u" and args[2] == WORKER_ENTRY
            if forkable and server.alive:
                streams = {number: handle for number, handle in ((1, self._stdout), (2, self._stderr)) if handle}
                worker = server.start(list(args[3:]), env, os.getcwd(), streams)
                if worker is not None:
                    return worker
            return super()._popen(args, env)

        def close(self, death_sig=None) -> None:
            try:
                super().close(death_sig)
            except ProcessLookupError:
                # The server reaped the worker before its exit message reached this launcher (poll() still said
                # running): its process group is already gone, as close wanted.
                for stream in (self._stdout, self._stderr):
                    if stream:
                        stream.close()

    return ForkedHandler


# -- a command handed to a warm launcher (`phalanx warm`, phalanx/warm.py) ------------------------------------

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
        while _running(child):
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
