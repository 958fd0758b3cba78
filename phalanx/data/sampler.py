"""`DistributedSampler`: torch's shard layout, plus shards without padding and exact mid-epoch resume.

An epoch is one global order of the dataset (`torch.randperm` seeded with `seed + epoch`, exactly as
torch does); rank r reads every `num_replicas`-th entry of it, starting at entry r. `pad=True` first
repeats the head of the order so that every rank gets the same count (torch's behaviour);
`pad=False` does not, so the shards differ by at most one sample and hold each index exactly once.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import DataConfigError, ResumeStateError, WorldConfigError, explain

# Keys of the state that describe the layout rather than the position: a position taken under
# another layout names other samples, so loading it is refused. A different num_replicas is not in
# this list: that position is translated (re-sharded), see load_state_dict.
LAYOUT_KEYS = ("dataset_len", "shuffle", "seed", "drop_last", "pad")


def _world_rank_and_size() -> tuple[int, int]:
    from ..world import group as world

    if world.is_initialized():  # after a loss (live recovery), the ranks left
        return world.group_rank(), world.group_size()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    raise WorldConfigError(explain(
        "DistributedSampler cannot tell this process's rank and the number of ranks",
        seen="neither phalanx.init() nor torch.distributed.init_process_group() has run",
        expected="an initialized world, or num_replicas= and rank= passed explicitly",
        fix="Call phalanx.init() first, or pass num_replicas=1, rank=0 to run alone."))


def _as_int(value) -> int | None:
    try:
        return operator.index(value)
    except TypeError:
        return None


class DistributedSampler(Sampler[int]):
    """Yield this rank's share of the dataset indices; with torch's arguments, exactly torch's indices.

    `pad=False` (with `drop_last=False`) gives uneven shards covering every index once: rank r gets
    `global_order()[r::num_replicas]`, which is torch's shard for rank r without its padded tail.
    `state_dict()` is (epoch, samples consumed) plus the layout; `load_state_dict()` makes the next
    iteration of that epoch start at the next sample. `len()` is always the full shard of one epoch
    (what torch reports), also right after a resume: it is the length of an epoch, not what is left.

    >>> s = DistributedSampler(range(10), num_replicas=3, rank=0, shuffle=False, pad=False)
    >>> list(s)
    [0, 3, 6, 9]
    >>> it = iter(s); next(it), next(it)
    (0, 3)
    >>> state = s.state_dict(); resumed = DistributedSampler(range(10), 3, 0, shuffle=False, pad=False)
    >>> resumed.load_state_dict(state); list(resumed)
    [6, 9]
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, pad: bool = True) -> None:
        if num_replicas is None or rank is None:
            world_rank, world_size = _world_rank_and_size()
            num_replicas = world_size if num_replicas is None else num_replicas
            rank = world_rank if rank is None else rank
        given_replicas, given_rank = num_replicas, rank
        num_replicas, rank = _as_int(num_replicas), _as_int(rank)  # numpy integers are fine too
        if num_replicas is None or num_replicas < 1:
            raise DataConfigError(explain("DistributedSampler num_replicas is not a positive integer",
                                          seen=f"num_replicas={given_replicas!r}", expected="an int >= 1"))
        if rank is None or not 0 <= rank < num_replicas:
            raise DataConfigError(explain(
                "DistributedSampler rank is outside the world", seen=f"rank={given_rank!r}",
                expected=f"0 <= rank < num_replicas={num_replicas}",
                fix="Pass the process's global rank (phalanx.rank()), or leave rank=None."))
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self._offset = 0  # samples of the epoch's order consumed before a re-shard (another world size)
        self._relayout()
        self._consumed = 0  # samples of this epoch handed out (or restored)
        self._resume_pending = False  # the next iteration starts at _consumed instead of 0

    # -- layout ------------------------------------------------------------------------------------

    def _relayout(self) -> None:
        self.total_size = self._global_length()
        self.num_samples = self._shard_length(self.rank)

    def _global_length(self) -> int:
        n, replicas = len(self.dataset) - self._offset, self.num_replicas
        if self.drop_last:
            return (n // replicas) * replicas
        if self.pad:
            return -(-n // replicas) * replicas
        return n

    def _shard_length(self, rank: int) -> int:
        return max(0, -(-(self.total_size - rank) // self.num_replicas))

    def global_order(self) -> torch.Tensor:
        """The epoch's order before striding (padded or truncated): rank r reads `[r::num_replicas]` of it.

        After a re-shard (a state saved under another world size) the order starts past the samples
        the old world already consumed; otherwise this is torch's layout exactly.
        """
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        order, n = order[self._offset:], n - self._offset
        if self.total_size > n:  # padding: repeat the order from its head, as often as needed
            order = order.repeat(-(-self.total_size // n))
        return order[:self.total_size]

    def epoch_indices(self, rank: int | None = None) -> list[int]:
        """All indices `rank` (default: this rank) reads in the current epoch, ignoring any resume."""
        rank = self.rank if rank is None else rank
        return self.global_order()[rank::self.num_replicas].tolist()

    # -- iteration and position --------------------------------------------------------------------

    def __iter__(self):
        start = self._consumed if self._resume_pending else 0
        self._resume_pending = False
        self._consumed = start
        return self._count_out(self.epoch_indices()[start:])

    def _count_out(self, indices: list[int]):
        for index in indices:
            # Counted before it leaves: a state taken after receiving it must not replay it.
            self._consumed += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s order from the next iteration on; a restored position survives only for its own epoch."""
        if epoch != self.epoch:
            self._consumed = 0
            self._resume_pending = False
            if self._offset:
                self._offset = 0
                self._relayout()
        self.epoch = epoch

    def state_dict(self) -> dict:
        """The position (epoch, samples consumed by this sampler's iteration) and the layout, as primitives.

        Under a `phalanx.DataLoader`, use the loader's `state_dict()`: the loader draws indices ahead
        of the loop, and only it knows what the loop received.
        """
        return {"epoch": self.epoch, "consumed": self._consumed, "offset": self._offset,
                "num_replicas": self.num_replicas,
                "dataset_len": len(self.dataset), "shuffle": self.shuffle, "seed": self.seed,
                "drop_last": self.drop_last, "pad": self.pad}

    def load_state_dict(self, state: dict) -> None:
        """Set the epoch and make the next iteration start after the `consumed` samples already seen.

        Layout keys that are present must match this sampler (ResumeStateError otherwise).
        `consumed` past this rank's shard (an uneven `pad=False` shard) means the epoch is done here.
        A state saved under another `num_replicas` (an elastic restart with fewer or more ranks) is
        re-sharded: the samples the old world consumed (`consumed * old num_replicas`, counted in the
        epoch's global order) are skipped, and the rest of the epoch is dealt out over the new ranks
        from position 0; later epochs use the normal layout.
        """
        for key in ("epoch", "consumed"):
            if key not in state:
                raise ResumeStateError(explain(f"the sampler state has no '{key}'", rank=self.rank,
                                               seen=sorted(state), expected="keys 'epoch' and 'consumed'",
                                               fix="Pass a state made by state_dict()."))
        mine = self.state_dict()
        for key in LAYOUT_KEYS:
            if key in state and state[key] != mine[key]:
                raise ResumeStateError(explain(
                    f"the saved data position was taken with another {key}", rank=self.rank,
                    seen=f"{key}={state[key]!r} in the state", expected=f"{key}={mine[key]!r} as in this run",
                    fix="Resume with the same world size, dataset and sampler arguments, or do not load the "
                        "data state and start the epoch over."))
        consumed = int(state["consumed"])
        if consumed < 0:
            raise ResumeStateError(explain("the saved number of consumed samples is negative", rank=self.rank,
                                           seen=consumed, expected=">= 0"))
        self.epoch = int(state["epoch"])
        offset = int(state.get("offset", 0))
        saved_replicas = int(state.get("num_replicas", self.num_replicas))
        if saved_replicas != self.num_replicas:
            # Lockstep training: every old rank consumed `consumed` entries of the global order.
            offset, consumed = min(offset + consumed * saved_replicas, len(self.dataset)), 0
        if not 0 <= offset <= len(self.dataset):
            raise ResumeStateError(explain("the saved offset is outside the dataset", rank=self.rank,
                                           seen=offset, expected=f"0..{len(self.dataset)}"))
        if offset != self._offset:
            self._offset = offset
            self._relayout()
        self._consumed = min(consumed, self.num_samples)
        self._resume_pending = True

    @property
    def offset(self) -> int:
        """Samples of the current epoch's order consumed before a re-shard (0 unless the world size changed)."""
        return self._offset
