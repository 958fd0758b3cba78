"""A synchronous save (`Checkpointer(async_save=False)`): rank 0 writes the checkpoint before save() returns.

Every rank's random states are gathered, and a sharded optimizer's state to rank 0 in torch's unsharded format;
FSDP2's shards (shard="parameters") are written by their ranks first, each into a part file of its own. Rank 0
then writes one file (atomically, see atomic_files.py) with the unwrapped model, the other stateful objects and
the plain values, commits it (manifest, pruning to `keep`), and all ranks pass a barrier: every rank returns the
same path, or raises the same error.
"""

from __future__ import annotations

import time
from pathlib import Path

from ...errors import CheckpointError, CheckpointWriteError, explain
from ...log import logger
from ...world import group as world
from .. import atomic_files, random_state, restoring, shard_files
from ..background import commit
from ..entries import check_plain, kind_of, state_dict_of, unwrap
from .decisions import FAILED, LOAD, barrier, from_rank0, next_sequence


def save(checkpointer, state: dict) -> Path:
    """`checkpointer.save(state)` written before it returns (`checkpointer`: the Checkpointer saving: its directory,
    keep, steps, timeout and audit trail); the checkpoint's path on every rank."""
    directory = checkpointer.directory
    kinds = {name: kind_of(name, value) for name, value in state.items()}  # same check, same error, on all ranks
    device = random_state.own_device()
    states = random_state.gather(random_state.capture(device, state), world.collective_device())
    # FSDP2's shards (shard="parameters") are written by their ranks, each into a part file of its own;
    # a sharded optimizer's pieces (shard="optimizer"/"gradients") are gathered to rank 0, bucket by bucket.
    split = {name: shard_files.split(dtensors) for name, value in state.items()
             if (dtensors := shard_files.dtensor_state(value, unwrap)) is not None}
    gathered = {name: value.state_dict(to=0) for name, value in state.items()
                if shard_files.is_optimizer_view(value) and name not in split}
    path, failure, sequence, parts = None, None, -1, None
    if world.group_rank() == 0:
        try:
            sequence = next_sequence(directory)
        except Exception as exc:  # told to the other ranks below, then raised here
            failure = exc
    if split:  # every rank writes its part first, under the sequence rank 0 chose
        code, sequence = from_rank0(FAILED if failure else LOAD, None, sequence)
        if code != FAILED:
            local = {name: shards for name, (_, shards) in split.items()}
            parts = shard_files.write_parts(directory, sequence, local)
            gathered.update({name: skeleton for name, (skeleton, _) in split.items()})
    if world.group_rank() == 0 and failure is None:
        try:
            path = _write(checkpointer, state, kinds, states, gathered, sequence, parts, set(split))
        except Exception as exc:  # told to the other ranks below, then raised here
            failure = exc
    barrier(checkpointer.timeout)
    code, sequence = from_rank0(FAILED if failure else LOAD, path)
    if failure is not None:
        if isinstance(failure, CheckpointError):
            raise failure
        raise CheckpointWriteError(explain(
            f"could not write a checkpoint in {directory}", rank=0,
            seen=f"{type(failure).__name__}: {failure}", expected="a writable directory with free space",
            fix="Free space or fix permissions; the previous checkpoint is intact.")) from failure
    if code == FAILED:
        raise CheckpointWriteError(explain(
            f"rank 0 could not write a checkpoint in {directory}", rank=world.group_rank(),
            seen="a failure on rank 0", fix="See rank 0's error; the previous checkpoint is intact."))
    return directory / atomic_files.CHECKPOINT_NAME.format(sequence)


def _write(checkpointer, state: dict, kinds: dict, states: list, gathered: dict, sequence: int, parts: list | None,
           split: set) -> Path:
    """Rank 0: the checkpoint file of `sequence`, committed."""
    started = time.monotonic()
    entries = {}
    for name, value in state.items():
        if kinds[name] == "value":
            saved = value
        elif name in gathered:
            saved = gathered[name]
        else:
            saved = state_dict_of(value, kinds[name])
            check_plain(saved, f"state[{name!r}].state_dict()")
        entries[name] = {"kind": kinds[name], "state": saved, "sharded": name in split}
    payload = {"format": restoring.FORMAT, "sequence": sequence, "world_size": world.group_size(),
               "entries": entries, "random_states": states, "parts": parts or [], "steps": checkpointer.steps}
    path, size = commit(checkpointer.directory, payload, checkpointer.keep, checkpointer._trail.trusted)
    logger.info("saved checkpoint %s (%.1f MB in %.2fs)", path, size / 1e6, time.monotonic() - started)
    return path
