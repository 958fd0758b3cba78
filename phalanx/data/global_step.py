"""One optimizer step of a global batch, as the loop sees it: `GlobalStep` (its micro-batches, `no_sync` around
all but the last, the loss weights), and the batch sampler that hands torch's DataLoader this rank's
micro-batches in that order.

Every rank runs the same number of micro-batches in a step (a rank short of samples gets a padding
micro-batch that weighs 0), so each forward and backward meets its peers in the same collectives, at any
shard level (FSDP2 all-gathers in every forward).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from ..errors import DataConfigError, PeerDiedError, PeerFailedError, explain
from ..world import generation
from .global_plan import GlobalBatchPlan, StepLayout


class MicroBatchSampler:
    """The loader's batch sampler with a global batch: this rank's micro-batches of steps `first_step`, ...

    Real samples come from the DistributedSampler, in the order of its shard (it starts where the loader
    positioned it); a padding micro-batch holds the step's first sample of the global order.
    """

    def __init__(self, sampler, plan: GlobalBatchPlan) -> None:
        self.sampler = sampler  # the loader finds its DistributedSampler here
        self.plan = plan
        self.first_step = 0  # set by the loader before each pass

    def __iter__(self):
        sampler, plan, first = self.sampler, self.plan, self.first_step
        offset, shard, order = sampler.offset, iter(sampler), None
        for step in range(first, plan.steps_per_epoch):
            layout = plan.step(step, sampler.rank, offset)
            for size in layout.sizes:
                if size:
                    yield [next(shard) for _ in range(size)]
                else:
                    order = sampler.global_order() if order is None else order
                    yield [int(order[layout.first_entry])]

    def __len__(self) -> int:
        return self.plan.micro_batches_per_epoch()


def _sync_off(model, world_size: int, rank: int):
    """The context that keeps `model` from exchanging gradients in a backward (None: the caller does it)."""
    if model is None:
        return nullcontext
    group = getattr(model, "samples_group", getattr(model, "process_group", None))  # DiLoCo's: every host's
    if group is not None and dist.is_available() and dist.is_initialized() and \
            dist.get_world_size(group) != world_size:
        raise DataConfigError(explain(
            "the model averages its gradients over another number of ranks than the sampler deals data to",
            rank=dist.get_rank(), seen=f"a model over {dist.get_world_size(group)} ranks, "
                            f"DistributedSampler(num_replicas={world_size})",
            expected="the same number", fix="Leave num_replicas and rank of the DistributedSampler at their "
                                            "defaults (the world), or give both the same process group's size."))
    if hasattr(model, "no_sync"):  # phalanx's and torch's DistributedDataParallel, at every shard level
        return model.no_sync
    if hasattr(model, "set_requires_gradient_sync"):  # a module torch's fully_shard (FSDP2) wrapped
        @contextmanager
        def fsdp_no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return fsdp_no_sync
    if world_size == 1:
        return nullcontext
    raise DataConfigError(explain(
        "step.micro_batches(model) got a model that does not exchange gradients", rank=rank,
        seen=f"a {type(model).__name__} without no_sync() on {world_size} ranks",
        expected="the DistributedDataParallel-wrapped model (phalanx's or torch's)",
        fix="Pass the wrapped model: step.micro_batches(ddp_model); or model=None if you synchronize yourself."))


class GlobalStep:
    """This rank's part of one optimizer step: iterate `micro_batches(model)`, call `backward(loss)` on each.

    `index`: the step's number in the epoch; `samples`: how many samples it averages over all ranks;
    `sizes` / `weights`: this rank's micro-batches (a size of 0 is a padding micro-batch, weight 0);
    `weight`: the current micro-batch's; `loss`: this rank's part of the step's mean loss (the sum over
    ranks, e.g. `phalanx.metrics.all_reduce_sum(step.loss)`, is the mean over the step's samples);
    `attempt`: 0, or how many times the micro-batch loop started over on another world (a rank was lost);
    `undone`: True once its optimizer step was rolled back after a loss (a sharded model's, before every rank
    finished it): the loader hands the step out again, so a loop that logs each step can skip this one.
    """

    def __init__(self, layout: StepLayout, batches, world_size: int, rank: int, on_done, live=False) -> None:
        self.index, self.samples = layout.index, layout.samples
        self.sizes, self.weights = layout.sizes, layout.weights
        self.weight: float | None = None
        self.loss: torch.Tensor | float = 0.0
        self.undone = False
        self._batches, self._world_size, self._rank, self._on_done = batches, world_size, rank, on_done
        # With live recovery (world/generation.py) a loss regroups the model and the loader, and this step's
        # micro-batch loop starts over on the ranks left.
        self._live, self._model = live, None
        self.attempt = 0
        self._taken = 0
        self._started = False
        self._finished = False
        self._restarted = False

    def _restart(self, layout: StepLayout, batches, world_size: int, rank: int) -> None:
        """This step again from its first micro-batch, split as `layout` (DataLoader.regroup: another world)."""
        self.samples, self.sizes, self.weights = layout.samples, layout.sizes, layout.weights
        self._batches, self._world_size, self._rank = batches, world_size, rank
        self.loss, self._taken, self._restarted = 0.0, 0, self._started
        self.attempt += 1

    @property
    def num_micro_batches(self) -> int:
        return len(self.sizes)

    @property
    def done(self) -> bool:
        """All micro-batches were handed out and the micro-batch loop ended (or the next step was taken)."""
        return self._finished

    def micro_batches(self, model=None):
        """Yield this step's micro-batches, all but the last inside `model.no_sync()` (the last one's backward
        exchanges the gradients accumulated over all of them)."""
        if self._started:
            raise DataConfigError(explain(
                f"micro_batches() was called twice for step {self.index}", rank=self._rank,
                seen="a second call", expected="one pass over a step's micro-batches",
                fix="Take the next step from the loader (for step in loader: ...)."))
        self._started = True
        self._model = model if hasattr(model, "regroup") else None
        sync_off = _sync_off(model, self._world_size, self._rank)
        j = 0
        try:
            while j < len(self.sizes):
                batch = self._next_batch()
                self.weight = self.weights[j]
                with sync_off() if j < len(self.sizes) - 1 else nullcontext():
                    yield batch
                j = 0 if self._restarted else j + 1  # re-split by DataLoader.regroup: the loop starts over
                self._restarted = False
        finally:
            self.weight = None
        self._finish()

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """`(loss * weight).backward()`: `loss` is the mean over the current micro-batch."""
        if self.weight is None:
            raise DataConfigError(explain(
                "step.backward(loss) was called outside step.micro_batches()", rank=self._rank,
                seen=f"step {self.index}, no current micro-batch",
                expected="a call inside `for batch in step.micro_batches(model):`",
                fix="Call step.backward(loss) once per micro-batch, inside the micro-batch loop."))
        weight, last = self.weight, self._taken == len(self.sizes)
        recovering = self._live and self._model is not None
        # After the last backward's exchange, the step is applied only if every rank may apply it: a commit,
        # unless the exchange itself ends alike on every rank.
        commit = recovering and last and not getattr(self._model, "_steps_settle_alike", lambda: False)()
        try:
            (loss * weight).backward(**kwargs)
            failed_elsewhere = commit and not generation.commit_step()
        except PeerFailedError as lost:
            if not recovering:
                raise
            generation.fail_step()
            generation.recover(lost, redoing=True)
            return
        if failed_elsewhere:
            generation.recover(PeerDiedError(f"another rank could not apply step {self.index}"), redoing=True)
            return
        self.loss = loss.detach() * (weight / self._world_size) + self.loss  # stays on the loss's device

    def _next_batch(self):
        batch = next(self._batches)
        self._taken += 1
        return batch

    def _finish(self) -> None:
        """The step's micro-batches are all handed out: it counts as done (the loader's position moves past it)."""
        while self._taken < len(self.sizes):  # the loop left some: skip them, so the next step starts right
            self._next_batch()
        self._started = self._finished = True
        self.weight = None
        self._on_done(self.index)


class StepIterator:
    """Yields a `GlobalStep` per optimizer step of the pass; a step left unfinished is skipped past first."""

    def __init__(self, plan: GlobalBatchPlan, rank: int, offset: int, first_step: int, batches, on_done,
                 live=False) -> None:
        self._plan, self._rank, self._offset = plan, rank, offset
        self._next_step, self._batches, self._on_done = first_step, batches, on_done
        self._live = live
        self._current: GlobalStep | None = None

    def __iter__(self):
        return self

    def in_flight(self) -> GlobalStep | None:
        """The step handed out last, if its micro-batch loop has not ended."""
        return self._current if self._current is not None and not self._current.done else None

    def adopt(self, other: StepIterator, in_flight: GlobalStep | None) -> None:
        """Go on as `other`, the same pass re-split (DataLoader.regroup); `in_flight`, the step `other` starts at,
        starts its micro-batch loop over on the new split instead of being handed out again."""
        self._plan, self._rank, self._offset = other._plan, other._rank, other._offset
        self._next_step, self._batches, self._on_done = other._next_step, other._batches, other._on_done
        self._live, self._current = other._live, None
        if in_flight is not None:
            in_flight._restart(self._plan.step(self._next_step, self._rank, self._offset), self._batches,
                               self._plan.world_size, self._rank)
            self._current, self._next_step = in_flight, self._next_step + 1

    def __next__(self) -> GlobalStep:
        if self._current is not None and not self._current.done:
            self._current._finish()
        if self._next_step >= self._plan.steps_per_epoch:
            raise StopIteration
        layout = self._plan.step(self._next_step, self._rank, self._offset)
        self._current = GlobalStep(layout, self._batches, self._plan.world_size, self._rank, self._on_done,
                                   self._live)
        self._next_step += 1
        return self._current
