"""What `phalanx run` does with SIGTERM, SIGINT and SIGUSR1: it asks the workers to stop; it doesn't kill them.

The first signal is passed on to this node's workers as SIGTERM, which a worker that calls
`checkpointer.step()` turns into one save at a step every rank agrees on, then exit code 75. It is also
written into the rendezvous store, where the other nodes' launchers look every half second and ask
their own workers, so a stop sent to one node reaches every rank even before the workers' own
agreement spreads it. `--grace-period` bounds the wait; then what is left is killed. A second Ctrl-C
kills at once. Before any worker runs (the rendezvous, a restart) there is nothing to ask and nothing
to save: the launcher stops there and then.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from torch.distributed.elastic.multiprocessing.api import SignalException

from ..world.stop import STOP_EXIT_CODE

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
FORWARDED = signal.SIGTERM  # what schedulers send, and what a worker without phalanx dies of
STORE_KEY = "phalanx/stop"
STORE_POLL = 0.5  # seconds between this launcher's looks for a stop asked on another node
PUBLISH_WAIT = 0.3  # seconds a launcher whose workers stopped on their own waits for another node's request to show
DEFAULT_GRACE_PERIOD = 30.0  # torchrun's and Kubernetes' default


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


class StoppedBeforeStart(SignalException):
    """A stop request while no worker runs (rendezvous, between attempts): nothing to save, stop now."""


class GraceExpired(SignalException):
    """The workers did not stop within --grace-period: they are killed."""


class StopRequest:
    """This launcher's view of a stop: asked when and by what, told to which workers, and the deadline.

    `ask(sig, origin)` is the one way a stop starts (this node's signal, another node's through the store);
    what follows the workers' exit is the agent's to decide (today the run ends; a group that grows at a
    step boundary would restart instead)."""

    def __init__(self, grace_period: float, node_rank: int):
        self.grace_period, self.node_rank = grace_period, node_rank
        self.signal: signal.Signals | None = None  # the signal that asked (this node's, or another node's)
        self.origin = ""  # "" on this node, else e.g. " on node 1"
        self.since = 0.0
        self.kill_now = False  # a second Ctrl-C, or the grace period ran out: SIGKILL what is left
        self.pids: set[int] = set()  # this node's running workers (empty while none runs)
        # Workers being started: a request now is kept and passed on once their pids are known (a forked
        # worker can ask for a stop before torch's start of the group has returned them).
        self.starting = False
        self.told: set[int] = set()
        self.store = None
        self.published = False
        self._next_look = 0.0
        self._me = f"{os.getpid()}@{socket.gethostname()}"  # tells this launcher's own entry in the store apart

    @property
    def active(self) -> bool:
        return self.signal is not None

    def install(self) -> None:
        """Take SIGTERM, SIGINT and SIGUSR1 over (again: torch's agent installs its own when it starts workers)."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        sig = signal.Signals(signum)
        if self.signal is None:
            if not self.pids and not self.starting:
                self.signal, self.since = sig, time.monotonic()
                raise StoppedBeforeStart(f"stop requested by {sig.name} while no worker runs", sig)
            self.ask(sig, "")  # at once; the store is written from the monitor loop
        elif sig == signal.SIGINT:
            self.kill_now = True
            _say("second Ctrl-C: stopping the workers now.")
            raise SignalException("second Ctrl-C", sig)
        else:
            _say(f"{sig.name}: already stopping ({time.monotonic() - self.since:.1f} s of the "
                 f"{self.grace_period:g} s grace period gone).")

    def ask(self, sig: signal.Signals, origin: str) -> None:
        """Start a stop: say so, and pass it on to this node's workers (the grace period starts now)."""
        self.signal, self.origin, self.since = sig, origin, time.monotonic()
        _say(f"{sig.name}{origin}: asking the workers to save at a step they agree on and stop "
             f"(--grace-period {self.grace_period:g} s; Ctrl-C again to stop at once).")
        self._tell_workers()

    def adopt(self) -> None:
        """The workers are stopping on a request this launcher did not get (another node's, or one sent to a
        worker directly): the grace period starts now, and the group is not restarted. The workers' own
        agreement can outrun this launcher's next look in the store: look once more, so that another node's
        request is named as such."""
        if self.signal is not None:
            return
        asked = self._asked_in_store()
        deadline = time.monotonic() + PUBLISH_WAIT
        while asked is None and self.store is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the asking launcher publishes at its next monitor tick, after its workers heard
            asked = self._asked_in_store()
        if asked is not None:
            self.signal, self.origin, self.since = asked[0], asked[1], time.monotonic()
        else:
            self.signal, self.origin, self.since = signal.SIGTERM, " to a worker or another node", time.monotonic()

    # -- the workers of one attempt ---------------------------------------------------------------

    def workers_started(self, pids, store, node_rank: int) -> None:
        """A new attempt's workers run; `node_rank` is this node's rank in the rendezvous (elastic ones assign it).
        A request that came while they started is passed on to them now."""
        self.pids, self.told, self.store, self.node_rank = set(pids), set(), store, node_rank
        self.starting = False
        if self.signal is not None:
            self._tell_workers()

    def moved(self, store, node_rank: int) -> None:
        """The nodes met in a new round while the workers went on (a node joined them): its store, this node's rank."""
        self.store, self.node_rank = store, node_rank

    def workers_stopped(self) -> None:
        self.pids = set()

    def tick(self) -> None:
        """From the agent's monitor loop: pass the request on, look for one from another node, watch the clock."""
        now = time.monotonic()
        if self.signal is None and self.store is not None and now >= self._next_look:
            self._next_look = now + STORE_POLL
            self._look_in_store()
        if self.signal is None:
            return
        self._tell_workers()
        if not self.published and self.store is not None and not self.origin:
            self.published = True
            try:
                self.store.set(STORE_KEY, f"{self.signal.name} {self.node_rank} {self._me}")
            except Exception:  # the store's host is gone: its workers will spread the request anyway
                pass
        if now > self.since + self.grace_period:
            self.kill_now = True
            raise GraceExpired(f"the workers did not stop within --grace-period {self.grace_period:g} s", self.signal)

    def _look_in_store(self) -> None:
        asked = self._asked_in_store()
        if asked is not None:
            self.ask(*asked)

    def _asked_in_store(self) -> tuple[signal.Signals, str] | None:
        """(signal, origin) of a stop another node's launcher published in the store, else None."""
        if self.store is None:
            return None
        try:
            if not self.store.check([STORE_KEY]):
                return None
            name, node, who = self.store.get(STORE_KEY).decode().split()
        except Exception:  # unreadable, or the store's host is gone: nothing to act on
            return None
        if who == self._me:
            return None
        return getattr(signal.Signals, name, signal.SIGTERM), f" on node {node}"

    def _tell_workers(self) -> None:
        for pid in self.pids - self.told:
            try:
                os.kill(pid, FORWARDED)
            except (ProcessLookupError, PermissionError):
                pass
            self.told.add(pid)


def _describe(sig, origin: str) -> str:
    return f"{sig.name}{origin}" if sig is not None else "a request"


def stop_report(stop: StopRequest, records: dict, ended_by_signal: dict) -> tuple[int, list[str]]:
    """The exit code and the lines that say how a stop ended, from this node's workers' records.

    `records`: global rank -> diagnose.progress.Progress of this node's workers in the last attempt;
    `ended_by_signal`: global rank -> exit code of those that did not exit by themselves with code 75.
    """
    why = _describe(stop.signal, stop.origin)
    agreed = next((e.get("reason") for r in records.values() if (e := r.last("stopped"))), None)
    if agreed and stop.origin.startswith(" to a worker"):
        why = f"{agreed} to a worker or another node"
    waited = time.monotonic() - stop.since if stop.since else 0.0
    signum = int(stop.signal) if stop.signal is not None else int(signal.SIGTERM)
    stopped = {rank: r for rank, r in records.items() if r.stop_step >= 0}
    # A worker that saved and was on its way out when a signal came late still stopped cleanly.
    ended_by_signal = {rank: code for rank, code in ended_by_signal.items() if rank not in stopped}
    if records and len(stopped) == len(records) and not ended_by_signal:
        first = stopped[min(stopped)]
        event = first.last("stopped") or {}
        steps = {r.stop_step for r in stopped.values()}
        step = first.stop_step if len(steps) == 1 else f"{min(steps)}..{max(steps)} (ranks disagree!)"
        return STOP_EXIT_CODE, [
            f"stopped at step {step} on request ({why}), {waited:.1f} s after it; checkpoint {event.get('path')} "
            f"saved in {event.get('seconds', 0.0):.1f} s; run the same command to resume."]
    if stop.kill_now and not stopped:
        lost = stop_lost(records)
        return 128 + signum, [
            f"the workers did not stop within --grace-period {stop.grace_period:g} s of the request ({why}); "
            f"they were killed{lost}."]
    if records and not any(r.ready for r in records.values()):
        return STOP_EXIT_CODE, [f"stopped on request ({why}) while the workers were starting (in phalanx.init()): "
                                f"nothing to save; run the same command to resume."]
    training = [r for r in records.values() if r.loop_start]
    if training and all(r.steps_unsaved == 0 for r in training):
        step = max(r.step for r in training)
        return STOP_EXIT_CODE, [f"stopped on request ({why}) before any step since the checkpoint at step {step} "
                                f"(during a restore or before the first step): nothing to save; run the same "
                                f"command to resume."]
    if training:
        lost = stop_lost(records)
        return 128 + signum, [f"stopped by {why}; the workers were stopped too{lost}. To save at the stop, call "
                              f"checkpointer.step(state) once per step (docs/checkpoints.md)."]
    return 128 + signum, [f"stopped by {why}; the workers were stopped too."]


def stop_lost(records: dict) -> str:
    """'; the newest checkpoint is at step 200: the 90 step(s) after it are lost', from the workers' records."""
    training = [r for r in records.values() if r.loop_start]
    if not training:
        return ""
    newest = max(r.saved_step for r in training)
    lost = max(r.steps_unsaved for r in training)
    if newest < 0:
        return f"; nothing was saved: the {lost} step(s) trained are lost"
    return f"; the newest checkpoint is at step {newest}: the {lost} step(s) after it are lost"


def interruptible(fn):
    """`fn()` in a helper thread, while this (main) thread keeps handling signals: a C++ wait (for node 0's
    store, say) would hold a Python signal handler back until it returns."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: B902 - handed to the caller as is
            box["error"] = exc

    thread = threading.Thread(target=target, name="phalanx-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]
