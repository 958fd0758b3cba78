"""The process's recorder: its ring, its call sites, and the hooks that keep its heartbeat.

`start()` at init(); until then (and with PHALANX_RECORD=0, or in a world of one outside a
launcher) every function here is a single None check, so a process that records nothing pays
nothing. The engine calls `begin` when it arrives at a collective and `done` when it leaves it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import stacks
from .callsite import CallSites
from .record import (
    ENQUEUED,
    H_EXITED,
    H_MAIN_THREAD,
    H_PID,
    H_STACK_SIGNAL,
    KIND,
    PHASE,
    STARTED,
    Ring,
    dtype_code,
    read_header,
    ring_path,
)

BUCKET, BROADCAST, BARRIER, CHECKPOINT = KIND["bucket"], KIND["broadcast"], KIND["barrier"], KIND["checkpoint"]
JOIN, USED_MAP, ALL_GATHER, RENDEZVOUS, SHADOW = (KIND["join"], KIND["used-map"], KIND["all-gather"],
                                                  KIND["rendezvous"], KIND["shadow"])
DATA, FORWARD, BACKWARD, OPTIMIZER = PHASE["data"], PHASE["forward"], PHASE["backward"], PHASE["optimizer"]
SAVING, SHUTDOWN = PHASE["checkpoint"], PHASE["shutdown"]
HOST_PHASE, NETWORK_PHASE = KIND["host-phase"], KIND["network-phase"]  # the two levels of an exchange across hosts
AUDIT, FINITE_FLAGS = KIND["replica-audit"], KIND["finite-flags"]  # engine/replicas/

_ring: Ring | None = None
_sites: CallSites | None = None
_directory: str | None = None
_hooks: list = []


def run_directory(rank_env: dict | None = None) -> str | None:
    """Where this attempt's rings live: `phalanx run` names it (PHALANX_RUN_DIR); under torchrun or srun
    every local rank derives the same one from what they share (their parent, the master port, the job)."""
    env = os.environ if rank_env is None else rank_env
    # PHALANX_ATTEMPT: `phalanx run` counts the worker groups it starts (a regrouping at a new world size is one)
    attempt = env.get("PHALANX_ATTEMPT") or env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("PHALANX_RUN_DIR"):
        return os.path.join(env["PHALANX_RUN_DIR"], f"attempt-{attempt}")
    shared = "|".join([str(os.getppid()), env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""),
                       env.get("TORCHELASTIC_RUN_ID", ""), env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", ""),
                       attempt])
    key = hashlib.sha256(shared.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"phalanx-{os.getuid()}", key)


def start(directory: str, rank: int, world_size: int, local_rank: int, stack_signal: int = 0) -> None:
    """Open this rank's ring in `directory` and hook the optimizer's steps (idempotent)."""
    global _ring, _sites, _directory
    if _ring is not None or os.environ.get("PHALANX_RECORD", "1") == "0":
        return
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ring = Ring(ring_path(directory, rank), rank, world_size, local_rank)
    ring.set(H_MAIN_THREAD, threading.main_thread().ident or 0)
    ring.set(H_STACK_SIGNAL, stack_signal)
    _sites = CallSites(ring.add_site)
    _directory = directory
    _ring = ring
    _hooks.append(register_optimizer_step_pre_hook(_optimizer_begins))
    _hooks.append(register_optimizer_step_post_hook(_optimizer_ends))


def _optimizer_begins(*_) -> None:
    phase(OPTIMIZER)  # returns None: torch takes a pre-hook's value as new arguments


def _optimizer_ends(*_) -> None:
    phase(DATA)  # from the end of a step to the next forward, a rank waits for its data


def stop(remove: bool = False) -> None:
    """Mark the ring as left cleanly and stop recording. `remove`: delete it too (nobody will read it:
    no launcher owns the directory and the run ended cleanly)."""
    global _ring, _sites, _directory
    if _ring is None:
        return
    _ring.close()
    for handle in _hooks:
        handle.remove()
    _hooks.clear()
    if remove:
        for path in (_ring.path, _ring.path[:-len(".ring")] + ".stack"):
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(_directory)  # the last rank to leave removes the directory
        except OSError:
            pass
    _ring = _sites = _directory = None


def active() -> bool:
    return _ring is not None


def directory() -> str | None:
    """The run directory of this process's ring (None when not recording)."""
    return _directory


def begin(kind: int, bucket: int = -1, numel: int = 0, dtype=None, started: bool = True) -> int:
    """Arrival at a collective; returns the entry to pass to started()/done() (-1 when not recording)."""
    ring = _ring
    if ring is None:
        return -1
    return ring.begin(kind, bucket, numel, dtype_code(dtype) if dtype is not None else 0, _sites.here(2),
                      STARTED if started else ENQUEUED)


def started(entry: int) -> None:
    if entry >= 0 and _ring is not None:
        _ring.started(entry)


def done(entry: int) -> None:
    if entry >= 0 and _ring is not None:
        _ring.done(entry)


def phase(code: int) -> int:
    """Enter a phase (DATA, FORWARD, ...); returns the previous one, to restore it."""
    ring = _ring
    return ring.phase(code) if ring is not None else -1


def next_step() -> None:
    """A synchronized forward began: the heartbeat's step count."""
    if _ring is not None:
        _ring.next_step()


def beat() -> None:
    if _ring is not None:
        _ring.beat()


def dead_peers(ranks) -> dict[int, int]:
    """Of `ranks`, those whose ring on this host names a process that ended without leaving: {rank: pid}.
    Ranks on other hosts have no ring here and are never reported."""
    if _directory is None:
        return {}
    dead = {}
    for rank in ranks:
        head = read_header(ring_path(_directory, rank))
        if head is not None and not head[H_EXITED] and not pid_alive(head[H_PID]):
            dead[rank] = head[H_PID]
    return dead


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie awaiting its reaper counts as gone)."""
    fields = stacks.stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")
