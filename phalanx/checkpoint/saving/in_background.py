"""A background save (`Checkpointer(async_save=True)`, the default): each rank hands its share to its writer.

A rank's share: its FSDP2 shards (shard="parameters") and its share of the replicated model and optimizer
(spreading.py); rank 0's also holds the checkpoint's main file: the plain values, the other stateful objects,
a sharded optimizer's state gathered to it and every rank's random states. save() returns once the share is
copied into the rank's staging buffer (background/saves.py); rank 0's writer commits the checkpoint once every
rank's part is written. At most one write is in flight: a save first waits for the one before, and every rank
learns whether any rank's failed (decisions.agree_on_writes) before any writes again.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...world import group as world
from .. import atomic_files, random_state, restoring, shard_files, spreading
from ..background import staging
from ..entries import check_plain, kind_of, state_dict_of, unwrap
from .decisions import agree_on_writes, next_sequence


def save(checkpointer, state: dict) -> Path:
    """`checkpointer.save(state)` handed to the writer (`checkpointer`: the Checkpointer saving: its directory, keep,
    steps, timeout, audit trail and background saves); the path the checkpoint will have, on every rank."""
    directory = checkpointer.directory
    kinds = {name: kind_of(name, value) for name, value in state.items()}
    _, failed = checkpointer._background.settle()  # at most one write in flight: a save while one writes waits for it
    rank, size = world.group_rank(), world.group_size()
    split = {name: shard_files.split(dtensors) for name, value in state.items()
             if (dtensors := shard_files.dtensor_state(value, unwrap)) is not None}
    gathered = {name: value.state_dict(to=0) for name, value in state.items()
                if shard_files.is_optimizer_view(value) and name not in split}
    states = random_state.gather(random_state.capture(random_state.own_device(), state), world.collective_device())
    sequence, cause = -1, failed["error"] if failed else None
    if rank == 0 and failed is None:
        try:
            sequence = next_sequence(directory)
        except Exception as exc:  # told to the other ranks below, then raised here
            cause = f"{type(exc).__name__}: {exc}"
    sequence = agree_on_writes(directory, cause, sequence)
    replicated = spreading.replicated(state, kinds, unwrap, size)
    part, entries, loads = {name: shards for name, (_, shards) in split.items()}, {}, [0] * size
    for name, value in state.items():
        if name in split:
            saved = split[name][0]
        elif name in replicated:  # every rank writes a share of it
            whole = state_dict_of(value, kinds[name])
            saved, part[name] = spreading.spread(whole, replicated[name], loads, size, rank)
        elif rank != 0:
            continue
        elif kinds[name] == "value":
            saved = value
        elif name in gathered:
            saved = gathered[name]
        else:
            saved = state_dict_of(value, kinds[name])
        if rank == 0:
            if kinds[name] != "value":
                check_plain(saved, f"state[{name!r}].state_dict()")
            entries[name] = {"kind": kinds[name], "state": saved, "sharded": name in split or name in replicated}
            if kinds[name] == "value" and staging.has_cuda_tensor(saved):
                entries[name]["on_gpu"] = True  # staged through host memory: restored onto the GPU again
    main = None
    if rank == 0:
        main = {"format": restoring.FORMAT, "sequence": sequence, "world_size": size, "entries": entries,
                "random_states": states, "parts": [], "steps": checkpointer.steps}
    job = {"directory": str(directory), "sequence": sequence, "rank": rank, "world_size": size,
           "keep": checkpointer.keep, "timeout": _writer_timeout(checkpointer.timeout), "parts": bool(part),
           "protect": checkpointer._trail.trusted}
    checkpointer._background.submit(job, part or None, main)
    return directory / atomic_files.CHECKPOINT_NAME.format(sequence)


def _writer_timeout(timeout: float | None) -> float:
    """Seconds rank 0's writer waits for every rank's part: the Checkpointer's timeout, else PHALANX_TIMEOUT."""
    return float(timeout) if timeout is not None else float(os.environ.get("PHALANX_TIMEOUT", 600))
