"""The arithmetic of a global batch: which samples each rank reads in step s, in how many micro-batches, and
what each micro-batch's loss weighs.

Step s of an epoch averages entries [s*B, (s+1)*B) of the epoch's global order (the last step may be
shorter). The sampler deals that order out rank-strided (rank r reads entries r, r+W, r+2W, ...), so a
rank's part of a step is the next run of its own shard: nothing moves between ranks, and when W does not
divide B the ranks' parts differ by one sample and are weighed by their counts. Pure, so every world
size can be checked in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import DataConfigError, explain


def entries_before(stop: int, rank: int, world_size: int) -> int:
    """How many of the entries 0..stop-1 rank `rank` reads (those with entry % world_size == rank).

    >>> [entries_before(10, r, 3) for r in range(3)]
    [4, 3, 3]
    """
    return max(0, stop - rank + world_size - 1) // world_size


def split_evenly(count: int, parts: int) -> tuple[int, ...]:
    """`count` samples cut into `parts` micro-batches as even as possible, the larger ones first.

    >>> split_evenly(22, 2), split_evenly(7, 3), split_evenly(1, 2)
    ((11, 11), (3, 2, 2), (1, 0))
    """
    return tuple(count // parts + (1 if j < count % parts else 0) for j in range(parts))


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class StepLayout:
    """One optimizer step on one rank: its samples (`sizes`, one per micro-batch) and each micro-batch's weight.

    `weights[j] = world_size * sizes[j] / samples`: DDP averages over the ranks, so the loss of a micro-batch
    (a mean over its sizes[j] samples) scaled by it makes the averaged gradient the mean over the step's
    `samples`. A micro-batch of size 0 is padding (this rank has fewer samples than micro-batches): it is
    fed one sample of the step, `pad_entry`, so that every rank runs the same forwards and backwards, and
    weighs 0.
    """

    index: int  # the step's number in the epoch
    samples: int  # samples the step averages, over all ranks: B, or fewer in an epoch's last step
    first_entry: int  # the step's first entry in the epoch's global order
    sizes: tuple[int, ...]  # this rank's samples per micro-batch (0: a padding micro-batch)
    weights: tuple[float, ...]

    @property
    def num_micro_batches(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True)
class GlobalBatchPlan:
    """How a global batch of `global_batch_size` samples is split over `world_size` ranks (`str()` says it).

    >>> plan = GlobalBatchPlan.build(global_batch_size=64, micro_batch_size=16, world_size=2, dataset_len=640)
    >>> print(plan)
    global batch 64 = 2 ranks x 2 micro-batches x 16
    >>> plan.step(0, rank=1).sizes, plan.step(0, rank=1).weights
    ((16, 16), (0.5, 0.5))
    """

    world_size: int
    micro_batch_size: int  # the DataLoader's batch_size: the most samples one micro-batch holds
    micro_batches_per_rank: int  # in a full step, the same on every rank
    global_batch_size: int
    dataset_len: int
    drop_last: bool = False  # the DataLoader's: drop an epoch's last, partial global batch

    @classmethod
    def build(cls, *, global_batch_size, micro_batch_size, world_size: int, dataset_len: int,
              drop_last: bool = False, rank: int | None = None) -> GlobalBatchPlan:
        """Check the numbers (DataConfigError naming them and the fix) and plan the full steps."""
        if not _is_count(global_batch_size):
            raise DataConfigError(explain(
                "DataLoader global_batch_size is not a positive integer", rank=rank,
                seen=f"global_batch_size={global_batch_size!r}", expected="an int >= 1",
                fix="Pass the number of samples one optimizer step averages, over all ranks, e.g. 64."))
        if not _is_count(micro_batch_size):
            raise DataConfigError(explain(
                "DataLoader batch_size (the micro-batch) is not a positive integer with global_batch_size",
                rank=rank, seen=f"batch_size={micro_batch_size!r}", expected="an int >= 1",
                fix="Pass batch_size=, the most samples one forward pass takes (a micro-batch), e.g. 16."))
        if global_batch_size < world_size:
            raise DataConfigError(explain(
                "DataLoader global_batch_size is smaller than the number of ranks", rank=rank,
                seen=f"global_batch_size={global_batch_size} over {world_size} ranks",
                expected=f"global_batch_size >= {world_size}, so that every rank has a sample in each step",
                fix="Raise global_batch_size, or run on fewer ranks."))
        share = -(-global_batch_size // world_size)
        if micro_batch_size > share:
            raise DataConfigError(explain(
                "DataLoader batch_size is larger than a rank's share of the global batch", rank=rank,
                seen=f"batch_size={micro_batch_size}, global_batch_size={global_batch_size} over "
                     f"{world_size} ranks = {share} samples per rank",
                expected=f"batch_size <= {share}",
                fix=f"batch_size is the micro-batch (one forward), not the global batch: pass batch_size <= "
                    f"{share}, or raise global_batch_size to at least {micro_batch_size * world_size}."))
        return cls(world_size, micro_batch_size, math.ceil(share / micro_batch_size), global_batch_size,
                   dataset_len, bool(drop_last))

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch: the partial last global batch is one more, unless drop_last."""
        full, rest = divmod(self.dataset_len, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def step_samples(self, step: int) -> int:
        """Samples step `step` averages (B, or what is left for an epoch's last step)."""
        return min(self.global_batch_size, self.dataset_len - step * self.global_batch_size)

    def micro_batches(self, step: int) -> int:
        """Micro-batches every rank runs in step `step`: enough for the rank with the most samples."""
        most = -(-self.step_samples(step) // self.world_size)
        return max(1, -(-most // self.micro_batch_size))

    def step(self, step: int, rank: int, offset: int = 0) -> StepLayout:
        """Rank `rank`'s part of step `step`; `offset` is where the sampler's order starts (after a re-shard)."""
        samples = self.step_samples(step)
        first = step * self.global_batch_size - offset  # in the sampler's order, which starts at `offset`
        count = (entries_before(first + samples, rank, self.world_size)
                 - entries_before(first, rank, self.world_size))
        sizes = split_evenly(count, self.micro_batches(step))
        weights = tuple(self.world_size * size / samples for size in sizes)
        return StepLayout(step, samples, first, sizes, weights)

    def consumed_before(self, step: int, rank: int, offset: int = 0) -> int:
        """Entries of rank `rank`'s shard that steps before `step` used (where its sampler resumes)."""
        stop = min(step * self.global_batch_size, self.dataset_len) - offset
        return entries_before(stop, rank, self.world_size)

    def micro_batches_per_epoch(self) -> int:
        """Micro-batches each rank runs in a whole epoch (the loader's batch sampler's length)."""
        full = self.dataset_len // self.global_batch_size
        last = self.micro_batches(full) if self.steps_per_epoch > full else 0
        return full * self.micro_batches_per_rank + last

    def as_dict(self) -> dict:
        """The plan's fields and its description, as primitives (what `phalanx run` reads back)."""
        return {"world_size": self.world_size, "micro_batch_size": self.micro_batch_size,
                "micro_batches_per_rank": self.micro_batches_per_rank, "global_batch_size": self.global_batch_size,
                "steps_per_epoch": self.steps_per_epoch, "text": str(self)}

    def __str__(self) -> str:
        b, w, m = self.global_batch_size, self.world_size, self.micro_batches_per_rank
        ranks = f"{w} rank{'s' if w != 1 else ''} x {m} micro-batch{'es' if m != 1 else ''}"
        low, high = b // w, -(-b // w)
        if low == high and low % m == 0:
            text = f"global batch {b} = {ranks} x {low // m}"
        else:
            shares = f"{low}" if low == high else f"{low} or {high}"
            text = (f"global batch {b} = {ranks} of at most {-(-high // m)} ({shares} samples per rank and step, "
                    "each micro-batch weighed by its count)")
        rest = self.dataset_len % b
        if rest and self.dataset_len > b:
            text += (f"; the epoch's last {rest} samples are dropped" if self.drop_last
                     else f"; the epoch's last step averages its {rest} samples")
        return text
