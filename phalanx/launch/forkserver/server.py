"""The node's fork server as the launcher sees it (`WorkerServer`: start a worker, learn when it exits), and each
worker it forked (`ForkedWorker`).

Each worker is a fork of the server (worker_entry.py `serve`): its own session, environment, working directory,
stdout and stderr, and the user's script run as `python -u worker_entry.py` would run it. A worker whose environment
differs from the server's in a variable read while torch is imported executes a fresh interpreter instead
(worker_entry.read_at_import). torch elastic drives a worker through a Popen: `ForkedWorker` is that Popen for a
forked one (pid, poll, wait, signals); the server, its parent, reaps it and tells this process its exit code.
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

from .. import worker_entry

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


def _running(pid: int) -> bool:
    """diagnose's pid_alive (a zombie has exited), imported here: this module loads before torch, recorder after."""
    from ...diagnose.recorder import pid_alive

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
