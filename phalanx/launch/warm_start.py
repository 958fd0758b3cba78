"""Workers forked from a server that imported torch once: `phalanx run --start-method forkserver` (the default).

A fresh worker spends seconds of CPU importing torch before its first line, at every start and every
restart, on every rank of the node at once. `phalanx run` starts one server per node as the launcher
starts (its import overlaps the rendezvous); each worker is then a fork of it (worker_entry.py `serve`):
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
import signal
import socket
import subprocess
import sys
import threading
import time

from torch.distributed.elastic.multiprocessing import api as elastic_processes
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from . import worker_entry

START_METHODS = ("forkserver", "spawn")
WORKER_ENTRY = os.path.abspath(worker_entry.__file__)
_REPLY_TIMEOUT = 60.0  # s for a fork to be answered: a server stuck this long is abandoned


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


class WorkerServer:
    """The node's fork server, as the launcher sees it: `start` a worker, learn when each one exits."""

    def __init__(self):
        # The server's environment, which a worker's is compared with: os.environ as torch elastic copies it
        # for a worker, passed whole (the C environment can hold more: a library's setenv at import).
        self.environment = dict(os.environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its own session: a Ctrl-C at the terminal is the launcher's to pass on to the workers.
        self.process = subprocess.Popen([sys.executable, "-u", WORKER_ENTRY, "--serve", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), start_new_session=True, env=self.environment)
        theirs.close()
        self.channel = ours
        self.alive = True
        self._exits: dict[int, int] = {}
        self._replies: list[int] = []
        self._changed = threading.Condition()
        self._one_start = threading.Lock()  # one request in flight: each reply is the pid of the last request
        threading.Thread(target=self._listen, name="phalanx-fork-server", daemon=True).start()

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
        """End the server (workers it forked run on: they are torch elastic's to end)."""
        with contextlib.suppress(OSError):
            self.channel.shutdown(socket.SHUT_RDWR)
        self.channel.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _running(pid: int) -> bool:
    """Whether `pid` is still a process that has not exited (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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


class _ForkedHandler(SubprocessHandler):
    """torch's handler of one worker, whose process comes from the fork server when it can."""

    server: WorkerServer | None = None

    def _popen(self, args: tuple, env: dict):
        server = self.server
        forkable = len(args) >= 3 and args[0] == sys.executable and args[1] == "-u" and args[2] == WORKER_ENTRY
        if server is not None and forkable:
            streams = {number: handle for number, handle in ((1, self._stdout), (2, self._stderr)) if handle}
            worker = server.start(list(args[3:]), env, os.getcwd(), streams)
            if worker is not None:
                return worker
        return super()._popen(args, env)


@contextlib.contextmanager
def workers_from(server: WorkerServer | None):
    """While it is open, torch elastic's worker starts (in this process) go through `server`."""
    if server is None:
        yield
        return
    original = elastic_processes.get_subprocess_handler
    handler = type("ForkedHandler", (_ForkedHandler,), {"server": server})
    elastic_processes.get_subprocess_handler = lambda **kwargs: handler(**kwargs)
    try:
        yield
    finally:
        elastic_processes.get_subprocess_handler = original
