"""The StepLog's one collective: every rank's rows for a few windows, all-gathered on a Gloo group of its own.

Launched without waiting and read later, when it has long finished: a blocking collective per record
would cost a round trip, and Gloo's thread competes with the step for the cores. Every wait is bounded;
a rank that never arrives is named through the rendezvous store, where each rank notes the gathers it
joined once a wait grows long (the step guard's scheme: nothing is written while all goes well).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..diagnose import recorder, step_clock
from ..errors import PeerFailedError, RanksTimedOutError, explain
from ..world import generation
from ..world import group as world

PRESENCE_AFTER = 1.0  # seconds of waiting before a rank notes in the store that it is there
NAMING_GRACE = 1.0  # how long a rank that timed out waits for the others' notes
DEAD_CHECK_AFTER = 1.0

_instances = 0  # StepLogs made in this process: every rank makes them in the same order


class RowGather:
    """All-gathers float64 rows between the ranks of the default group (see the module docstring); with `group`,
    between `members` (global ranks, in the group's order) on that group, noted in the store under `key`."""

    def __init__(self, fields: int, timeout: float, group=None, members: tuple[int, ...] | None = None,
                 key: str | None = None):
        global _instances
        if key is None:
            _instances += 1
            key = f"steplog{_instances}"
        self.key = key
        self.fields, self.timeout = fields, timeout
        self.members = tuple(members) if members is not None else tuple(range(dist.get_world_size()))
        self.rank, self.world_size = dist.get_rank(), len(self.members)  # its global rank: the store's notes
        self.count = 0  # gathers launched
        self._work, self._outputs, self._count_of_work = None, None, 0
        self.launched: torch.Tensor | None = None  # the rows of the gather in flight
        self._note(f"{self.key}/made")
        if group is not None:
            self.group = group
            return
        try:
            # Gloo on the CPU whatever the training backend: rows read later need no GPU stream sync.
            # Its own timeout a little later than this module's waits, which name the missing ranks.
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout + 5.0))
        except RuntimeError as exc:
            self._fail("could not make its process group (StepLog(...) is made on every rank, at the same point)",
                       f"{self.key}/made", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    @property
    def pending(self) -> bool:
        return self._work is not None

    def launch(self, rows: torch.Tensor) -> None:
        """Start gathering `rows` (k x fields); at most one gather is in flight."""
        self.count += 1
        self._outputs = [torch.empty_like(rows) for _ in range(self.world_size)]
        self._work = self.group.allgather([self._outputs], [rows])
        self._count_of_work, self.launched = self.count, rows

    def result(self, what: str) -> list[torch.Tensor]:
        """The rows of every rank (rank order) of the gather in flight; waits at most `timeout` seconds."""
        work, outputs, count = self._work, self._outputs, self._count_of_work
        self._work = self._outputs = self.launched = None
        if not work.is_completed():
            with step_clock.waiting_for_peers():
                if generation.live_recovery():  # a peer lost (its process, or its host silent) ends the wait
                    generation.wait_for(work, what)
                else:
                    self._wait(work, what)
        try:
            work.wait()
        except Exception as exc:  # Gloo: a peer closed its connection, or its own timeout passed
            dead = recorder.dead_peers(self.members)
            if not dead and "timed out" in str(exc).lower():
                self._fail(f"gathering {what} timed out", f"{self.key}/{count}", "no answer")
            raise PeerFailedError(explain(
                f"StepLog lost a rank while gathering {what}", rank=self.rank,
                seen=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                     + (f"; rank(s) {sorted(dead)} ended" if dead else ""),
                expected="every rank calling log.step() once per step",
                fix="Read the other ranks' logs: one failed, or left the training loop before the others."),
                peer_rank=min(dead) if dead else None) from None
        return outputs

    def _wait(self, work, what: str) -> None:
        started = time.monotonic()
        deadline, presence, dead_check, pause = started + self.timeout, started + PRESENCE_AFTER, started, 0.0002
        key = f"{self.key}/{self._count_of_work}"
        while not work.is_completed():
            now = time.monotonic()
            if presence and now > presence:
                presence = 0.0
                self._note(key)
            if now > dead_check + DEAD_CHECK_AFTER:  # a rank that died will never arrive: say so now
                dead_check = now
                dead = recorder.dead_peers(self.members)
                if dead:
                    raise PeerFailedError(explain(
                        f"StepLog cannot gather {what}", rank=self.rank,
                        seen=f"rank(s) {sorted(dead)} ended (pid {', '.join(map(str, dead.values()))})",
                        expected="every rank alive", fix="Read the dead ranks' logs."), peer_rank=min(dead))
            if now > deadline:
                self._fail(f"gathering {what} timed out after {self.timeout:g}s", key, "no answer")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _note(self, key: str) -> None:
        store = _store()
        if store is not None:
            store.set(f"{key}/{self.rank}", b"1")

    def _fail(self, problem: str, key: str, cause: str):
        store = _store()
        missing = None
        if store is not None:
            self._note(key)
            deadline = time.monotonic() + NAMING_GRACE
            while True:
                missing = [r for r in self.members if not store.check([f"{key}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        who = (f"rank(s) {missing} did not call it" if missing
               else "some rank did not call it (without phalanx's store, it cannot be told which)")
        raise RanksTimedOutError(explain(
            f"StepLog {problem}: {who}", rank=self.rank, seen=cause,
            expected=f"all {self.world_size} ranks calling log.step() at every step (and making the StepLog)",
            fix="Call log.step(loss=..., samples=...) on every rank, not under `if rank == 0:` (it prints and "
                "writes on rank 0 by itself), and the same number of times on each; or the named ranks are "
                "stuck: see their logs. StepLog(timeout=...) sets the bound."),
            missing_ranks=missing or ()) from None


def _store():
    try:
        return world.store() if world.is_initialized() else None
    except Exception:
        return None
