"""After a loss: the whole sharded optimizer state put together on the ranks left, from their chunks and copies.

Each rank left adds its own chunk (the snapshot's, when the step is rolled back) and the copies of its lost wards
into zeroed tensors as long as the old world's buckets; one all-reduce per tensor gives every rank the whole
state (and on a roll-back the parameters before the step), which the ShardedOptimizer cuts again for the new
world. A joiner adds zeros. A lost rank whose keeper was lost too leaves a chunk no one holds: MembershipError.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...bucket.shard_plan import cut_bucket
from ...errors import MembershipError, explain
from ...log import logger
from ...world import generation
from .packing import agree_on_layout, pack_bucket


@torch.no_grad()
def whole_state(copies, survivors, old_members: tuple[int, ...]) -> tuple[dict, list | None]:
    """Collective over the new generation's group: ({parameter index: its whole state} in torch's format, keyed
    as the owner's `_numbers`; and on a roll-back each bucket's whole parameters before the step, else None).
    `copies`: the ShardCopies of the old world; `old_members` held the state, cut for their world. Raises
    MembershipError when a lost rank's chunk has no copy left."""
    exchange = copies.owner.exchange  # the old world's, still (a joiner's: its world of one)
    old_size = len(old_members)
    lost = {i for i, member in enumerate(old_members) if member not in survivors.members}
    rolling_back = copies.rolling_back and copies.snapshot is not None
    orphans = sorted(old_members[r] for r in lost if copies.keepers.get(r, r) in lost | {r})
    if orphans and (copies.layout is not None or rolling_back):  # no state yet, and no step to undo: no loss
        logger.error("rank(s) %s lost with the rank(s) that kept their optimizer shards: no copy is left; the "
                     "run falls back to its newest checkpoint", orphans)
        raise MembershipError(explain(
            "a lost rank's optimizer shard has no copy left", rank=dist.get_rank(),
            seen=f"rank(s) {orphans} lost together with their keepers", expected="at most one of each pair",
            fix="The run restarts from its newest checkpoint (phalanx run does it, under --max-restarts)."))
    if copies.layout is None and not lost:  # a world of one keeps no copies, so never agreed on one: now
        copies.layout = agree_on_layout(copies.owner, survivors.group)
    group, layout = survivors.group, copies.layout
    own, ward_params = copies.snapshot if rolling_back else ({}, {})
    mine = [] if copies.joining else [copies.rank] + [w for w in copies.wards if w in lost]
    states, scalars, params = [], [], []
    for b, bucket in enumerate(exchange.buckets):
        cuts = {r: cut_bucket(bucket, r, old_size) for r in range(old_size)}
        chunk, storage = cuts[0].chunk, bucket.storage
        rows = [0]
        for r in range(old_size):
            rows.append(rows[-1] + len(cuts[r].pieces))
        keys = len(layout.per_element) if layout else 0
        whole = torch.zeros(keys, chunk * old_size, dtype=storage.dtype, device=storage.device)
        flags = torch.zeros(rows[-1], layout.piece_width if layout else 1, dtype=torch.float64,
                            device=storage.device)
        before = torch.zeros(chunk * old_size, dtype=storage.dtype, device=storage.device) \
            if rolling_back else None
        for r in mine:
            at = slice(r * chunk, (r + 1) * chunk)
            if r == copies.rank:
                if layout:
                    state_of = (lambda piece: own[id(piece.tensor)][1]) if rolling_back else copies._own_state
                    whole[:, at], flags[rows[r]:rows[r + 1]] = pack_bucket(layout, exchange.shards[b], storage,
                                                                           state_of)
                if rolling_back:
                    for piece in exchange.shards[b].pieces:
                        before[at][piece.offset:piece.offset + piece.numel] = own[id(piece.tensor)][0].reshape(-1)
            else:
                if layout and r in copies.copies:
                    whole[:, at], flags[rows[r]:rows[r + 1]] = copies.copies[r].state[b], copies.copies[r].scalars[b]
                if rolling_back:
                    for piece, value in zip(cuts[r].pieces, ward_params[r][b]):
                        before[at][piece.offset:piece.offset + piece.numel] = value.reshape(-1)
        for tensor in (whole, flags) + ((before,) if rolling_back else ()):
            generation.wait_for(dist.all_reduce(tensor, group=group, async_op=True), "the optimizer's re-shard")
        states.append(whole)
        scalars.append((flags, rows, cuts))
        params.append(before)
    return _entries(copies, states, scalars), (params if rolling_back else None)


def _entries(copies, states, scalars) -> dict:
    """{parameter number: state} from the buckets' whole state (the scalars of a parameter's first piece)."""
    layout, owner, entries = copies.layout, copies.owner, {}
    if layout is None:
        return entries
    for b, bucket in enumerate(owner.exchange.buckets):
        flags, rows, cuts = scalars[b]
        chunk = cuts[0].chunk
        for i, p, offset in zip(bucket.indices, bucket.params, bucket.offsets):
            number = owner._numbers.get(id(p))
            if number is None:
                continue
            r = offset // chunk
            row = next(rows[r] + j for j, piece in enumerate(cuts[r].pieces) if piece.index == i)
            if flags[row, 0] == 0:
                continue  # never stepped: no state, as in the unsharded optimizer
            entry = {key: states[b][k, offset:offset + p.numel()].view(p.shape).clone()
                     for k, key in enumerate(layout.per_element)}
            for k, key in enumerate(layout.scalar_keys):
                entry[key] = layout.scalar_value(key, float(flags[row, 1 + k]), states[b].device)
            entries[number] = entry
    return entries
