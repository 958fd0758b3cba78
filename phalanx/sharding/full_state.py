"""Whole tensors out of FSDP2's sharded ones, and back: what lets `shard="parameters"` checkpoints load
at any world size and in any shard mode.

FSDP2 keeps each parameter (and each optimizer state tensor of it) as a DTensor: one dim-0 shard
per rank. A checkpoint holds whole tensors instead, in the formats an unsharded model and a torch
optimizer use, so the same file restores into "none", "optimizer", "gradients" or "parameters" at
any world size. Gathering is one tensor at a time (collective, in the same order on every rank),
so no rank ever holds more than its shards, one whole tensor and what it keeps of the result.
"""

from __future__ import annotations

import torch

from .dtensor import is_dtensor


def whole(value, keep: bool):
    """A DTensor's whole tensor (collective), on the CPU where `keep`, else None; other values as they are."""
    if is_dtensor(value):
        full = value.full_tensor()
        return full.cpu() if keep else None
    return value


def full_model_state(module: torch.nn.Module, to: int | None, rank: int) -> dict | None:
    """Collective: `module.state_dict()` with whole tensors, for rank `to` (None: every rank)."""
    keep = to is None or to == rank
    state = module.state_dict()
    result = type(state)()
    for key, value in state.items():  # the same keys, in the same order, on every rank
        gathered = whole(value, keep)
        if keep:
            result[key] = gathered.detach() if isinstance(gathered, torch.Tensor) else gathered
    return result if keep else None


def local_part(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's shard of `full`, cut as the DTensor `like` is cut (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    part = distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)
    return part.to_local()


@torch.no_grad()
def load_full_model_state(module: torch.nn.Module, saved: dict) -> None:
    """Load whole tensors into a module whose parameters may be DTensors: each rank keeps its shards."""
    own = module.state_dict()
    plain = {}
    for key, target in own.items():
        if key not in saved:  # the caller checked strictness
            continue
        value = saved[key]
        if is_dtensor(target):  # a DTensor from a checkpoint's parts is already this rank's shard
            target.to_local().copy_(value.to_local() if is_dtensor(value) else local_part(value, target))
        else:
            plain[key] = value
    if plain:
        module.load_state_dict(plain, strict=False)
