"""A chunk's optimizer state packed into a few tensors, so that it travels to its keeper in one send per tensor.

The ranks agree once on a `Layout` (the keys the state has, the same on every rank, though a rank may hold no
state); each bucket's chunk is then packed as its per-element state (keys x chunk, in the bucket's dtype) and
its scalars (a row of float64 per piece, after a presence flag): `Packed`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...bucket.shard_plan import BucketShard
from ...errors import ShardingError, explain
from ...world import generation


class Layout:
    """What a chunk's state holds, the same on every rank: the keys kept per element (packed after each other,
    a chunk each, in the bucket's dtype) and the scalar ones (a float64 each per piece, after a presence flag),
    with what each scalar was (a tensor's dtype and device, or a Python number's type) to give it back as such."""

    def __init__(self, per_element: list[str], scalars: dict[str, tuple]):
        self.per_element, self.scalars = sorted(per_element), scalars
        self.scalar_keys = sorted(scalars)

    @staticmethod
    def describe(state: dict, shape: torch.Size) -> tuple[list[str], dict[str, tuple]]:
        per_element, scalars = [], {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == shape and value.dim() > 0:
                per_element.append(key)
            elif isinstance(value, torch.Tensor):
                scalars[key] = ("tensor", str(value.dtype).split(".")[-1], str(value.device))
            elif isinstance(value, (bool, int, float)):
                scalars[key] = ("number", type(value).__name__, "")
        return per_element, scalars

    def scalar_value(self, key: str, number: float, here: torch.device):
        """The scalar `key` as it was, from its number; a tensor that was on an accelerator goes on `here`, this
        rank's (the layout names the device of the rank that described it: another GPU on another rank)."""
        kind, name, device = self.scalars[key]
        if kind == "tensor":
            where = torch.device(device)
            return torch.tensor(number, dtype=getattr(torch, name), device=where if where.type == "cpu" else here)
        return {"bool": bool, "int": int, "float": float}[name](number)

    @property
    def piece_width(self) -> int:
        return 1 + len(self.scalar_keys)


class Packed:
    """One rank's chunk state, bucket by bucket: `state[b]` (keys x chunk, the bucket's dtype) and `scalars[b]`
    (pieces x (presence + scalar keys), float64)."""

    def __init__(self, state: list[torch.Tensor], scalars: list[torch.Tensor]):
        self.state, self.scalars = state, scalars

    def tensors(self) -> list[torch.Tensor]:
        return self.state + self.scalars


def agree_on_layout(owner, group) -> Layout:
    """Collective over `group`, once state exists: the keys every rank's state has (a rank may
    hold none). `owner`: the ShardedOptimizer, its pieces and its wrapped optimizer's state."""
    mine = ([], {})
    for piece_list in owner._pieces.values():
        for piece in piece_list:
            found = owner.state.get(piece.tensor)
            if found:
                mine = Layout.describe(found, piece.tensor.shape)
                break
        if mine[0] or mine[1]:
            break
    everyone = generation.all_gather_objects(mine, group, "the shard copies' layout")
    per_element = sorted({key for keys, _ in everyone for key in keys})
    scalars = {}
    for _, found in everyone:
        scalars.update(found)
    return Layout(per_element, scalars)


def pack(layout: Layout, shards: list[BucketShard], buckets, state_of, into: Packed | None = None) -> Packed:
    """A rank's chunk state laid out as `layout` says; `state_of(piece)` gives a piece's state (or None).
    `into`: buffers of an earlier pack of the same chunks, written over (what a piece without state leaves in
    them is flagged absent)."""
    packed = [pack_bucket(layout, shard, bucket.storage, state_of,
                          None if into is None else (into.state[b], into.scalars[b]))
              for b, (shard, bucket) in enumerate(zip(shards, buckets))]
    return Packed([state for state, _ in packed], [flags for _, flags in packed])


def pack_bucket(layout: Layout, shard: BucketShard, storage: torch.Tensor, state_of,
                into: tuple | None = None) -> tuple:
    """One bucket's chunk of `pack`: (its per-element state, its pieces' flags and scalars)."""
    if into is None:
        packed = torch.zeros(len(layout.per_element), shard.chunk, dtype=storage.dtype, device=storage.device)
        flags = torch.zeros(len(shard.pieces), layout.piece_width, dtype=torch.float64, device=storage.device)
    else:
        packed, flags = into
    for row, piece in enumerate(shard.pieces):
        found = state_of(piece)
        flags[row, 0] = 1.0 if found else 0.0
        if not found:
            continue
        for k, key in enumerate(layout.per_element):
            value = found.get(key)
            if value is not None:
                packed[k, piece.offset:piece.offset + piece.numel].copy_(value.reshape(-1))
        for k, key in enumerate(layout.scalar_keys):
            value = found.get(key)
            if value is not None:
                flags[row, 1 + k] = float(value)
    return packed, flags


def check_keys(layout: Layout, owner) -> None:
    """The state this rank holds (`owner`'s, the ShardedOptimizer's) fits the agreed layout (an optimizer whose
    state keys change mid-run does not)."""
    known = set(layout.per_element) | set(layout.scalars)
    for piece_list in owner._pieces.values():
        for piece in piece_list:
            found = owner.state.get(piece.tensor) or {}
            extra = set(found) - known
            if extra:
                raise ShardingError(explain(
                    "the optimizer's state grew keys after its first step: the shard copies cannot hold them",
                    rank=dist.get_rank(), seen=sorted(extra), expected=sorted(known),
                    fix="Use an optimizer whose state keys are set at its first step, or turn live recovery "
                        "off (--min-world-size 0)."))
            for key in layout.per_element:
                value = found.get(key)
                if value is not None and value.dtype != piece.tensor.dtype:
                    raise ShardingError(explain(
                        "the shard copies keep optimizer state in the parameters' dtype", rank=dist.get_rank(),
                        seen=f"state {key!r} in {value.dtype} for a {piece.tensor.dtype} parameter",
                        expected=str(piece.tensor.dtype),
                        fix="Keep the optimizer's state in the parameters' dtype, or turn live recovery off "
                            "(--min-world-size 0)."))
