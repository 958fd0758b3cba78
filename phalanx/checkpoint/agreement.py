"""Every rank learns at the same step whether to stop: an all-reduce of the ranks' flags, read later.

A blocking all-reduce per step would cost a round trip on every step. Instead each agreement is
launched asynchronously (on a Gloo group of its own, so a GPU run never syncs its stream for it) and
read `every` steps later, when it is long finished: the answer, "some rank was asked to stop", is the
same on every rank and read at the same step count, so all ranks save at that step. The payload also
carries each rank's proposal for the next `every`, so that agreements come about INTERVAL seconds
apart whatever a step takes, and every rank adopts the same value. A stop request is acted on within
two intervals (plus a step); with INTERVAL = 0 the ranks agree at every step.

Under live recovery the same agreement carries the number of ranks waiting to join the run (world/joining.py),
as the first rank read it from the store: every rank learns at the same step that they are to be taken in.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..diagnose import recorder
from ..errors import PeerFailedError, RanksTimedOutError, explain, seconds_setting
from ..world import generation, joining, stop
from ..world import group as world

# Seconds between agreements: a stop is acted on within about twice this (plus a step). Measured on the
# 2-core bench machine, one agreement costs 50-110 us of the main thread and 100-250 us of Gloo's; 0.5 s
# apart keeps the cost per step at 0.1-0.2 % of the bench models' steps, one per step cost up to 1.8 %.
DEFAULT_INTERVAL = 0.5
MAX_EVERY = 10_000
DEAD_CHECK_AFTER = 1.0


def interval() -> float:
    raw = os.environ.get("PHALANX_STOP_INTERVAL")
    if raw is None:
        return DEFAULT_INTERVAL
    return seconds_setting(raw, "PHALANX_STOP_INTERVAL is not a number of seconds",
                           expected="seconds >= 0 between the ranks' agreements on a stop, e.g. 0.2",
                           fix="Fix or unset PHALANX_STOP_INTERVAL.")


def next_every(step_seconds: float, target: float) -> int:
    """Steps between agreements so that they come `target` seconds apart (at least 1).

    >>> next_every(0.013, 0.2), next_every(2.0, 0.2), next_every(0.013, 0.0)
    (15, 1, 1)
    """
    if target <= 0 or step_seconds <= 0:
        return 1
    return max(1, min(MAX_EVERY, int(target / step_seconds)))


class StopAgreement:
    """Call `at_step()` once per step on every rank; it returns True on every rank at the same step."""

    def __init__(self, timeout: float | None = None):
        self.target = interval()
        self.timeout = timeout
        self.count = 0  # steps seen
        self.group = None
        self.work = None
        self.payload = torch.zeros(3, dtype=torch.int64)
        self.values = self.payload.numpy()  # written and read without a torch call each
        self.options = dist.AllreduceOptions()
        # MAX of the flags: any rank's request stops them all; MAX of minus the proposals: the smallest one; MAX of
        # the joiners waiting: the first rank's count (the others say 0).
        self.options.reduceOp = dist.ReduceOp.MAX
        self.due = 0  # the step at which the pending agreement is read
        self.every = 1  # agreed: steps between agreements
        self.launched_at = (0, 0.0)  # (count, time) of the last launch, for the next proposal
        self.agreed = False
        self.joiners_due = False  # ranks wait to join: the ranks take them in at this step (checkpointer.step())
        self.world_size = world.group_size()  # asked once: torch's get_world_size() costs ~20 us a call
        # Only the first rank reads the store, under live recovery: a count of joiners, not a collective.
        self.reads_joiners = (generation.live_recovery() and world.group_rank() == 0 and world.store() is not None
                              and joining.refused() is None)
        self._looked_at = time.monotonic()
        # The ranks that train when it is made: after a loss (live recovery) the Checkpointer makes a new one.
        self.generation, self.members = world.live_generation(), world.live_members()

    def at_step(self) -> bool:
        self.count += 1
        if self.agreed:
            return True
        if self.world_size == 1:  # nobody to agree with: act on this process's own flag
            self.agreed = stop.requested() is not None
            if not self.agreed and self.reads_joiners and time.monotonic() > self._looked_at + self.target:
                self._looked_at = time.monotonic()
                self.joiners_due = joining.waiting(world.store()) > 0
            return self.agreed
        if self.work is None:
            self._launch(proposal=1)
            return False
        if self.count < self.due:
            return False
        flag, minus_every, joiners = self._result()
        if flag:
            self.agreed = True
            stop.request(stop.reason_of(flag))  # a rank that was not asked learns why the others stop
            return True
        if joiners:
            self.joiners_due = True  # taken in at this step; the next generation makes its own agreement
            return False
        self.every = max(1, -minus_every)
        count, then = self.launched_at
        self._launch(next_every((time.monotonic() - then) / max(1, self.count - count), self.target))
        return False

    def resume(self) -> None:
        """The joiners counted were not there to take in after all: agree on as before."""
        self.joiners_due = False
        if self.world_size > 1:
            self._launch(proposal=self.every)

    def _launch(self, proposal: int) -> None:
        if self.group is None:
            # Gloo on the CPU whatever the main backend: a flag read later needs no stream sync. The world's
            # control group (made with the generation, not in a step); outside phalanx's init() every rank
            # makes one at its first step, the same point of its collective order.
            self.group = world.control_group()
            if self.group is None:
                self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self._limit()))
        self.values[0], self.values[1] = stop.code_of(stop.requested()), -proposal
        self.values[2] = joining.waiting(world.store()) if self.reads_joiners else 0
        # The group's own call: dist.all_reduce's checks cost more than the collective's launch (~70 vs 40 us).
        self.work = self.group.allreduce([self.payload], self.options)
        self.due = self.count + self.every
        self.launched_at = (self.count, time.monotonic())

    def _limit(self) -> float:
        if self.timeout is not None:
            return float(self.timeout)
        return float(os.environ.get("PHALANX_TIMEOUT", 600))

    def _result(self) -> tuple[int, int, int]:
        """The pending agreement's answer; it finished long ago unless a rank fell behind or left."""
        work = self.work
        if not work.is_completed():
            self._wait(work)
        try:
            work.wait()
        except Exception as exc:  # Gloo: a peer closed its connection, or the group's own timeout passed
            dead = recorder.dead_peers(self.members)
            if not dead and "timed out" in str(exc).lower():
                raise self._timed_out() from None
            raise PeerFailedError(explain(
                "the ranks' agreement on a stop lost a rank", rank=world.group_rank(),
                seen=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                     + (f"; rank(s) {sorted(dead)} ended" if dead else ""),
                expected="every rank calling checkpointer.step() once per step",
                fix="Read the other ranks' logs: one failed, or left the training loop before the others."),
                peer_rank=min(dead) if dead else None) from None
        return int(self.values[0]), int(self.values[1]), int(self.values[2])

    def _wait(self, work) -> None:
        limit = self._limit()
        started = time.monotonic()
        deadline, dead_check, pause = started + limit, started + DEAD_CHECK_AFTER, 0.0002
        while not work.is_completed():
            now = time.monotonic()
            if now > dead_check:  # a rank that died will never arrive: say so now, not at the deadline
                dead_check = now + 0.5
                dead = recorder.dead_peers(self.members)
                if dead:
                    raise PeerFailedError(explain(
                        "the ranks' agreement on a stop cannot complete", rank=world.group_rank(),
                        seen=f"rank(s) {sorted(dead)} ended (pid {', '.join(map(str, dead.values()))})",
                        expected="every rank alive", fix="Read the dead ranks' logs."), peer_rank=min(dead))
            if now > deadline:
                raise self._timed_out()
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _timed_out(self) -> RanksTimedOutError:
        return RanksTimedOutError(explain(
            f"the ranks' agreement on a stop timed out after {self._limit():.0f}s", rank=world.group_rank(),
            seen=f"step {self.count}: some rank did not reach step {self.due - self.every}",
            expected="every rank calling checkpointer.step() once per step",
            fix="A rank is stuck, or calls checkpointer.step() fewer times than the others (every rank "
                "must make the same number of steps)."))
