"""Copies of every rank's optimizer shard on another rank, so that live recovery outlives a lost shard.

With shard="optimizer" or "gradients" a rank holds the optimizer state of its own chunk of every bucket
(bucket/shard_plan.py) and no other rank does: lost, it would take that state along. Under live recovery
(world/generation.py) each rank's chunk state is also held by its *keeper* (`keepers.py`), the rank with its
local index on the next host (the next rank, on one host), refreshed after every step. After a loss the ranks
left put the whole state together, each giving its own chunk and its lost wards' copies, and cut it again for the
new world; nothing is read from disk (`reassembly.py`). A rank that joins (checkpoint/handover.py) is handed the
layout and the world its state was cut for instead of the state: it gives zeros to the same sums, and takes its
new chunk from them. A chunk's state travels packed in a few tensors, as its `Layout` says (`packing.py`).

A step, around the wrapped optimizer's (ShardedOptimizer.step; `ShardCopies` in `step.py`):
- before: a snapshot of this rank's chunk (parameters and state) and of its wards' parameter chunks;
- after: the parameters' all-gather, this rank's new chunk state sent to its keeper while its wards'
  arrive in spare buffers, then a commit through the store: the step counts once every rank got that far.
  A loss before that rolls every rank left back to the snapshots, and the step is redone on the new world
  (the loader hands it out again; the step the loop already saw says `undone`).
Two ranks lost together, one the other's keeper, leave a chunk with no copy: the run then falls back to its
newest checkpoint (MembershipError, which `phalanx run` answers with a restart). So does any loss with the copies
turned off (`PHALANX_SHARD_COPIES=0`), which saves their cost (docs/benchmarks.md).
"""

from .keepers import COPIES_ENV, copies_on, keepers
from .packing import Layout
from .step import ShardCopies
