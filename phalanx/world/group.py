"""The process's place in the world: `init()` / `shutdown()`, the rank helpers, `barrier()`.

`init()` reads the environment (see discovery.py), builds the rendezvous store itself so that a
master that cannot be reached or a port already taken become clear errors in bounded time, then
creates the default process group. The same script runs under `phalanx run`, `torchrun`, `srun`
or plain `python` (a world of one, still a real process group). `before_shutdown` registers what must
run while the world is still whole.
"""

from __future__ import annotations

import inspect
import os
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import allocator, log
from ..diagnose import progress, recorder, stacks
from ..diagnose.watch import stall_timeout
from ..diagnose.watchdog import Watchdog
from ..errors import PeerDiedError, RanksTimedOutError, WorldConfigError, explain
from . import interface, joining, step_count, stop
from .discovery import WorldSpec, discover
from .meeting.store import host_store, join_store

DEFAULT_TIMEOUT = timedelta(minutes=10)  # collectives: long enough for a slow first step
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=120)  # rendezvous: a missing master is reported after this
SHUTDOWN_WAIT = 60.0  # seconds shutdown() waits for the other ranks before leaving anyway

_spec: WorldSpec | None = None
_device: torch.device | None = None
_store = None  # phalanx's own namespace in the rendezvous store (barriers, host identity)
_attempt = "0"  # the worker group's keys in the store: its restart count, or the elastic round
_owns_group = False
_barrier_count = 0
lost_among = None  # generation.py's: which of some ranks are known gone (live recovery), for barrier()
forget_generations = None  # generation.py's: shutdown() ends the generations, once every last collective ran
start_solo = None  # generation.py's: a joiner's generation of its own, until the run takes it in (joining.py)
# After a loss (live recovery, generation.py): (generation number, members' global ranks, their process group).
# None: the whole world, on torch's default group.
_live: tuple[int, tuple[int, ...], object] | None = None
_abandoned = False  # a generation's groups were left behind after a loss (set_live(abandoned=True))
# A Gloo group of the ranks that train, for phalanx's own small collectives (the checkpointer's stop agreement):
# made with the world, and anew with each generation, never in the middle of a step. A group made lazily at a
# rank's first step is made while a faster rank may already be in its next one: were that rank lost there,
# the slower one would be left connecting to it, in a call that cannot be watched or aborted.
_control = None
_watchdog: Watchdog | None = None
DEAD_CHECK_AFTER = 1.0  # seconds a barrier waits before it asks whether a missing rank's process died


def _seconds(value) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _env_seconds(name: str, default: timedelta) -> timedelta:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return timedelta(seconds=float(raw))
    except ValueError:
        raise WorldConfigError(explain(f"{name} is not a number of seconds", seen=repr(raw),
                                       expected="e.g. 60", fix=f"Fix or unset {name}.")) from None


def _choose_device(spec: WorldSpec, device) -> torch.device:
    if device is not None:
        chosen = torch.device(device)
    elif torch.cuda.is_available():
        count = torch.cuda.device_count()
        if spec.local_rank >= count:
            raise WorldConfigError(explain(
                "more local ranks than GPUs on this host", rank=spec.rank,
                seen=f"LOCAL_RANK={spec.local_rank} with {count} visible GPU(s)",
                expected=f"LOCAL_RANK < {count}",
                fix="Start at most one process per GPU (`phalanx run --nproc-per-node auto`)."))
        chosen = torch.device("cuda", spec.local_rank)
    else:
        chosen = torch.device("cpu")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    return chosen


def _default_threads_untouched() -> bool:
    # torch's default intra-op pool has one thread per usable core; a user who changed it (or set
    # OMP_NUM_THREADS / MKL_NUM_THREADS) made a choice that we keep.
    if any(name in os.environ for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return False
    return torch.get_num_threads() == usable_cores()


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _share_cores(spec: WorldSpec, device: torch.device) -> None:
    if spec.local_world_size > 1 and device.type == "cpu" and _default_threads_untouched():
        torch.set_num_threads(max(1, usable_cores() // spec.local_world_size))


def group_size(group=None) -> int:
    """The size of `group` (default: the world, or after a loss the ranks left), 1 outside a torch.distributed
    world."""
    if group is None and _live is not None:
        return len(_live[1])
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """This process's rank in `group` (default: the world, or after a loss the ranks left), 0 outside a
    torch.distributed world."""
    if group is None and _live is not None:
        return _live[1].index(dist.get_rank())
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def live_group():
    """The process group of the ranks that train: None (torch's default group, the whole world) until ranks
    are lost and the others go on (live recovery), then theirs. Pass it as `group=` to a collective."""
    return None if _live is None else _live[2]


def live_members() -> tuple[int, ...]:
    """The global ranks that train: every rank of the world, or after a loss the ranks left."""
    return tuple(range(group_size())) if _live is None else _live[1]


def live_generation() -> int:
    """0, or how many times ranks were lost and the others went on (the current generation's number)."""
    return 0 if _live is None else _live[0]


def set_live(number: int, members: tuple[int, ...], group, control, abandoned: bool = False) -> None:
    """generation.py's: from now on the ranks that train are `members`, on `group` (and `control`, a Gloo group of
    theirs: control_group()). `abandoned`: the groups before were left after a loss (a collective on them may never
    end): shutdown() leaves every group to the process's exit."""
    global _live, _control, _barrier_count, _abandoned
    _abandoned = _abandoned or abandoned
    # Barriers count from 0 in each generation (their keys name it): a rank that joined counted none before.
    _live, _control, _barrier_count = (number, tuple(members), group), control, 0


def control_group():
    """A Gloo group of the ranks that train, made at init() and with each generation: phalanx's own small
    collectives run on it (None: a world of one, or before init())."""
    return _control


def _ranks_that_train():
    """(how many ranks train now, their control group), once init() ran: stop.stop_requested(agree=True)'s."""
    return (group_size(), _control) if _spec is not None else None


stop.ranks_that_train = _ranks_that_train


def _make_control_group(timeout: timedelta) -> None:
    global _control
    if dist.get_world_size() > 1:
        _control = dist.new_group(backend="gloo", timeout=timeout)


def collective_device(group=None, preferred: torch.device | None = None) -> torch.device:
    """Where a backend wants the small tensors of a collective: CUDA for NCCL (`preferred` if it is a
    CUDA device, else the current one), the CPU for every other backend and outside a world."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        if preferred is not None and preferred.type == "cuda":
            return preferred
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _choose_backend(device: torch.device, backend: str | None) -> str:
    backend = backend or os.environ.get("PHALANX_BACKEND")
    if backend:
        return backend
    return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"


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
    global _spec, _device, _store, _owns_group, _attempt
    if _spec is not None:
        return _device
    spec = discover()
    timeout = timedelta(seconds=_seconds(timeout)) if timeout is not None else _env_seconds("PHALANX_TIMEOUT",
                                                                                            DEFAULT_TIMEOUT)
    connect_timeout = (timedelta(seconds=_seconds(connect_timeout)) if connect_timeout is not None
                       else _env_seconds("PHALANX_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT))
    chosen = _choose_device(spec, device)
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
            joining.init_unconnected(_choose_backend(chosen, backend), default_store, spec.rank,
                                     max(spec.world_size, spec.rank + 1), timeout)
        else:
            dist.init_process_group(_choose_backend(chosen, backend), store=default_store, rank=spec.rank,
                                    world_size=spec.world_size, timeout=timeout,
                                    device_id=chosen if chosen.type == "cuda" else None)
        _owns_group = True
    if not joining.pending():
        _make_control_group(timeout)
    recorder.done(rendezvous)
    _share_cores(spec, chosen)
    _store = dist.PrefixStore(f"phalanx/{attempt}", store) if store is not None else None
    _spec, _device, _attempt = spec, chosen, attempt
    log.configure(spec.rank, is_main)
    if network is not None:
        getattr(log.logger, network.level)(network.sentence)
    allocator.say_at_init(spec.rank, spec.world_size)  # under torchrun/srun: the allocator, and the LD_PRELOAD
    if joining.pending():
        start_solo()  # a world of its own until the run takes it in (checkpointer.restore())
    elif _owns_group:
        # Gloo finishes connecting on some ranks before others; a rank that returned from init()
        # and exited at once would break its peers' half-made connections. Leave init() together.
        try:
            barrier(timeout=connect_timeout, name="init")
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
    global _spec, _device, _store, _owns_group, _watchdog, _live, _control, _abandoned
    run_before_shutdown()
    if forget_generations is not None:  # after the StepLog's last records and the saves, which still regroup
        forget_generations()
    recorder.phase(recorder.SHUTDOWN)
    stop.stop_listening()  # nobody reads the flag any more: a signal ends the process again
    if _store is not None and is_main():
        try:
            joining.close(_store)  # a rank waiting to join this run has none left to join
        except Exception:
            pass
    if _owns_group and dist.is_initialized():
        together = _spec is not None and _spec.world_size > 1 and _store is not None
        if together:
            _leave_together("shutdown")
        # After a loss (live recovery) the groups are left to the process's exit: one abandoned with a collective
        # still waiting on a host cut off would never finish tearing down (Gloo cannot abort it). Generations that
        # only grew (ranks joined) left none such: their groups are destroyed as usual, which a process that exits
        # with Gloo groups alive can abort on ("terminate called without an active exception").
        if not _abandoned:
            dist.destroy_process_group()
        if together:
            _leave_together("shutdown/done")
            _keep_store_until_all_left()
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    stacks.unregister()
    if _spec is not None:
        log.configure(_spec.rank)  # no world to be the main rank of: the launch rank 0 logs at INFO, as before init()
    recorder.stop(remove=not os.environ.get("PHALANX_RUN_DIR"))
    progress.stop()
    step_count.forget()
    _spec = _device = _store = _live = _control = None
    _owns_group = _abandoned = False
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


def _leave_together(name: str) -> None:
    """A barrier that never raises: a rank that is busy for long, or gone, cannot be waited for."""
    try:
        barrier(timeout=SHUTDOWN_WAIT, name=name)
    except RanksTimedOutError as exc:
        log.logger.warning("shutdown() did not wait for every rank: %s", exc)
    except Exception:
        pass


def _keep_store_until_all_left() -> None:
    """When rank 0 hosts the store itself, it stays until every rank has seen the last barrier end."""
    hosts_store = _spec.rank == 0 and not _spec.agent_store and not recorder.dead_peers(range(_spec.world_size))
    try:
        key = f"shutdown/left/{_barrier_count}"  # unique per shutdown, like the barriers before it
        left = _store.add(key, 1)
        deadline = time.monotonic() + 5.0
        while hosts_store and left < _spec.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            left = _store.add(key, 0)
    except Exception:
        pass


def is_initialized() -> bool:
    return _spec is not None


def _require() -> WorldSpec:
    if _spec is None:
        raise WorldConfigError(explain("phalanx.init() has not been called", seen="no world",
                                       fix="Call phalanx.init() at the start of the script."))
    return _spec


def rank() -> int:
    """This process's rank among the ranks that train now: 0..world_size()-1. After a loss or a join (live
    recovery) the ranks are numbered again, densely, in the order they had, as a restart would number them. A rank
    waiting to join answers its launch rank (one no other process has: never 0) until `checkpointer.restore()` takes
    it in."""
    if joining.pending() or not dist.is_initialized():
        return launch_rank()
    return group_rank()


def world_size() -> int:
    """How many ranks train now: the world, or after a loss or a join (live recovery) the ranks of the run (a rank
    waiting to join: its launch world's size, until it is taken in)."""
    if joining.pending() or not dist.is_initialized():
        return launch_world_size()
    return group_size()


def launch_rank() -> int:
    """The rank this process was launched with (a joiner: the rank drawn for it), fixed for the process's life.
    Log lines, errors and the launcher name processes by it; torch's `dist.get_rank()` answers it too."""
    return dist.get_rank() if dist.is_initialized() else _require().rank


def launch_world_size() -> int:
    """The size of the world this process was launched into: torch's default group, which a loss or a join does
    not change (`dist.get_world_size()`). The ranks that train now: world_size()."""
    return dist.get_world_size() if dist.is_initialized() else _require().world_size


def local_rank() -> int:
    return _require().local_rank


def local_world_size() -> int:
    return _require().local_world_size


def device() -> torch.device:
    _require()
    return _device


def is_main() -> bool:
    """True on exactly one of the ranks that train: rank() 0 (after a loss of the first rank, the first of the ranks
    left), and in a process that has not joined a world."""
    if joining.pending():
        return False  # a joiner before the run took it in: its world of its own is not the run's
    return _spec is None or rank() == 0


def attempt() -> str:
    """The worker group's name in the store: its restart count, or under `--nnodes MIN:MAX` the rendezvous round
    (a joiner is given the round of the group it joins)."""
    return _attempt


def store():
    """phalanx's namespace in the rendezvous store (None when a user-made group left us none)."""
    _require()
    return _store


def barrier(timeout=None, name: str = "barrier") -> None:
    """Wait for every rank; after `timeout` seconds raise RanksTimedOutError naming the missing ranks."""
    global _barrier_count
    spec = _require()
    if spec.world_size == 1:
        return
    limit = _seconds(timeout) if timeout is not None else _seconds(_env_seconds("PHALANX_TIMEOUT", DEFAULT_TIMEOUT))
    if _store is None:  # adopted group: no store of ours, fall back to the backend's barrier
        dist.barrier()
        return
    _barrier_count += 1
    members = range(spec.world_size) if _live is None else _live[1]
    key = f"{name}/{_barrier_count}" if _live is None else f"{name}/generation{_live[0]}/{_barrier_count}"
    entry = recorder.begin(recorder.BARRIER)
    _store.set(f"{key}/{launch_rank()}", b"1")
    arrived = _store.add(key, 1)
    now = time.monotonic()
    deadline, dead_check = now + limit, now + DEAD_CHECK_AFTER
    pause = 0.0005
    while arrived < len(members):
        now = time.monotonic()
        if now > dead_check:  # a peer that died will never come: say so now, not at the deadline
            dead_check = now + 0.5
            missing = [r for r in members if not _store.check([f"{key}/{r}"])]
            dead = recorder.dead_peers(missing)
            if lost_among is not None:  # live recovery: a peer on another host too, by its beacon (generation.py)
                gone = lost_among(missing)
                if gone:
                    raise PeerDiedError(explain(f"barrier '{name}' lost rank(s) {sorted(gone)}", rank=launch_rank(),
                                                seen="their processes gone", expected="every rank alive",
                                                fix="The ranks left regroup and go on (live recovery)."))
            if dead:
                raise RanksTimedOutError(explain(
                    f"barrier '{name}' cannot complete", rank=launch_rank(),
                    seen=f"rank(s) {sorted(dead)} ended without arriving (pid {', '.join(map(str, dead.values()))})",
                    expected="every rank alive", fix="Read the dead ranks' logs: they crashed or were killed "
                                                     "(SIGKILL usually means out of memory)."), missing_ranks=dead)
        if now > deadline:
            missing = [r for r in members if not _store.check([f"{key}/{r}"])]
            raise RanksTimedOutError(explain(
                f"barrier '{name}' timed out after {limit:.0f}s", rank=launch_rank(),
                seen=f"{arrived}/{len(members)} ranks arrived, missing ranks {missing}",
                expected="every rank",
                fix="Look at the missing ranks' logs: they crashed, hang, or skipped this barrier."),
                missing_ranks=missing)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = _store.add(key, 0)
    recorder.done(entry)
