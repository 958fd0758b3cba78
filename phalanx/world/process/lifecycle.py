"""Joining the world and leaving it: `init()` / `shutdown()`.

`init()` reads the environment (see discovery.py), builds the rendezvous store itself so that a
master that cannot be reached or a port already taken become clear errors in bounded time, then
creates the default process group. The same script runs under `phalanx run`, `torchrun`, `srun`
or plain `python` (a world of one, still a real process group). `before_shutdown` registers what must
run while the world is still whole.
"""

from __future__ import annotations

import inspect
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from ... import allocator, log
from ...diagnose import progress, recorder, stacks
from ...diagnose.watch import stall_timeout
from ...diagnose.watchdog import Watchdog
from .. import interface, joining, step_count, stop
from ..discovery import WorldSpec, discover
from ..meeting.store import host_store, join_store
from . import gloo_loops, identity, live
from .resources import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_TIMEOUT,
    choose_backend,
    choose_device,
    env_seconds,
    seconds,
    share_cores,
)

_owns_group = False
forget_generations = None  # generation.py's: shutdown() ends the generations, once every last collective ran
start_solo = None  # generation.py's: a joiner's generation of its own, until the run takes it in (joining.py)
_watchdog: Watchdog | None = None


def _connect_store(spec: WorldSpec, connect_timeout: timedelta, timeout: timedelta):
    """Create the TCPStore client (and server on rank 0 unless the launcher's agent hosts it)."""
    if spec.world_size == 1 and spec.master_addr is None:
        return dist.HashStore()
    if spec.rank == 0 and not spec.agent_store:
        # Ranks on other hosts dial MASTER_ADDR by a name that may resolve, on this host, to an
        # address they cannot reach (127.0.1.1): a multi-host store listens on all interfaces.
        return host_store(spec.master_addr, spec.master_port, spec.world_size, rank=spec.rank, timeout=timeout,
                          all_interfaces=spec.world_size > spec.local_world_size)
    return join_store(spec.master_addr, spec.master_port, spec.world_size, rank=spec.rank,
                      connect_timeout=connect_timeout, timeout=timeout, timeout_setting="PHALANX_CONNECT_TIMEOUT")


def init(backend: str | None = None, *, device=None, timeout=None, connect_timeout=None) -> torch.device:
    """Join the world described by the environment and return this process's device. Idempotent.

    >>> import phalanx
    >>> device = phalanx.init()    # under `phalanx run`, torchrun, srun, or plain python (a world of 1)
    >>> phalanx.rank(), phalanx.world_size()
    (0, 1)
    """
    global _owns_group
    if identity.is_initialized():
        return identity.device()
    spec = discover()
    timeout = timedelta(seconds=seconds(timeout)) if timeout is not None else env_seconds("PHALANX_TIMEOUT",
                                                                                          DEFAULT_TIMEOUT)
    connect_timeout = (timedelta(seconds=seconds(connect_timeout)) if connect_timeout is not None
                       else env_seconds("PHALANX_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT))
    chosen = choose_device(spec, device)
    # Keys private to this worker group in the launcher's store: the restart count, or under `--nnodes MIN:MAX`
    # the rendezvous round (the nodes' restart counts differ there, and a regrouping is no restart).
    attempt = os.environ.get("PHALANX_STORE_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("PHALANX_RUN_DIR"):  # under `phalanx run`: what the stop report and run summary read
        progress.start(recorder.run_directory(), spec.rank)
    _start_diagnosis(spec)
    rendezvous = recorder.begin(recorder.RENDEZVOUS)
    network = None  # the interface chosen for Gloo / NCCL between hosts (interface.py)
    if dist.is_initialized():  # the user (or a framework) made the group: adopt it
        spec = WorldSpec(dist.get_rank(), dist.get_world_size(), spec.local_rank, spec.local_world_size,
                         spec.master_addr, spec.master_port, spec.source, spec.agent_store)
        store = dist.HashStore() if spec.world_size == 1 else None
    else:
        network = interface.set_for_world(spec.master_addr, spec.world_size > spec.local_world_size)
        store = _connect_store(spec, connect_timeout, timeout)
        # The launcher's store outlives a restart of the workers: keys are per attempt, so a
        # restarted rank never reads a peer's address from the attempt before.
        default_store = dist.PrefixStore(f"default_pg/{attempt}", store)
        if joining.requested():  # a run in progress takes this rank in later: nobody to connect to now
            joining.init_unconnected(choose_backend(chosen, backend), default_store, spec.rank,
                                     max(spec.world_size, spec.rank + 1), timeout)
        else:
            loops = gloo_loops.loop_threads()
            dist.init_process_group(choose_backend(chosen, backend), store=default_store, rank=spec.rank,
                                    world_size=spec.world_size, timeout=timeout,
                                    device_id=chosen if chosen.type == "cuda" else None)
            gloo_loops.note(dist.group.WORLD, loops)
        _owns_group = True
    if not joining.pending():
        live.make_control_group(timeout)
    recorder.done(rendezvous)
    share_cores(spec, chosen)
    identity.settle(spec, chosen, dist.PrefixStore(f"phalanx/{attempt}", store) if store is not None else None,
                    attempt)
    log.configure(spec.rank, live.is_main)
    if network is not None:
        getattr(log.logger, network.level)(network.sentence)
    allocator.say_at_init(spec.rank, spec.world_size)  # under torchrun/srun: the allocator, and the LD_PRELOAD
    if joining.pending():
        start_solo()  # a world of its own until the run takes it in (checkpointer.restore())
    elif _owns_group:
        # Gloo finishes connecting on some ranks before others; a rank that returned from init()
        # and exited at once would break its peers' half-made connections. Leave init() together.
        try:
            live.barrier(timeout=connect_timeout, name="init")
        except BaseException:
            shutdown()
            raise
    recorder.phase(recorder.DATA)  # until the first forward: loading the first batch
    # From here a SIGTERM, SIGINT or SIGUSR1 can become a saved stop (world/stop.py); until the script listens
    # it ends the process as before. Not earlier: during the rendezvous, C++ waits that never return to
    # Python would hold a Python handler back, where the default action ends the process at once.
    stop.install(teardown=progress.teardown_requested)
    progress.ready()
    return chosen


def _start_diagnosis(spec: WorldSpec) -> None:
    """Record this rank's collectives where the launcher (or the watchdog) can read them; answer the stack
    signal; under torchrun and srun, watch for stalls from inside (diagnose/watchdog.py)."""
    global _watchdog
    if spec.world_size == 1 and not os.environ.get("PHALANX_RUN_DIR"):
        return  # a world of one has nobody to wait for
    directory = recorder.run_directory()
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        signum = stacks.register(stacks.stack_path(directory, spec.rank))
        recorder.start(directory, spec.rank, spec.world_size, spec.local_rank, signum)
    except OSError as exc:  # diagnosis is an aid: a read-only temp dir must not stop training
        log.logger.warning("stall diagnosis is off: cannot write %s (%s)", directory, exc)
        return
    timeout = stall_timeout()
    if os.environ.get("PHALANX_STALL_WATCHER") != "launcher" and timeout > 0 and recorder.active():
        _watchdog = Watchdog(directory, spec.rank, spec.local_rank, spec.local_world_size, spec.world_size, timeout,
                             os.environ.get("PHALANX_ON_STALL", "stop"))
        _watchdog.start()


def shutdown() -> None:
    """Leave the world together: wait for the other ranks, destroy the process group, wait again.

    Safe to call twice. Gloo aborts a process (SIGABRT, "terminate called without an active
    exception") whose peer closes its connections while it is still finishing its last collective,
    or still tearing its own group down. Measured on 2-rank runs: 7 of 20 aborted with no wait
    (torch DDP), 3 of 25 with a wait before the teardown only (phalanx DDP), 0 of 25 with both.
    """
    global _owns_group, _watchdog
    run_before_shutdown()
    if forget_generations is not None:  # after the StepLog's last records and the saves, which still regroup
        forget_generations()
    recorder.phase(recorder.SHUTDOWN)
    stop.stop_listening()  # nobody reads the flag any more: a signal ends the process again
    spec = identity.launch_spec()
    store = identity.store() if spec is not None else None
    if store is not None and live.is_main():
        try:
            joining.close(store)  # a rank waiting to join this run has none left to join
        except Exception:
            pass
    if _owns_group and dist.is_initialized():
        together = spec is not None and spec.world_size > 1 and store is not None
        if together:
            live.leave_together("shutdown")
        # After a loss (live recovery) the groups are left to the process's exit: one abandoned with a collective
        # still waiting on a host cut off would never finish tearing down (Gloo cannot abort it). Generations that
        # only grew (ranks joined) left none such: their groups are destroyed as usual, which a process that exits
        # with Gloo groups alive can abort on ("terminate called without an active exception").
        if not live.abandoned():
            dist.destroy_process_group()
        if together:
            live.leave_together("shutdown/done")
            live.keep_store_until_all_left()
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    stacks.unregister()
    if spec is not None:
        log.configure(spec.rank)  # no world to be the main rank of: the launch rank 0 logs at INFO, as before init()
    recorder.stop(remove=not os.environ.get("PHALANX_RUN_DIR"))
    progress.stop()
    step_count.forget()
    identity.forget()
    live.forget()
    _owns_group = False
    joining.set_pending(False)


_before_shutdown: list = []  # weak references to callables run first in shutdown() (StepLog's last records)


def before_shutdown(callback) -> None:
    """Run `callback()` first in shutdown(), on every rank that calls it, while the world is still whole: the
    place for a last collective (a StepLog's pending records at the end of a run or at an agreed stop). Held
    weakly (a bound method's object may go); an exception it raises is logged, not raised. A callback already
    registered is not added twice."""
    if any(ref() == callback for ref in _before_shutdown):
        return
    _before_shutdown.append(weakref.WeakMethod(callback) if inspect.ismethod(callback) else weakref.ref(callback))


def run_before_shutdown() -> None:
    """Run (once) what before_shutdown() registered: shutdown() does; so does an agreed stop in a process whose
    group phalanx did not make (torchrun with the user's init_process_group)."""
    callbacks = [ref() for ref in _before_shutdown]
    _before_shutdown.clear()
    for callback in callbacks:
        if callback is None:
            continue
        try:
            callback()
        except Exception as exc:
            log.logger.warning("shutdown(): %s", exc)
