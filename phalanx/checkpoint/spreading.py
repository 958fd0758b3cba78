"""The write of replicated state spread over the ranks: each rank writes a part of the tensors.

In data-parallel training the parameters of a DDP-wrapped model, and the state of an optimizer over
those parameters only, are bitwise the same on every rank (DDP's invariant). So rank r writes rows
[r n / W, (r + 1) n / W) of each large tensor, and small tensors whole, each to the least loaded rank.
The entry is stored as shard_files stores FSDP2 shards: a skeleton with placeholders in rank 0's file,
the pieces in every rank's part file; restoring puts each tensor back together from the parts, at
any world size and level. Buffers (BatchNorm's running statistics move on each rank between the
forward's broadcasts), other objects and plain values stay whole in rank 0's file, as rank 0 has them.

>>> skeleton, mine = spread({"w": torch.zeros(1024, 512)}, lambda path: True, [0, 0], 2, rank=1)
>>> mine["0"]["offset"], list(mine["0"]["tensor"].shape)      # rank 1 of 2 writes rows 512-1023
([512, 0], [512, 512])
"""

from __future__ import annotations

import torch

from .entries import _is_wrapper, differs_across_hosts
from .shard_files import PLACEHOLDER, dtensor_state, is_optimizer_view

# Smaller tensors go whole to one rank: a piece on every rank would add more to each part's header
# than it takes off the largest part.
SPLIT_BYTES = 1 << 20


def replicated(state: dict, kinds: dict, unwrap, world_size: int) -> dict:
    """{entry name: which of its state dict's tensors are the same on every rank} for the entries whose
    write can be spread: a DDP-wrapped model (its parameters), an optimizer over those parameters only. Not a
    model with `across_hosts=DiLoCo(...)` on several hosts, nor its optimizer: their hosts' copies differ."""
    if world_size < 2:
        return {}
    found, params = {}, set()
    for name, value in state.items():
        if differs_across_hosts(value):  # rank 0 writes its host's whole
            continue
        if kinds[name] == "model" and _is_wrapper(value) and dtensor_state(value, unwrap) is None:
            names = {key for key, _ in unwrap(value).named_parameters()}
            params.update(id(p) for p in unwrap(value).parameters())
            found[name] = lambda path, names=names: bool(path) and path[0] in names
    for name, value in state.items():
        if (isinstance(value, torch.optim.Optimizer) and not is_optimizer_view(value)
                and value.param_groups and all(id(p) in params for g in value.param_groups for p in g["params"])):
            found[name] = lambda path: bool(path) and path[0] == "state"
    return found


def spread(state, chosen, loads: list[int], world_size: int, rank: int):
    """(`state` with each chosen tensor replaced by a placeholder, {placeholder key: this rank's piece}).

    `chosen(path)` says whether the tensor at `path` (the keys leading to it) is replicated; `loads`,
    the bytes given to each rank so far, is updated (the same on every rank: every rank walks the
    same structure in the same order, so the keys and the owners agree)."""
    mine: dict[str, dict] = {}

    def place(tensor: torch.Tensor):
        key = str(len(mine))
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dim() and tensor.shape[0] >= world_size and nbytes >= SPLIT_BYTES:
            rows = tensor.shape[0]
            start, end = rank * rows // world_size, (rank + 1) * rows // world_size
            for r in range(world_size):
                loads[r] += nbytes * ((r + 1) * rows // world_size - r * rows // world_size) // rows
            piece = {"offset": [start] + [0] * (tensor.dim() - 1), "tensor": tensor.detach()[start:end]}
        else:
            owner = min(range(world_size), key=lambda r: loads[r])
            loads[owner] += nbytes
            piece = {"offset": [0] * tensor.dim(),
                     "tensor": tensor.detach() if owner == rank else torch.empty(0, dtype=tensor.dtype)}
        mine[key] = piece
        return {PLACEHOLDER: key, "shape": list(tensor.shape), "dtype": str(tensor.dtype).split(".")[-1]}

    def walk(value, path):
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and chosen(path):
            return place(value)
        if isinstance(value, dict):
            return type(value)((k, walk(v, path + (k,))) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, path + (i,)) for i, v in enumerate(value))
        return value

    return walk(state, ()), mine
