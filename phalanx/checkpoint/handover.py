"""The state handed to ranks that join a run in progress, by the ranks that train, over the network: no disk.

What a checkpoint would hold (world/joining.py takes the joiners in; the Checkpointer hands over at that step):
the model's and optimizer's state dicts, the loader's position and the user's other entries, and a random
stream of the joiner's own, derived from the first rank's as a restore at a larger world derives one. Data
parallelism keeps every replica's state bitwise equal after each step, so the tensors' bytes are cut into one
stripe per rank that trains, each sent by that rank: a joiner receives from all of them at once, and the
transfer takes about the state's size over the joiners' link, not over one sender's. The layout (the
entries with their tensors left empty, their shapes, the step count) comes from the first rank, serialized
with torch.save and loaded with weights_only=True like a checkpoint file. Replicas that differ between hosts
(DiLoCo in mid-period) are handed over by the first rank alone, whole. A sharded optimizer's state is on no
rank whole: its entry holds the param groups and the layout only (ShardedOptimizer.handover_state_dict), and the
regroup that takes the joiners in cuts the state for them.
Both ends of it are here: `take_in_joiners` on the ranks that train (Checkpointer.step(), at a step their stop
agreement counted joiners at) and `join_the_run` in a joiner's Checkpointer.restore(), each regrouping onto
the larger generation around send() and receive().
"""

from __future__ import annotations

import io
import time

import torch
import torch.distributed as dist

from ..diagnose import progress
from ..errors import CheckpointError, explain
from ..log import logger
from ..world import generation, step_count
from ..world import group as world
from . import random_state, restoring
from .entries import check_plain, differs_across_hosts, kind_of, unwrap

FORMAT = 1
_HEADER, _LAYOUT, _STRIPE = 1, 2, 3  # point-to-point tags: each message matched to its own receive


def _entries(state: dict) -> dict:
    """The state as a checkpoint's entries (unsharded: every rank holds all of it)."""
    entries = {}
    for name, value in state.items():
        kind = kind_of(name, value)
        if kind == "value":
            saved = value
        else:
            # A sharded optimizer hands over its layout only: the regroup that takes the joiners in cuts its state.
            saved = unwrap(value).state_dict() if kind == "model" else \
                getattr(value, "handover_state_dict", value.state_dict)()
            check_plain(saved, f"state[{name!r}].state_dict()")
        entries[name] = {"kind": kind, "state": saved, "sharded": False}
    return entries


def _hollow(value, tensors: list):
    """`value` with each tensor replaced by an empty one of its dtype (the tensors listed in walk order)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return torch.empty(0, dtype=value.dtype)
    if isinstance(value, dict):
        return type(value)((k, _hollow(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_hollow(v, tensors) for v in value)
    return value


def _filled(value, tensors):
    """The inverse of _hollow: each empty tensor replaced by the next of `tensors` (an iterator)."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, dict):
        return type(value)((k, _filled(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_filled(v, tensors) for v in value)
    return value


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _stripes(total: int, senders: int) -> list[tuple[int, int]]:
    """[start, end) of each sender's stripe of `total` bytes.

    >>> _stripes(10, 3)
    [(0, 3), (3, 6), (6, 10)]
    """
    return [(total * i // senders, total * (i + 1) // senders) for i in range(senders)]


def _stripe_of(tensors: list, start: int, end: int, device: torch.device) -> torch.Tensor:
    """Bytes [start, end) of the tensors laid end to end, copied into one buffer."""
    buffer = torch.empty(end - start, dtype=torch.uint8, device=device)
    offset = 0
    for tensor in tensors:
        data = _as_bytes(tensor)
        lo, hi = max(start, offset), min(end, offset + data.numel())
        if lo < hi:
            buffer[lo - start:hi - start].copy_(data[lo - offset:hi - offset])
        offset += data.numel()
        if offset >= end:
            break
    return buffer


def send(state: dict, steps: int, members: tuple[int, ...], joiners: tuple[int, ...]) -> tuple[int, float]:
    """A rank that trains, at the step that takes `joiners` in (collective over the new generation, `members`, with
    receive() on the joiners): its stripe of the state to each joiner; the first rank also sends the layout.
    Returns (bytes of tensors handed over, seconds)."""
    started = time.monotonic()
    group, device = world.live_group(), world.collective_device()
    senders = [rank for rank in members if rank not in joiners]
    if any(differs_across_hosts(value) for value in state.values()):  # one rank's whole, not several hosts' stripes
        senders = senders[:1]
    me = dist.get_rank()
    if me not in senders:
        return 0, time.monotonic() - started
    tensors: list = []
    layout = {"format": FORMAT, "entries": _hollow(_entries(state), tensors), "steps": steps, "senders": len(senders),
              "shapes": [list(t.shape) for t in tensors], "random_states": random_state.capture(world.device())}
    total = sum(_as_bytes(t).numel() for t in tensors)
    works = []
    if me == senders[0]:
        blob = io.BytesIO()
        torch.save(layout, blob)
        header = torch.tensor([len(blob.getbuffer()), total], dtype=torch.int64, device=device)
        body = torch.frombuffer(bytearray(blob.getvalue()), dtype=torch.uint8).to(device)
        for joiner in joiners:
            works.append(dist.isend(header, group=group, group_dst=members.index(joiner), tag=_HEADER))
            works.append(dist.isend(body, group=group, group_dst=members.index(joiner), tag=_LAYOUT))
    start, end = _stripes(total, len(senders))[senders.index(me)]
    stripe = _stripe_of(tensors, start, end, device)
    if stripe.numel():
        for joiner in joiners:
            works.append(dist.isend(stripe, group=group, group_dst=members.index(joiner), tag=_STRIPE))
    for work in works:
        generation.wait_for(work, "the state's handover to the joining ranks", aside=True)
    return total, time.monotonic() - started


def receive(state: dict, members: tuple[int, ...], joiners: tuple[int, ...]) -> tuple[int, int, float]:
    """A joiner (see send()): the state from the ranks that train, loaded into `state`, and a random stream of its
    own. Returns (the step count, bytes of tensors received, seconds)."""
    started = time.monotonic()
    group, device = world.live_group(), world.collective_device()
    senders = [rank for rank in members if rank not in joiners]
    first = members.index(senders[0])
    header = torch.empty(2, dtype=torch.int64, device=device)
    _received(dist.irecv(header, group=group, group_src=first, tag=_HEADER))
    size, total = (int(v) for v in header.tolist())
    body = torch.empty(size, dtype=torch.uint8, device=device)
    _received(dist.irecv(body, group=group, group_src=first, tag=_LAYOUT))
    layout = torch.load(io.BytesIO(body.cpu().numpy().tobytes()), weights_only=True)
    if layout.get("format") != FORMAT:
        raise CheckpointError(explain("the state handed over by the ranks that train is of another format",
                                      rank=dist.get_rank(), seen=repr(layout.get("format")), expected=repr(FORMAT),
                                      fix="Run the same phalanx version on every node."))
    senders = senders[:layout.get("senders", len(senders))]
    data = torch.empty(total, dtype=torch.uint8, device=device)
    works = []
    for sender, (start, end) in zip(senders, _stripes(total, len(senders))):
        if end > start:
            works.append(dist.irecv(data[start:end], group=group, group_src=members.index(sender), tag=_STRIPE))
    for work in works:
        _received(work)
    tensors, offset = [], 0
    hollow: list = []
    _hollow(layout["entries"], hollow)
    for empty, shape in zip(hollow, layout["shapes"]):
        count = empty.element_size() * _numel(shape)
        tensors.append(data[offset:offset + count].clone().view(empty.dtype).reshape(shape))  # aligned: a copy
        offset += count
    entries = _filled(layout["entries"], iter(tensors))
    restoring.apply(None, {"entries": entries, "parts": []}, state, "the state handed over by the ranks that train")
    random_state.reseed_derived(layout["random_states"], dist.get_rank(), world.device())
    return int(layout["steps"]), total, time.monotonic() - started


def take_in_joiners(state: dict, steps: int, agreement) -> None:
    """Ranks wait to join (world/joining.py) and every rank agreed on this step (step `steps`, by `agreement`, the
    StopAgreement): take them in, hand them the state over the network, and go on in the larger generation."""
    started, before = time.monotonic(), world.live_members()
    joiners = generation.admit_joiners()
    if not joiners:
        agreement.resume()
        return
    members = world.live_members()
    try:
        healed = send(state, steps, members, joiners)
        generation.regroup_followers(world.live_generation(), members, [], started, joined=joiners,
                                     healed=healed)
    except RuntimeError as lost:  # a joiner lost while it was taken in (PeerDiedError is one)
        if not generation.is_loss(lost):
            raise
        generation.recover(lost)  # the ranks left go on without it from the next step (it says so)
        return
    if world.is_main():
        logger.warning("rank(s) %s joined: %d ranks go on in generation %d (world size %d -> %d), taken in at step "
                       "%d in %.2f s, %.1f MB of state handed over in %.2f s", list(joiners), len(members),
                       world.live_generation(), len(before), len(members), steps,
                       time.monotonic() - started, healed[0] / 1e6, healed[1])


def join_the_run(checkpointer, state: dict) -> bool:
    """A joiner's restore() of `checkpointer`: wait until the ranks that train take it in, then load the state they
    hand over (no disk read), and regroup its model and loader onto the run's generation."""
    started = time.monotonic()
    joined, joiners = generation.join_run()
    members = joined.members
    checkpointer.steps, size, seconds = receive(state, members, joiners)
    progress.step(checkpointer.steps)
    generation.regroup_followers(joined.number, members, [], started, joined=joiners, healed=(size, seconds))
    step_count.say_restored(checkpointer.steps, checkpointer)
    for value in state.values():  # a global-batch loader whose pass has not begun: dealt over the run's ranks
        if getattr(value, "plan", None) is not None and not getattr(value, "_follows_generations", True):
            value.regroup(joined.rank, joined.world_size)
    logger.info("rank %d joined the run at step %d (generation %d, %d ranks): %.1f MB of state received in "
                "%.2f s, %.2f s after it was ready", dist.get_rank(), checkpointer.steps, joined.number, len(members),
                size / 1e6, seconds, time.monotonic() - started)
    return True


def _received(work) -> None:
    """A receive of the handover, watched: a sender lost (its process gone, its host silent) is PeerDiedError, not
    a wait until the group's timeout. Waited aside: Gloo unbinds a receive whose timed wait expires."""
    generation.wait_for(work, "the state's handover from the ranks that train", aside=True)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
