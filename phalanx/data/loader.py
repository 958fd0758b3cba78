"""`DataLoader`: torch's DataLoader that knows how far the training loop got, for exact resume.

It counts what the loop *received*, not what was fetched: workers prefetch batches ahead, so the
sizes of the index batches are noted in the order the loader draws them and one is taken off per
batch handed out. On resume the sampler starts at the next sample, so skipped batches are never loaded.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.utils.data

from ..diagnose import recorder
from ..errors import DataConfigError, ResumeStateError, explain
from .sampler import DistributedSampler


class _BatchSizeRecorder:
    """Stands in for the loader's index sampler and notes the size of each index batch it hands out."""

    def __init__(self, inner, batched: bool) -> None:
        self.inner = inner
        self.batched = batched
        self.sizes: deque[int] = deque()

    def __iter__(self):
        sizes = self.sizes  # the deque of the pass that started this generator, even if a new pass begins
        for item in self.inner:
            sizes.append(len(item) if self.batched else 1)
            yield item

    def __len__(self) -> int:
        return len(self.inner)


class _CountingIterator:
    """Wraps torch's loader iterator; each batch that reaches the loop advances the pass's position."""

    def __init__(self, inner, sizes: deque, position: dict) -> None:
        self._inner = inner
        self._sizes = sizes  # filled, in order, as torch draws index batches (possibly far ahead)
        self._position = position

    def __iter__(self):
        return self

    def __next__(self):
        recorder.phase(recorder.DATA)
        batch = next(self._inner)
        recorder.beat()  # a batch arrived: progress, even in a loop without collectives (evaluation)
        self._position["batches"] += 1
        self._position["consumed"] += self._sizes.popleft()
        return batch

    def __len__(self) -> int:
        return len(self._inner)


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader (same arguments) with `set_epoch`, `state_dict` and `load_state_dict`.

    The resume contract: restored from a state taken after k batches of an epoch,
    `loader.set_epoch(epoch); for batch in loader:` yields batches k+1, k+2, ... of that epoch.
    `set_epoch` to any other epoch starts at its first batch. Resuming needs a
    `phalanx.DistributedSampler` as `sampler` (or as the `.sampler` of a `batch_sampler` that takes
    its indices in order, like torch's BatchSampler). `len()` is the number of batches of a whole
    epoch, also after a resume (`state_dict()["batches"]` says how many are already done).

    >>> from phalanx import DataLoader, DistributedSampler
    >>> sampler = DistributedSampler(range(12), num_replicas=2, rank=0, shuffle=False)
    >>> loader = DataLoader(range(12), batch_size=2, sampler=sampler)
    >>> it = iter(loader); first = next(it)
    >>> state = loader.state_dict()
    >>> resumed = DataLoader(range(12), batch_size=2, sampler=DistributedSampler(range(12), 2, 0, shuffle=False))
    >>> resumed.load_state_dict(state); [b.tolist() for b in resumed]
    [[4, 6], [8, 10]]
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._recorder = _BatchSizeRecorder(super()._index_sampler, batched=self._auto_collation)
        sampler = self.resumable_sampler()
        self._position = {"epoch": sampler.epoch if sampler is not None else 0, "batches": 0, "consumed": 0}
        self._resume_pending = False

    @property
    def _index_sampler(self):
        # torch's iterators draw indices from this property; handing them the recorder is how the
        # loader learns each batch's size without wrapping (and re-validating) sampler/batch_sampler.
        recorder = self.__dict__.get("_recorder")
        return recorder if recorder is not None else super()._index_sampler

    def resumable_sampler(self) -> DistributedSampler | None:
        """The phalanx DistributedSampler that positions this loader (None if there is none)."""
        candidates = (getattr(self.batch_sampler, "sampler", None), self.sampler)
        return next((s for s in candidates if isinstance(s, DistributedSampler)), None)

    def _epoch(self) -> int:
        sampler = self.resumable_sampler()
        return sampler.epoch if sampler is not None else self._position["epoch"]

    def _require_sampler(self, action: str) -> DistributedSampler:
        sampler = self.resumable_sampler()
        if sampler is None:
            raise DataConfigError(explain(
                f"DataLoader.{action} needs a phalanx.DistributedSampler to position the data",
                seen=f"sampler={type(self.sampler).__name__}, batch_sampler={type(self.batch_sampler).__name__}",
                expected="sampler=phalanx.DistributedSampler(...) (or a batch_sampler whose .sampler is one)",
                fix="Pass sampler=phalanx.DistributedSampler(dataset) (num_replicas=1, rank=0 in one process)."))
        if not self.in_order:
            raise DataConfigError(explain(
                f"DataLoader.{action} needs batches delivered in order", seen="in_order=False",
                expected="in_order=True", fix="Leave in_order at its default (True) to resume exactly."))
        return sampler

    def set_epoch(self, epoch: int) -> None:
        """Forward to the sampler; a restored position is kept if `epoch` is its epoch, else start at 0."""
        sampler = self.resumable_sampler()
        target = sampler if sampler is not None else self.sampler
        if hasattr(target, "set_epoch"):  # also torch's DistributedSampler, for a drop-in loader
            target.set_epoch(epoch)
        if epoch != self._position["epoch"]:
            self._position = {"epoch": epoch, "batches": 0, "consumed": 0}
            self._resume_pending = False

    def __iter__(self):
        epoch = self._epoch()
        resuming = self._resume_pending and self._position["epoch"] == epoch
        if not resuming:
            self._position = {"epoch": epoch, "batches": 0, "consumed": 0}
        self._resume_pending = False
        sampler = self.resumable_sampler()
        if sampler is not None:  # this pass starts at the position: 0, or where a restored state left off
            sampler.load_state_dict({"epoch": epoch, "consumed": self._position["consumed"],
                                     "offset": sampler.offset if resuming else 0})
        sizes = self._recorder.sizes = deque()
        return _CountingIterator(self._start_pass(resuming), sizes, self._position)

    def _start_pass(self, resuming: bool):
        # torch's iterator draws its workers' base seed from the loader's generator (the global one by
        # default). A resumed pass must neither draw again from the restored global state (dropout
        # masks would shift) nor use another seed (worker-side randomness would change): it draws from
        # a copy of the generator state noted when the interrupted pass began.
        saved = self._position.get("seed_state") if resuming else None
        if saved is None:
            source = self.generator
            self._position["seed_state"] = source.get_state() if source is not None else torch.get_rng_state()
            if not resuming:
                return super().__iter__()
            saved = self._position["seed_state"]
        replay = torch.Generator()
        replay.set_state(saved)
        users_generator, self.generator = self.generator, replay
        try:
            return super().__iter__()
        finally:
            self.generator = users_generator

    def state_dict(self) -> dict:
        """(epoch, batches and samples handed to the loop) plus the sampler's layout; primitives only."""
        sampler = self._require_sampler("state_dict")
        state = sampler.state_dict()
        position = self._position if self._position["epoch"] == sampler.epoch else {"batches": 0, "consumed": 0}
        state.update(batches=position["batches"], consumed=position["consumed"])
        if position.get("seed_state") is not None:
            state["seed_state"] = position["seed_state"]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a position: the next pass over `state['epoch']` starts at the batch after the saved one."""
        sampler = self._require_sampler("load_state_dict")
        if "batches" not in state:
            raise ResumeStateError(explain("the loader state has no 'batches'", rank=sampler.rank,
                                           seen=sorted(state), expected="a state made by DataLoader.state_dict()"))
        sampler.load_state_dict(state)
        if sampler.offset != int(state.get("offset", 0)):  # re-sharded for another world size: a fresh pass
            self._position = {"epoch": int(state["epoch"]), "batches": 0, "consumed": 0}
        else:
            self._position = {"epoch": int(state["epoch"]), "batches": int(state["batches"]),
                              "consumed": int(state["consumed"])}
        self._position["seed_state"] = state.get("seed_state")
        self._resume_pending = True
