"""torch elastic's worker starts sent to the node's fork server: while `workers_from(server)` is open, torch's
handler of a worker's process is one that asks the server for a fork (a `ForkedWorker`, server.py).

Without a server (it failed to start, or died) a worker starts as torch starts it, fresh, and the run says so once.
"""

from __future__ import annotations

import contextlib
import os
import sys

from .server import WORKER_ENTRY, WorkerServer


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
    """torch's handler of one worker, whose process comes from `server` when it can (torch is imported here, not at
    the top: like the rest of forkserver/, this module can be imported before torch is)."""
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
