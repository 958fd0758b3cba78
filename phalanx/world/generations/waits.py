"""Waits on collectives that a lost peer cannot hold for ever: bounded, and watched for the step in flight given up.

A peer that left a Gloo collective never sends what this rank waits for, and the collective cannot be aborted: a wait
on it asks, every WATCH_EVERY seconds, whether the step was given up (a member gone, or another rank's exchange
failed), and then abandons it. A collective whose own wait can be neither bounded nor polled is waited for in a
thread of a pool (waited_aside).
"""

from __future__ import annotations

import concurrent.futures
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

from ...errors import PeerDiedError, explain
from .. import group as world
from . import settings
from .current import current
from .settings import WAIT_THREADS, live_recovery

_wait_pool: concurrent.futures.ThreadPoolExecutor | None = None


def step_abandoned() -> bool:
    """Whether the step in flight cannot commit: a member gave it up (its exchange failed), or one is gone. A
    rank waiting on a collective asks this: a peer that gave up will never send what it waits for. One store read
    (watch.py: a counter that a step given up, or a member found gone, adds to)."""
    return current().watch(world.store()).troubled()


_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")


def peer_gone(failure) -> bool:
    """Whether a collective's failure (an exception or its text) says a peer's connection went away: Gloo's
    words for a dead peer."""
    return any(words in str(failure).lower() for words in _PEER_GONE)


def wait_watching(ready, what: str, timeout: float) -> bool:
    """settings.wait_watching, asking step_abandoned(): the current generation's step in flight."""
    return settings.wait_watching(ready, what, timeout, step_abandoned)


def waited_aside(work) -> concurrent.futures.Future:
    """work.wait() in a thread of a pool: for a collective whose own wait can be neither bounded nor polled. Gloo's
    reduce-scatter waits for its peers whatever the timeout given, and says it completed only once waited for;
    Gloo's point-to-point receive unbinds its buffer when a timed wait expires. The caller waits on the future, a
    bounded wait; a wait given up keeps its thread until the collective ends (a peer's failure or its timeout)."""
    global _wait_pool
    if _wait_pool is None:
        _wait_pool = concurrent.futures.ThreadPoolExecutor(max_workers=WAIT_THREADS, thread_name_prefix="phalanx-wait")
    return _wait_pool.submit(work.wait)


def timed_wait(work, aside: bool = False):
    """`wait(seconds)` for `work`: True once it completed, False when `seconds` passed first; raises what
    work.wait() raised otherwise. `aside`: waited in a thread aside (waited_aside), the bound kept here. The step
    guard's waits and watch() share it."""
    waiting = waited_aside(work) if aside else None

    def wait(seconds: float) -> bool:
        try:
            if waiting is not None:
                waiting.result(timeout=max(0.0, seconds))
            else:
                work.wait(timedelta(seconds=max(0.001, seconds)))
            return True
        except concurrent.futures.TimeoutError:
            return False
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            if not work.is_completed():
                return False
            work.wait()  # it completed as the wait gave up (seen in a fresh run): its own outcome, at once
            return True
    return wait


def watch(work, what: str, aside: bool = False) -> None:
    """work.wait() for an asynchronous collective, watched (wait_watching); a failure that says a peer's connection
    went away is PeerDiedError. `aside`: waited aside (waited_aside)."""
    wait = timed_wait(work, aside)

    def done_within(seconds: float) -> bool:
        try:
            return wait(seconds)
        except RuntimeError as exc:
            if not peer_gone(exc):
                raise
            raise PeerDiedError(explain(f"{what} lost a peer", rank=dist.get_rank(), seen=str(exc).splitlines()[0],
                                        expected="every rank of the generation",
                                        fix="The ranks left regroup and go on (live recovery).")) from None
    wait_watching(done_within, what, float("inf"))  # a Gloo collective ends at its group's timeout anyway


def wait_for(work, what: str, aside: bool = False) -> None:
    """work.wait(), watched for a lost peer when live recovery is on (watch; `aside`: see waited_aside)."""
    if live_recovery():
        watch(work, what, aside)
    else:
        work.wait()


def all_gather_bytes(blob: torch.Tensor, group, what: str) -> list[torch.Tensor]:
    """Every rank's `blob` (a uint8 tensor of any length, on the device `group` moves), in the group's rank order; a
    collective: the lengths, then the blobs padded to the longest, each waited for with wait_for (`what` they are)."""
    size = torch.tensor([blob.numel()], dtype=torch.int64, device=blob.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    wait_for(dist.all_gather(sizes, size, group=group, async_op=True), f"the sizes of {what}")
    lengths = [int(n) for n in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=blob.device)
    padded[:blob.numel()] = blob
    blobs = [torch.empty_like(padded) for _ in lengths]
    wait_for(dist.all_gather(blobs, padded, group=group, async_op=True), what)
    return [gathered[:n] for gathered, n in zip(blobs, lengths)]


def all_gather_objects(mine, group, what: str) -> list:
    """Every rank's `mine` (small and picklable), in the group's rank order: dist.all_gather_object's result, its
    waits watched (all_gather_bytes; `what` it is), so that under live recovery a peer lost during it ends it at once
    where dist.all_gather_object waits for the group's timeout. Pickled as dist.all_gather_object does: bytes from the
    ranks of this run, never a file."""
    blob = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8).to(world.collective_device(group))
    return [pickle.loads(gathered.cpu().numpy().tobytes()) for gathered in all_gather_bytes(blob, group, what)]
