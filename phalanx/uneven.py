"""Uneven inputs: the typed error when ranks fall out of step, and the `join()` shadowing.

Without `join()`, a rank that ran out of data stops issuing DDP's collectives. Each DDP collective
carries a step tag (a trailing slot: a mismatch is detected when results come back) and every wait
on one is bounded; on a stall, an error or a tag mismatch the ranks still training meet in the
rendezvous store (only then: the hot path never touches it) to name the ranks that did not arrive.
With `join()`, `DDPJoinHook` makes finished ranks shadow the collectives of the others instead.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from .errors import UnevenInputsError, explain

DEFAULT_STALL_SECONDS = 300.0  # a rank this late in DDP's collectives is reported (PHALANX_DDP_STALL_TIMEOUT)
NAMING_GRACE_SECONDS = 3.0  # how long ranks that detected the problem wait for each other in the store


def stall_seconds() -> float:
    return float(os.environ.get("PHALANX_DDP_STALL_TIMEOUT", DEFAULT_STALL_SECONDS))


class StepGuard:
    """Counts synchronized steps, tags collectives with them, bounds every wait on them."""

    def __init__(self, group, instance: int):
        self.group = group
        self.instance = instance
        self.step = 0  # synchronized steps begun (forward passes with gradient sync on)
        self.enabled = True  # off inside join(): there, finished ranks legitimately lag behind
        self.timeout = stall_seconds()
        self.world_size = group.size()
        self.ranks = dist.get_process_group_ranks(group)

    def tag(self, modulus: int) -> int:
        """This step as a non-zero integer below `modulus` (0 means 'no tag', e.g. inside join)."""
        return self.step % (modulus - 1) + 1 if self.enabled and modulus > 1 else 0

    def wait(self, future, what: str):
        """future.wait(), but a stall past the timeout or a failed collective raises UnevenInputsError."""
        if not future.done():
            arrived = threading.Event()
            future.add_done_callback(lambda _: arrived.set())
            if not arrived.wait(self.timeout):
                self.fail(what, f"no answer within {self.timeout:.0f}s")
        try:
            return future.wait()
        except RuntimeError as exc:  # Gloo: "Connection closed by peer", timeouts, ...
            text = str(exc).strip().splitlines()
            first = text[0].split(". ")[0] if text else type(exc).__name__  # Gloo appends advice; keep the fact
            self.fail(what, f"the collective failed ({first})")

    def wait_work(self, work, what: str) -> None:
        self.wait(work.get_future(), what)

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

    def _absent_ranks(self, me: int) -> list[int] | None:
        """Ranks that did not report being at this step in the store (None when there is no store)."""
        try:
            from . import world

            store = world.store()
        except Exception:  # noqa: BLE001 - a user-made group: no store of ours to ask
            store = None
        if store is None:
            return None
        prefix = f"ddp{self.instance}/step{self.step}"
        store.set(f"{prefix}/{me}", b"1")
        deadline = time.monotonic() + min(NAMING_GRACE_SECONDS, self.timeout)
        while True:
            absent = [r for r in self.ranks if not store.check([f"{prefix}/{r}"])]
            if not absent or time.monotonic() > deadline:
                return absent
            time.sleep(0.05)


class DDPJoinHook(JoinHook):
    """Lets a rank that ran out of data shadow the collectives of the ranks still training.

    Per iteration of the others it mirrors their forward (sync flags, buffer broadcast) and
    backward (one zero bucket per gradient bucket, through the comm hook); once all ranks are done
    the model of the last rank to finish is broadcast, so replicas end identical.
    """

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


def count_active_ranks(join_work) -> int:
    """The number of ranks still training, from the all-reduce Join.notify_join_context launched."""
    value = join_work.get_future().wait()
    tensor = value[0] if isinstance(value, list) else value
    return max(1, int(torch.as_tensor(tensor).item()))
