"""`DataLoader`: torch's DataLoader that knows how far the training loop got, for exact resume.

It counts what the loop *received*, not what was fetched: workers prefetch batches ahead, so the
sizes of the index batches are noted in the order the loader draws them and one is taken off per
batch handed out. On resume the sampler starts at the next sample, so skipped batches are never loaded.
With `global_batch_size=B` it yields one `GlobalStep` per optimizer step instead (global_step.py), and
keeps its position in steps of the epoch, which mean the same samples at any world size.
"""

from __future__ import annotations

import inspect
import weakref
from collections import deque

import torch
import torch.utils.data

from ..diagnose import progress, recorder, step_clock
from ..errors import DataConfigError, ResumeStateError, explain
from ..log import logger
from .global_plan import GlobalBatchPlan
from .global_step import MicroBatchSampler, StepIterator
from .regroup import follow_generations, regroup_loader, regroup_onto
from .sampler import LAYOUT_KEYS, DistributedSampler

_TORCH_ARGUMENTS = inspect.signature(torch.utils.data.DataLoader.__init__)


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
        started = step_clock.now_ns()
        try:
            batch = next(self._inner)
        finally:  # StopIteration included: the wait for the epoch's end is data wait too
            step_clock.add_data_wait(step_clock.now_ns() - started)
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

    With `global_batch_size=B` (and `batch_size`, a micro-batch) it yields one `GlobalStep` per optimizer
    step instead: step s averages entries [s*B, (s+1)*B) of the epoch's order at any world size, `len()`
    counts steps, `plan` says how B is split, and the state is a position in steps that any world size
    resumes (docs/data.md, "A global batch").

    >>> from phalanx import DataLoader, DistributedSampler
    >>> sampler = DistributedSampler(range(12), num_replicas=2, rank=0, shuffle=False)
    >>> loader = DataLoader(range(12), batch_size=2, sampler=sampler)
    >>> it = iter(loader); first = next(it)
    >>> state = loader.state_dict()
    >>> resumed = DataLoader(range(12), batch_size=2, sampler=DistributedSampler(range(12), 2, 0, shuffle=False))
    >>> resumed.load_state_dict(state); [b.tolist() for b in resumed]
    [[4, 6], [8, 10]]
    """

    def __init__(self, *args, global_batch_size: int | None = None, **kwargs) -> None:
        self.plan: GlobalBatchPlan | None = None  # with a global batch: how it is split (world, micro-batches)
        if global_batch_size is not None:
            args, kwargs = self._plan_global_batch(global_batch_size, args, kwargs)
        super().__init__(*args, **kwargs)
        if self.plan is not None:
            # torch put a SequentialSampler here (it takes batch_sampler alone); `loader.sampler.set_epoch(e)`,
            # torch's idiom, must reach the DistributedSampler. torch reads .sampler only without a batch_sampler.
            object.__setattr__(self, "sampler", self._micro_sampler.sampler)
        self._recorder = _BatchSizeRecorder(super()._index_sampler, batched=self._auto_collation)
        sampler = self.resumable_sampler()
        self._position = _fresh(sampler.epoch if sampler is not None else 0)
        self._resume_pending = False
        self._live_steps = lambda: None  # the StepIterator of the pass under way, weakly (_iter_steps)
        self._follows_generations = False  # live recovery: regrouped onto each new generation (regroup.py)
        if self.plan is not None:
            progress.plan(**self.plan.as_dict())
            if sampler.rank == 0:
                logger.info("%s", self.plan)

    def _plan_global_batch(self, global_batch_size, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Check the arguments a global batch needs; hand torch a batch sampler of this rank's micro-batches."""
        given = _TORCH_ARGUMENTS.bind(None, *args, **kwargs).arguments
        given.pop("self")
        sampler = given.get("sampler")
        rank = sampler.rank if isinstance(sampler, DistributedSampler) else None

        def refuse(problem, seen, expected, fix):
            raise DataConfigError(explain(f"DataLoader(global_batch_size={global_batch_size!r}) {problem}",
                                          rank=rank, seen=seen, expected=expected, fix=fix))

        if given.get("batch_sampler") is not None:
            refuse("builds its own batches", f"batch_sampler={type(given['batch_sampler']).__name__}",
                   "no batch_sampler", "Pass sampler=phalanx.DistributedSampler(dataset) and batch_size= instead.")
        if not isinstance(sampler, DistributedSampler):
            refuse("needs a phalanx.DistributedSampler to deal each step's samples over the ranks",
                   f"sampler={type(sampler).__name__ if sampler is not None else None}",
                   "sampler=phalanx.DistributedSampler(dataset)",
                   "Pass sampler=phalanx.DistributedSampler(dataset, shuffle=True) (num_replicas=1, rank=0 alone).")
        if given.get("shuffle"):
            refuse("takes its order from the sampler", "shuffle=True", "shuffle unset",
                   "Drop shuffle=; pass shuffle= to the DistributedSampler.")
        if sampler.drop_last:
            refuse("cannot use a sampler that cuts the epoch to a multiple of the world size (that cut changes "
                   "with the world size)", "DistributedSampler(drop_last=True)", "drop_last=False",
                   "Pass drop_last=True to the DataLoader instead: it drops the epoch's last, partial global batch.")
        if "batch_size" not in given:
            refuse("needs batch_size, the micro-batch", "no batch_size", "batch_size=<samples per forward>",
                   "Pass batch_size=, the most samples one forward pass takes, e.g. 16.")
        self.plan = GlobalBatchPlan.build(global_batch_size=global_batch_size, micro_batch_size=given["batch_size"],
                                          world_size=sampler.num_replicas, dataset_len=len(sampler.dataset),
                                          drop_last=bool(given.get("drop_last", False)), rank=rank)
        for name in ("batch_size", "shuffle", "sampler", "drop_last"):
            given.pop(name, None)
        self._micro_sampler = MicroBatchSampler(sampler, self.plan)
        return (), {**given, "batch_sampler": self._micro_sampler}

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
            self._position = _fresh(epoch)
            self._resume_pending = False

    def __len__(self) -> int:
        """Batches of a whole epoch; with a global batch, optimizer steps of a whole epoch (at any world size)."""
        return self.plan.steps_per_epoch if self.plan is not None else super().__len__()

    def __iter__(self):
        epoch = self._epoch()
        resuming = self._resume_pending and self._position["epoch"] == epoch
        if not resuming:
            self._position = _fresh(epoch)
        self._resume_pending = False
        if self.plan is not None:
            return self._iter_steps(resuming)
        sampler = self.resumable_sampler()
        if sampler is not None:  # this pass starts at the position: 0, or where a restored state left off
            sampler.load_state_dict({"epoch": epoch, "consumed": self._position["consumed"],
                                     "offset": sampler.offset if resuming else 0})
        sizes = self._recorder.sizes = deque()
        follow_generations(self)  # live recovery needs a global batch: says so
        return _CountingIterator(self._start_pass(resuming), sizes, self._position)

    def _iter_steps(self, resuming: bool) -> StepIterator:
        """A pass of GlobalSteps from the position's step on; the sampler resumes at this rank's next sample."""
        sampler, plan = self.resumable_sampler(), self.plan
        offset, first = (sampler.offset if resuming else 0), self._position["steps"]
        boundary = offset % plan.global_batch_size == 0 or offset == plan.dataset_len  # where a step starts
        if not boundary or offset > first * plan.global_batch_size:
            raise DataConfigError(explain(
                "the sampler's re-shard offset is not at a global-batch boundary before the loader's position",
                rank=sampler.rank, seen=f"offset={offset}, steps={first}",
                expected=f"a multiple of global_batch_size={plan.global_batch_size}, at most "
                         f"{first * plan.global_batch_size}",
                fix="Restore the position with DataLoader.load_state_dict, not the sampler's."))
        sampler.load_state_dict({"epoch": sampler.epoch, "offset": offset,
                                 "consumed": plan.consumed_before(first, sampler.rank, offset)})
        self._micro_sampler.first_step = first
        sizes = self._recorder.sizes = deque()
        batches = _CountingIterator(self._start_pass(resuming), sizes, self._position)
        steps = StepIterator(plan, sampler.rank, offset, first, batches, self._step_done, follow_generations(self))
        self._live_steps = weakref.ref(steps)  # the pass DataLoader.regroup re-splits
        return steps

    def _onto_generation(self, survivors) -> None:
        regroup_onto(self, survivors)

    def regroup(self, rank: int, world_size: int, step: int | None = None) -> None:
        """Deal the rest of the epoch over `world_size` ranks, this process being `rank`, from step `step` on
        (default: the step in flight, else the next one), in place. Each step keeps its samples, as on a resume
        at another world size, so none is lost or used twice. The pass in progress (`for step in loader:`)
        goes on at that step, re-split; a step whose micro-batch loop is under way starts it over on the new
        split. With a global batch only. Live recovery calls it on each rank left, after the model's `regroup`.

        >>> loader.regroup(rank=survivors.index(old_rank), world_size=len(survivors))   # doctest: +SKIP
        """
        regroup_loader(self, rank, world_size, step)

    def _step_done(self, step: int) -> None:
        self._position["steps"] = step + 1

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
        """(epoch, batches and samples handed to the loop) plus the sampler's layout; primitives only.

        With a global batch: (epoch, `steps` done, `samples` of the epoch's global order they used, the
        sampler's `offset`) plus the layout and `global_batch_size`, the same on every rank; a step counts
        once its micro-batch loop ended.
        """
        sampler = self._require_sampler("state_dict")
        state = sampler.state_dict()
        position = self._position if self._position["epoch"] == sampler.epoch else _fresh(sampler.epoch)
        if self.plan is not None:
            del state["consumed"]  # this rank's count: a global position is the same on every rank
            steps = position["steps"]
            state.update(global_batch_size=self.plan.global_batch_size, steps=steps,
                         samples=min(steps * self.plan.global_batch_size, self.plan.dataset_len))
        else:
            state.update(batches=position["batches"], consumed=position["consumed"])
        if position.get("seed_state") is not None:
            state["seed_state"] = position["seed_state"]
        return state

    def rank_random_state(self) -> dict:
        """This rank's own part of the position (the Checkpointer saves it with each rank's random states): the
        generator state its pass began with, which a resumed pass draws its workers' seeds from. Each rank has its
        own (its own stream); state_dict() holds the one of the rank that saves it."""
        seed_state = self.state_dict().get("seed_state")
        return {} if seed_state is None else {"seed_state": seed_state}

    def load_rank_random_state(self, states: dict) -> None:
        """After load_state_dict(): this rank's own part of the position, as rank_random_state() gave it."""
        if "seed_state" in states:
            self._position["seed_state"] = states["seed_state"]

    def load_state_dict(self, state: dict) -> None:
        """Restore a position: the next pass over `state['epoch']` starts at the batch after the saved one."""
        sampler = self._require_sampler("load_state_dict")
        if self.plan is not None or "global_batch_size" in state:
            return self._load_global_position(sampler, state)
        if "batches" not in state:
            raise ResumeStateError(explain("the loader state has no 'batches'", rank=sampler.rank,
                                           seen=sorted(state), expected="a state made by DataLoader.state_dict()"))
        sampler.load_state_dict(state)
        if sampler.offset != int(state.get("offset", 0)):  # re-sharded for another world size: a fresh pass
            self._position = _fresh(int(state["epoch"]))
        else:
            self._position = {**_fresh(int(state["epoch"])), "batches": int(state["batches"]),
                              "consumed": int(state["consumed"])}
        self._position["seed_state"] = state.get("seed_state")
        self._resume_pending = True

    def _load_global_position(self, sampler: DistributedSampler, state: dict) -> None:
        """Resume at the step after the saved one. Saved at another world size, the rest of the epoch is dealt
        over these ranks from that step's first sample (the sampler's re-shard), so each step keeps its samples."""
        plan, saved = self.plan, state.get("global_batch_size")
        if plan is None or saved != plan.global_batch_size or "steps" not in state:
            mine = plan.global_batch_size if plan is not None else None
            raise ResumeStateError(explain(
                "the saved data position was taken with another global batch size", rank=sampler.rank,
                seen=f"global_batch_size={saved!r} in the state", expected=f"global_batch_size={mine!r} as in this run",
                fix="Resume with the DataLoader's global_batch_size of the saved run (a step then means the same "
                    "samples), or do not load the data state and start the epoch over."))
        steps = int(state["steps"])
        if not 0 <= steps <= plan.steps_per_epoch:
            raise ResumeStateError(explain("the saved number of steps is outside the epoch", rank=sampler.rank,
                                           seen=f"steps={steps}", expected=f"0..{plan.steps_per_epoch}"))
        offset = int(state.get("offset", 0))
        if int(state.get("num_replicas", sampler.num_replicas)) != sampler.num_replicas:
            offset = min(steps * plan.global_batch_size, plan.dataset_len)  # the steps done: re-deal the rest
        layout = {key: state[key] for key in LAYOUT_KEYS if key in state}
        sampler.load_state_dict({**layout, "epoch": int(state["epoch"]), "offset": offset,
                                 "num_replicas": sampler.num_replicas,
                                 "consumed": plan.consumed_before(steps, sampler.rank, offset)})
        self._position = {**_fresh(int(state["epoch"])), "steps": steps, "seed_state": state.get("seed_state")}
        self._resume_pending = True


def _fresh(epoch: int) -> dict:
    """The position at the start of `epoch`: no batches, samples or steps handed to the loop yet."""
    return {"epoch": epoch, "batches": 0, "consumed": 0, "steps": 0}
