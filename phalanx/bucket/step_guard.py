"""The step guard: DDP's collectives carry a step tag, and every wait on them is bounded.

A rank that falls out of step (it ran out of data, crashed, or took another code path) turns into
`UnevenInputsError` naming the ranks that are missing, never into silently mixed gradients. Only a
wait over a second touches the rendezvous store (the rank notes it is in the step); on a stall,
failure or tag mismatch those notes name the missing ranks. Inside `join()` (engine/join.py) it is off.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from ..diagnose import step_clock
from ..diagnose.watch import DEFAULT_DDP_STALL_SECONDS, ddp_stall_seconds
from ..errors import PeerDiedError, PhalanxError, UnevenInputsError, explain
from ..world import generation

DEFAULT_STALL_SECONDS = DEFAULT_DDP_STALL_SECONDS  # a rank this late in DDP's collectives is reported
PRESENCE_AFTER_SECONDS = 1.0  # a wait this long is unusual: note in the store that this rank is in the step
NAMING_GRACE_SECONDS = 1.0  # how long a rank that detected the problem waits for the others' notes


stall_seconds = ddp_stall_seconds  # PHALANX_DDP_STALL_TIMEOUT


class StepGuard:
    """Counts synchronized steps, tags collectives with them, bounds every wait on them."""

    def __init__(self, group, instance: int):
        self.group = group
        self.instance = instance
        # Steps that issued collectives (a buffer broadcast or gradient buckets). Counting forwards
        # instead would let ranks that ran different numbers of validation forwards disagree.
        self.step = 0
        self.open = False  # the current step has issued a collective and not finalized yet
        self.enabled = True  # off inside join(): there, finished ranks legitimately lag behind
        self.timeout = stall_seconds()
        # NCCL: a timed wait would block the CPU on the GPU stream; NCCL's watchdog bounds hangs there.
        self.bounded = dist.get_backend(group) != "nccl"
        self.world_size = group.size()
        self.ranks = dist.get_process_group_ranks(group)
        self._moduli: dict = {}  # dtype -> tag_modulus(dtype, world_size)

    def begin(self) -> None:
        """Called before a step's first collective (idempotent within the step)."""
        if not self.open:
            self.step += 1
            self.open = True

    def end(self) -> None:
        self.open = False

    def reads_back(self, device: torch.device) -> bool:
        """Whether a check may read a tag of `device` back on the host: free on the CPU; on a GPU the read
        would wait for every kernel queued before it, so a step there checks no tag and keeps running ahead
        (tests/ranks/test_ddp_host_sync.py)."""
        return device.type == "cpu"

    def tag(self, modulus: int) -> int:
        """This step as a non-zero integer below `modulus` (0 means 'no tag', e.g. inside join)."""
        return self.step % (modulus - 1) + 1 if self.enabled and modulus > 1 else 0

    def wait_until(self, ready, what: str) -> None:
        """Return once `ready(seconds)` (a wait of at most that long) says True; a stall past the timeout
        raises UnevenInputsError naming the ranks that are missing. The time counts as waiting for peers."""
        started = step_clock.now_ns()
        try:
            self._wait_until(ready, what)
        finally:
            step_clock.add_exchange_wait(step_clock.now_ns() - started)

    def _wait_until(self, ready, what: str) -> None:
        if generation.live_recovery():
            self._wait_watching(ready, what)
            return
        if ready(min(PRESENCE_AFTER_SECONDS, self.timeout)):
            return
        # Slow, so the store round trip costs nothing noticeable; should this end in an error, the
        # ranks that fail later know this one was here.
        self._note_presence()
        if not ready(max(0.0, self.timeout - PRESENCE_AFTER_SECONDS)):
            self.fail(what, f"no answer within {self.timeout:.0f}s")

    def _wait_watching(self, ready, what: str) -> None:
        """_wait_until with live recovery: generation.wait_watching gives up a step another rank gave up."""
        if not generation.wait_watching(ready, f"{what} of DDP step {self.step}", self.timeout):
            self.fail(what, f"no answer within {self.timeout:.0f}s")

    def wait(self, future, what: str):
        """future.wait(), but a stall past the timeout or a failed collective raises UnevenInputsError.
        The time counts as waiting for peers (StepLog's busy time leaves it out)."""
        started = step_clock.now_ns()
        try:
            return self._wait(future, what)
        finally:
            step_clock.add_exchange_wait(step_clock.now_ns() - started)

    def _wait(self, future, what: str):
        if self.bounded and not future.done():
            arrived = threading.Event()
            future.add_done_callback(lambda _: arrived.set())
            self._wait_until(arrived.wait, what)
        try:
            return future.wait()
        except PhalanxError:  # already typed and precise (e.g. the shared-memory transport's PeerDiedError)
            raise
        except RuntimeError as exc:  # Gloo: "Connection closed by peer", timeouts, ...
            self.fail(what, _failure(exc))

    def wait_work(self, work, what: str, aside: bool = False) -> None:
        """work.wait() with the same bounds as wait(): the timed wait is C++'s, no Python callback. `aside`: for
        a work whose own wait cannot be bounded (Gloo's reduce-scatter), waited in a thread aside under live
        recovery (generation.waited_aside), while this one keeps the bounds and watches for a loss."""
        started = step_clock.now_ns()
        try:
            self._wait_work(work, what, aside)
        finally:
            step_clock.add_exchange_wait(step_clock.now_ns() - started)

    def _wait_work(self, work, what: str, aside: bool) -> None:
        if not self.bounded:
            work.wait()
            return

        # Aside under live recovery only: that wait's blocking is what a run without it has always done.
        wait = generation.timed_wait(work, aside and generation.live_recovery())

        def done_within(seconds: float) -> bool:
            try:
                return wait(seconds)
            except RuntimeError as exc:
                self.fail(what, _failure(exc))
        self._wait_until(done_within, what)

    def tag_for(self, dtype: torch.dtype) -> int:
        """This step's tag for a slot of `dtype` that is summed over the ranks."""
        modulus = self._moduli.get(dtype)
        if modulus is None:
            modulus = self._moduli[dtype] = tag_modulus(dtype, self.world_size)
        return self.tag(modulus)

    def check_tag_sum(self, seen: float, dtype: torch.dtype, what: str) -> None:
        """A slot of `dtype` tagged with tag_for(dtype) on every rank, then summed, must hold world_size tags."""
        self.check_sum(seen, self.tag_for(dtype), what)

    def check_sum(self, seen: float, own: int, what: str) -> None:
        """An all-reduced tag must be world_size times this rank's own tag."""
        if self.enabled and own and seen != own * self.world_size:
            self.fail(what, f"its step tags summed to {seen:g} instead of {own * self.world_size} "
                            f"(another rank was at a different step or in a different collective)")

    def check_equal(self, seen: int, own: int, what: str) -> None:
        """A broadcast tag must equal this rank's own tag."""
        if self.enabled and seen != own:
            self.fail(what, f"the sender was at a different step (tag {seen}, this rank's {own})")

    def fail(self, what: str, cause: str):
        me = dist.get_rank()
        if generation.peer_gone(cause) and generation.live_recovery():  # a loss the ranks left recover from
            raise PeerDiedError(explain(
                f"{what} of DDP step {self.step} lost a peer", rank=me, seen=cause,
                expected=f"all {self.world_size} ranks in step {self.step}",
                fix="A rank's process ended (killed, out of memory) or its host went away: its log and the "
                    "launcher's exit codes say which."))
        missing = self._absent_ranks(me)
        who = (f"ranks {missing} did not take part" if missing
               else "another rank was not in step (could not ask the store which)")
        raise UnevenInputsError(explain(
            f"{what} of DDP step {self.step} did not complete: {who}", rank=me,
            seen=f"{cause}; every rank completed step {self.step - 1} together",
            expected=f"all {self.world_size} ranks in step {self.step}",
            fix="If ranks have different numbers of batches, wrap the training loop in `with model.join():` "
                "or give every rank the same number of batches (phalanx.data's sampler does); otherwise read the "
                "named ranks' logs: they crashed, hang, or took a different code path. "
                "PHALANX_DDP_STALL_TIMEOUT sets how long to wait."),
            step=self.step, missing_ranks=missing or ()) from None

    def _store(self):
        try:
            from ..world import group as world

            return world.store()
        except Exception:
            return None

    def _presence_key(self, rank: int) -> str:
        return f"ddp{self.instance}/step{self.step}/{rank}"

    def _note_presence(self) -> None:
        store = self._store()
        if store is not None:
            store.set(self._presence_key(dist.get_rank()), b"1")

    def _absent_ranks(self, me: int) -> list[int] | None:
        """Ranks that did not note being at this step in the store (None when there is no store)."""
        store = self._store()
        if store is None:
            return None
        store.set(self._presence_key(me), b"1")
        deadline = time.monotonic() + min(NAMING_GRACE_SECONDS, self.timeout)
        while True:
            absent = [r for r in self.ranks if not store.check([self._presence_key(r)])]
            if not absent or time.monotonic() > deadline:
                return absent
            time.sleep(0.05)


def tag_modulus(dtype: torch.dtype, world_size: int = 1) -> int:
    """Largest modulus m such that tags in [1, m] summed over world_size ranks stay exact in dtype."""
    if dtype.is_floating_point:
        exact = int(2 / torch.finfo(dtype).eps)  # every integer up to this is representable
    elif dtype == torch.bool:
        return 1
    else:
        exact = 2 ** (torch.iinfo(dtype).bits - 2)
    return max(1, min(exact // max(1, world_size), 2 ** 30))


def _failure(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    first = text[0].split(". ")[0] if text else type(exc).__name__  # Gloo appends advice; keep the fact
    return f"the collective failed ({first})"
