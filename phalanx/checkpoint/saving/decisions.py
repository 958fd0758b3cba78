"""How every rank acts on the same decision in a save or a restore: a few small collectives.

Rank 0 alone chooses (the next checkpoint's sequence number, the checkpoint to restore) and may fail doing it;
it broadcasts a code and the sequence (`from_rank0`), so every rank goes on, or raises, alike. A synchronous
save ends at a barrier; a background save's outcome is gathered from every rank (`agree_on_writes`): a write
that failed on any rank raises the same CheckpointWriteError on all of them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ...diagnose import recorder
from ...errors import CheckpointWriteError, explain
from ...world import generation
from ...world import group as world
from .. import atomic_files, shard_files
from ..background import report

NOTHING, LOAD, FAILED = 0, 1, 2  # what rank 0 tells the others after choosing or writing


def from_rank0(code: int, path: Path | None, sequence: int = -1) -> tuple[int, int]:
    """Broadcast (code, checkpoint sequence) from rank 0, so every rank acts on the same decision."""
    sequence = atomic_files.sequence_of(path.name) if path is not None else sequence
    if world.group_size() == 1:
        return code, sequence
    message = torch.tensor([code, sequence], dtype=torch.int64, device=world.collective_device())
    entry = recorder.begin(recorder.CHECKPOINT, -1, message.numel(), message.dtype)
    generation.wait_for(dist.broadcast(message, group=world.live_group(), group_src=0, async_op=True),
                        "a checkpoint's decision")  # from the first rank training
    recorder.done(entry)
    return int(message[0]), int(message[1])


def barrier(timeout: float | None) -> None:
    """Every rank past the save (`timeout`: the Checkpointer's, None for PHALANX_TIMEOUT)."""
    if world.group_size() == 1:
        return
    if world.is_initialized():
        world.barrier(timeout, name="checkpoint")
    else:
        dist.barrier()


def next_sequence(directory: Path) -> int:
    """Rank 0: the sequence number of the next checkpoint (past any part a failed save left: its note could
    be taken for the new part's)."""
    listed = atomic_files.read_manifest(directory) or []
    present = atomic_files.checkpoint_files(directory)
    parts = shard_files.part_sequences(directory)
    return 1 + max([e.sequence for e in listed] + list(present) + parts, default=0)


def agree_on_writes(directory: Path, cause: str | None, sequence: int = -1) -> int:
    """Collective: every rank learns which ranks' writes failed (and rank 0's sequence for the next save, which it
    returns); every rank raises the same CheckpointWriteError if any did."""
    rank, size = world.group_rank(), world.group_size()
    flags = [(1 if cause else 0, sequence)]
    if size > 1:
        mine = torch.tensor(flags[0], dtype=torch.int64, device=world.collective_device())
        everyone = [torch.empty_like(mine) for _ in range(size)]
        entry = recorder.begin(recorder.CHECKPOINT, -1, mine.numel(), mine.dtype)
        generation.wait_for(dist.all_gather(everyone, mine, group=world.live_group(), async_op=True),
                            "a checkpoint's outcome")
        recorder.done(entry)
        flags = [(int(row[0]), int(row[1])) for row in everyone]
    agreed = flags[0][1]
    failed = [r for r, (flag, _) in enumerate(flags) if flag]
    if not failed:
        return agreed
    if cause:
        raise report({"error": cause}, rank, directory)
    who = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
    raise CheckpointWriteError(explain(
        f"{who} could not write a checkpoint in {directory}", rank=rank,
        seen="a failed background write", expected="every rank's part written",
        fix="See those ranks' errors; the previous checkpoint is intact and the newest complete one."))
