"""`phalanx.spawn(fn, nprocs)`: the `mp.spawn` style of the tutorials, with the world already set up.

The parent hosts the rendezvous store on a port the kernel picked (no race), starts one process per
rank with the usual variables (RANK, WORLD_SIZE, ...), and each child runs `phalanx.init()` before
`fn(rank, *args)`. Results come back in rank order; the first failure stops the others and is
raised in the parent with the child's traceback; ranks still running at `timeout` are named.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import sys
import time
import traceback
from contextlib import contextmanager
from multiprocessing import reduction
from pathlib import Path

from ..allocator import CHOSEN_BY_LAUNCHER, worker_preload
from ..errors import RankFailedError, RanksTimedOutError, explain
from ..world.generation import MIN_WORLD_ENV
from ..world.meeting.store import LOOPBACK, host_store
from .failures import signal_name

_GRACE_SECONDS = 3.0
START_METHODS = ("spawn", "forkserver")
# Imported once by the fork server, so that its children start with them (~3 s of CPU a process; FSDP2:
# another second, paid by every rank that shards parameters, which phalanx itself imports lazily).
# torch._dynamo: torch imports it at a training loop's first optimizer.zero_grad() or step (~2 s of CPU). And the
# modules a rank's first `px.` name loads (phalanx/eager.py).
_SERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "phalanx", "phalanx.eager"]
_WHOLE_ENVIRONMENT = "_PHALANX_WHOLE_ENVIRONMENT"
_FORKED = "_PHALANX_FORKED_RANK"  # a rank forked from a process that had imported torch: freeze its heap
_server_preload_env: list = []  # [(LD_PRELOAD the fork server started with, whether we started it)], once started


class _CallersStreams:
    """This process's stdout and stderr as they are at the call, for a rank forked from the server, whose own
    are the server's: pickled as duplicates passed to the child (multiprocessing.reduction.DupFd), which
    puts them in place as it is unpickled, before the rank runs."""

    def __reduce__(self):
        return _adopt_streams, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_streams(stdout, stderr) -> None:
    for duplicate, fd in ((stdout, 1), (stderr, 2)):
        inherited = duplicate.detach()
        os.dup2(inherited, fd)
        os.close(inherited)


def _child(fn, rank: int, nprocs: int, args: tuple, env: dict, results, do_init: bool, streams=None) -> None:
    if env.pop(_WHOLE_ENVIRONMENT, None):  # forked from the server: its environment is the server's, not ours
        os.environ.clear()
    if env.pop(_FORKED, None):
        # The parent's objects out of the collector's sight: a full collection would write to every one of
        # them, and so copy every page of the heap the rank shares with its parent (~18,000 page faults and
        # 0.3 s of CPU in a rank that has imported torch, per collection; 650 frozen).
        gc.freeze()
    os.environ.update(env)
    # A spawned child inherits "spawn" as its start method; give the rank the platform default back,
    # so its DataLoader workers start as they would under `phalanx run` (fork on Linux: seconds faster).
    mp.set_start_method(None, force=True)
    from ..world import group as world

    if "OMP_NUM_THREADS" in env:  # torch was imported (unpickling fn) before the variable was set
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))

    try:
        if do_init:
            world.init()
        value = fn(rank, *args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: B902 - the parent must hear about every way a rank ends
        results.put((rank, "error", traceback.format_exc()))
    finally:
        world.shutdown()


def _stop(processes, patient: bool = False) -> None:
    """End the ranks. `patient`: every rank returned, so let each finish its shutdown first (a background
    checkpoint write is committed there), terminating only those still there after the grace period."""
    if patient:
        deadline = time.monotonic() + _GRACE_SECONDS
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _GRACE_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def spawn(fn, nprocs: int, args: tuple = (), *, timeout: float | None = None, env: dict | None = None,
          init: bool = True, start_method: str = "spawn", min_world_size: int | None = None) -> list:
    """Run `fn(rank, *args)` in `nprocs` new processes and return their results in rank order.

    `min_world_size`: live recovery (docs/launching.md, "Live recovery"): a rank killed by a signal is lost, not
    a failure, while at least that many ranks are left; the others go on in-process (a global-batch loop needs no
    change), and its result is None.

    `start_method="spawn"` starts each rank in a new interpreter, as torch's `mp.spawn` does.
    `"forkserver"` forks each from a server process that has imported torch and phalanx once, which
    saves each rank that import (~3 s of CPU); the rank gets this process's environment all the same.
    Where the server runs another C allocator than this call's ranks would get (allocator.py), it spawns.
    In a command a warm launcher forked, the ranks fork from the command itself (`_context`).

    >>> def work(rank):                     # doctest: +SKIP
    ...     t = torch.tensor([rank]); dist.all_reduce(t); return t.item()
    >>> phalanx.spawn(work, nprocs=2)       # doctest: +SKIP
    [1, 1]
    """
    if nprocs < 1:
        raise ValueError(explain("spawn needs at least one process", seen=f"nprocs={nprocs}", expected=">= 1"))
    if start_method not in START_METHODS:
        raise ValueError(explain("spawn's start_method is not one it knows", seen=f"start_method={start_method!r}",
                                 expected=" or ".join(map(repr, START_METHODS))))
    server = host_store(LOOPBACK, 0, nprocs, rank=None)
    base = {"WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(server.port), "PHALANX_STORE_HOSTED": "1", **(env or {})}
    if min_world_size is not None:
        if not 1 <= min_world_size <= nprocs:
            raise ValueError(explain("spawn's min_world_size is outside the world", seen=f"{min_world_size}",
                                     expected=f"1..{nprocs}", fix="Pass the fewest ranks the run may go on with."))
        base[MIN_WORLD_ENV] = str(min_world_size)
    processes = []
    with _preloaded(base) as preload:  # the allocator is chosen as a process starts: the children inherit it
        base[CHOSEN_BY_LAUNCHER] = preload or "system"  # so that init() gives no torchrun advice (allocator.py)
        context = _context(start_method, preload)
        results = context.Queue()
        forked = context.get_start_method() == "forkserver"
        if forked:
            base = {**os.environ, **base, _WHOLE_ENVIRONMENT: "1"}
        if context.get_start_method() != "spawn":
            base[_FORKED] = "1"
        for rank in range(nprocs):
            child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            # Unpickling it in the child puts this process's stdout and stderr in place (_CallersStreams).
            streams = _CallersStreams() if forked else None
            process = context.Process(target=_child, args=(fn, rank, nprocs, tuple(args), child_env, results, init,
                                                           streams),
                                      name=f"phalanx-rank-{rank}", daemon=False)
            process.start()
            processes.append(process)
    finished = False
    try:
        values = _collect(processes, results, timeout, min_world_size)
        finished = True
        return values
    finally:
        _stop(processes, patient=finished)
        del server


def _context(start_method: str, preload: str):
    """The multiprocessing context to start ranks with, called with LD_PRELOAD as the ranks should have it
    (`preload`). The fork server keeps the allocator it started with, for as long as it runs: ours is stopped
    and started again with another (once, ~7 s of CPU: spawned ranks would each pay it, every call, from then
    on); one that other code of the process started is left alone, and the ranks are spawned. A command that a
    warm launcher forked (phalanx/warm.py) is already what the server would be: its ranks fork from it, and no
    server imports torch again."""
    if start_method == "forkserver":
        if _a_warm_command_that_can_fork(preload):
            return mp.get_context("fork")
        server_preload = os.environ.get("LD_PRELOAD") or ""  # what the server starts with: this process's, now
        if _server_preload_env and not _server_preload_env[0][1] and _running_server() is None:
            _server_preload_env.clear()  # the other code's server was stopped: ours may start now
        if not _server_preload_env:
            running = _running_server()
            if running is not None:  # started by other code of this process (torch's test suites): it has its own
                _server_preload_env.append((running, False))
            else:
                mp.set_forkserver_preload(_SERVER_PRELOAD)
                _server_preload_env.append((server_preload, True))  # it starts with the first rank, in _preloaded
        started_with, ours = _server_preload_env[0]
        if (started_with or "") == server_preload:
            return mp.get_context("forkserver")
        if ours:
            from multiprocessing import forkserver

            forkserver._forkserver._stop()
            _server_preload_env[0] = (server_preload, True)
            return mp.get_context("forkserver")
    return mp.get_context("spawn")


def _running_server() -> str | None:
    """The LD_PRELOAD of the fork server this process already runs ("" unset; None: none runs). Another part of the
    process may have started it (multiprocessing keeps one per process), with an allocator of its own."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "unknown"  # never equal to a preload: the ranks are spawned
    found = [v[len(b"LD_PRELOAD="):].decode() for v in variables if v.startswith(b"LD_PRELOAD=")]
    return found[0] if found else ""


def _a_warm_command_that_can_fork(preload: str) -> bool:
    """This process was forked from a warm launcher that imported torch, runs one thread, holds no GPU context
    and no process group (what a fork would carry into the ranks), and its allocator is the ranks' (a process
    keeps the one it started with: the launcher's, whose environment at its start /proc/self/environ keeps)."""
    import sys
    import threading

    from .warm_start import forked_command
    from .worker_entry import _environment_at_exec

    if forked_command != os.getpid() or threading.active_count() != 1 or "torch" not in sys.modules:
        return False
    import torch

    if torch.cuda.is_initialized() or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return _environment_at_exec().get("LD_PRELOAD", "") == (preload or "")


@contextmanager
def _preloaded(env: dict):
    """This process's LD_PRELOAD set to the workers' allocator (allocator.py) while children start, then back;
    yields the LD_PRELOAD they start with."""
    settings = {**os.environ, **env}
    preload = worker_preload(settings)
    if preload is None:
        yield settings.get("LD_PRELOAD", "")
        return
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = preload
    try:
        yield preload
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def _lost(rank: int, exitcode: int, values: dict, nprocs: int, min_world_size: int | None) -> bool:
    """Whether a rank that ended without a result counts as lost (live recovery goes on without it): killed by
    a signal, with enough ranks left."""
    lost = sum(1 for value in values.values() if value is None) + 1
    if min_world_size is None or exitcode >= 0 or nprocs - lost < min_world_size:
        return False
    print(f"phalanx.spawn: rank {rank} was lost (killed by {signal_name(exitcode)}); {nprocs - lost} ranks go on.",
          file=sys.stderr, flush=True)
    return True


def _collect(processes, results, timeout: float | None, min_world_size: int | None = None) -> list:
    nprocs = len(processes)
    values: dict[int, object] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(values) < nprocs:
        try:
            rank, status, payload = results.get(timeout=0.05)
        except queue_module.Empty:
            for rank, process in enumerate(processes):
                # A rank that ended without a word (SIGKILL, segfault, os._exit) is a failure too;
                # give its queue message a moment to arrive before calling it silent.
                if rank not in values and process.exitcode is not None:
                    try:
                        rank, status, payload = results.get(timeout=0.5)
                        break
                    except queue_module.Empty:
                        if _lost(rank, process.exitcode, values, nprocs, min_world_size):
                            values[rank] = None
                            continue
                        raise RankFailedError(explain(
                            f"rank {rank} ended without reporting a result", seen=f"exit code {process.exitcode}",
                            expected="a normal return",
                            fix="A negative code is the signal that killed it (-9: SIGKILL, often out of memory)."),
                            rank=rank, exitcode=process.exitcode) from None
            else:
                if deadline is not None and time.monotonic() > deadline:
                    missing = [r for r in range(nprocs) if r not in values]
                    raise RanksTimedOutError(explain(
                        f"ranks {missing} did not finish within {timeout:.0f}s",
                        seen=f"{len(values)}/{nprocs} finished",
                        expected="every rank", fix="A hang: look for a collective that some rank skipped."),
                        missing_ranks=missing)
                continue
        if status == "error":
            raise RankFailedError(f"rank {rank} failed; its traceback:\n{payload}", rank=rank, traceback_text=payload)
        values[rank] = pickle.loads(payload)
    return [values[rank] for rank in range(nprocs)]
