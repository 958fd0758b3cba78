"""A stop request reaching this process: SIGTERM, SIGINT or SIGUSR1, kept as a flag until a step boundary.

Schedulers announce the end of a job with a signal (SLURM's SIGTERM or `--signal=USR1`, Kubernetes'
SIGTERM), and `phalanx run` passes its own on as SIGTERM. `init()` installs the handlers. While the
process *listens* (it made a `Checkpointer(every=...)`, or called `checkpointer.step()` or
`stop_requested()`), a signal only sets the flag: `checkpointer.step()` then saves at a step every rank
agrees on (checkpoint/agreement.py) and ends the process with STOP_EXIT_CODE. A process that does not
listen ends as the signal would have ended it without phalanx (or runs the handler it had before), so a
script that never saves at a stop never keeps its launcher waiting. A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from ..log import logger

# sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to retry": every step is saved,
# and the same command resumes. Distinct from 0 (finished), 1 (failed) and 128+N (killed by signal N).
STOP_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_requested: str | None = None  # the signal's name ("SIGTERM"), or who asked
_requested_at = 0.0
_listening = False
_stopping = False  # the agreed stop is under way: later signals change nothing
_owner = 0  # the pid that installed the handlers: a forked child (a DataLoader worker) is not asked
_previous: dict = {}
_teardown = None  # () -> bool: the launcher is tearing the group down (a failure elsewhere): die at once
_group = None  # Gloo group of stop_requested(agree=True) in a world phalanx did not make
# process/live.py's: (how many ranks train now, their control group) once init() ran, else None. After a loss (live
# recovery) the agreement is among the ranks left, never on torch's default group.
ranks_that_train = None


class RunStopped(SystemExit):
    """Raised by `checkpointer.step()` on every rank once the agreed checkpoint is saved.

    It is a SystemExit: uncaught, the process ends quietly with STOP_EXIT_CODE (75), which tells
    `phalanx run` (and a batch script) that every step is saved and the same command resumes. Catch
    it to run code of your own before leaving; the process group is already shut down by then.
    """

    def __init__(self, step: int, path, reason: str, save_seconds: float):
        super().__init__(STOP_EXIT_CODE)
        self.step, self.path, self.reason, self.save_seconds = step, path, reason, save_seconds

    def __str__(self) -> str:
        return (f"stopped at step {self.step} on request ({self.reason}); checkpoint {self.path} saved in "
                f"{self.save_seconds:.1f} s; run the same command to resume")


def install(teardown=None) -> None:
    """Handle SIGTERM, SIGINT and SIGUSR1 from now on (main thread only; elsewhere a no-op). Idempotent.

    `teardown`: asked on each signal; True means the launcher is stopping the group for a failure, and
    the signal must end the process now, listening or not."""
    global _owner, _teardown
    if threading.current_thread() is not threading.main_thread():
        return
    _teardown = teardown
    if _owner == os.getpid():
        return
    _owner = os.getpid()
    for signum in SIGNALS:
        previous = signal.signal(signum, _on_signal)
        if previous is not _on_signal:
            _previous[signum] = previous


def listen() -> None:
    """Declare that this process acts on a stop request at its next step boundary."""
    global _listening
    _listening = True


def stop_listening() -> None:
    """After shutdown() nobody reads the flag: signals end the process again as they would without phalanx."""
    global _listening, _group
    _listening, _group = False, None


def listening() -> bool:
    return _listening


def request(reason: str) -> None:
    """Ask for a stop, as a signal does (the first request is kept)."""
    global _requested, _requested_at
    if _requested is None:
        _requested, _requested_at = reason, time.monotonic()


def requested() -> str | None:
    """Why a stop was requested of this process (e.g. "SIGTERM"), or None."""
    return _requested


def code_of(reason: str | None) -> int:
    """A request as a number the ranks can all-reduce: its signal number, 1 for another reason, 0 for none."""
    if reason is None:
        return 0
    return int(getattr(signal, reason, 1)) if reason.startswith("SIG") else 1


def reason_of(code: int) -> str:
    try:
        return signal.Signals(code).name if code > 1 else "requested"
    except ValueError:
        return "requested"


def requested_at() -> float:
    return _requested_at


def stopping() -> None:
    """The agreed stop is under way (saved, leaving): further signals are ignored, a second Ctrl-C aside."""
    global _stopping
    _stopping = True
    if threading.current_thread() is threading.main_thread():
        # Ignored by the kernel, not by a Python handler: Python puts the default actions back while the
        # interpreter finalizes, and a late SIGTERM (a launcher passing a request on) would then kill it.
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)


def stop_requested(agree: bool = False) -> bool:
    """True once a stop was requested of this rank: a signal, its launcher, or another rank through the agreement.

    A flag read, no collective: call it as often as you like, e.g. to leave an evaluation early. Ranks may
    learn it a moment apart (under `phalanx run`, within about a tenth of a second); the step at which
    every rank saves is agreed by `checkpointer.step()` all the same. Where every rank must leave at the
    same iteration (an evaluation under shard="parameters", whose forward is collective), pass
    `agree=True`: every rank must then call it together, and it answers the same on all of them (one
    blocking all-reduce of a flag per call).

    >>> import phalanx as px
    >>> px.stop_requested()
    False
    """
    global _group
    listen()
    training = ranks_that_train() if ranks_that_train is not None and dist.is_initialized() else None
    size, group = training if training is not None else (dist.get_world_size() if dist.is_initialized() else 1, None)
    if not agree or size == 1:
        return _requested is not None
    if group is None:
        if _group is None:  # every rank's first call is at the same point: it is a collective
            _group = dist.new_group(backend="gloo")
        group = _group
    flag = torch.tensor([code_of(_requested)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag):
        request(reason_of(int(flag)))
    return _requested is not None


def reset() -> None:
    """Forget a request (tests, and a process that starts a new run after a stop)."""
    global _requested, _requested_at, _stopping
    _requested, _requested_at, _stopping = None, 0.0, False


def _on_signal(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if os.getpid() != _owner or (_teardown is not None and _teardown()):
        return _as_without_us(signum, frame)
    if signum == signal.SIGINT and (_requested is not None or _stopping):
        raise KeyboardInterrupt  # the second Ctrl-C: now, whatever is running
    if _stopping:
        return
    if not _listening:
        return _as_without_us(signum, frame)
    if _requested is None:
        request(name)
        # INFO: rank 0 says it (every rank hears it from `phalanx run`); the agreed stop is logged anyway.
        logger.info("%s: a stop is requested; saving at the next step all ranks agree on, then exiting with code %d",
                    name, STOP_EXIT_CODE)


def _as_without_us(signum: int, frame) -> None:
    """What the signal would have done had phalanx not been there: the earlier handler, else the default."""
    previous = _previous.get(signum)
    if previous is None:  # installed outside Python, or never: the default
        previous = signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # the signal is delivered before this returns; never fall through alive
