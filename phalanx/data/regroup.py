"""A global-batch loader re-split in-process over another world: the ranks left after a loss, from the step
in flight on.

Step s of an epoch averages entries [s*B, (s+1)*B) of the epoch's global order at any world size
(global_plan.py), so a world that changes between two steps changes who reads which of those entries, not
which entries the step averages: the rest of the epoch is dealt over the new ranks from step s's first entry,
as a resume at another world size does from a checkpoint (loader.py, `load_state_dict`). Here nothing is
saved or restarted: the loader's position is re-dealt in place, the pass in progress (`for step in loader`)
goes on at step s on the new split, and a step whose micro-batch loop is under way starts that loop over
(its first micro-batch next, the new split's sizes and weights, its loss at zero): the model's `regroup`
dropped the gradients it had accumulated.
"""

from __future__ import annotations

import weakref

from ..diagnose import progress
from ..errors import DataConfigError, explain
from ..log import logger
from ..world import generation
from .global_plan import GlobalBatchPlan


def follow_generations(loader) -> bool:
    """With live recovery on (a minimum world size, world/generation.py), have a global-batch loader regroup
    onto each new generation (once per loader), and say which process this rank is; True when it is on. Off,
    a loss ends the run."""
    if not generation.live_recovery():
        return False
    if loader.plan is None:
        generation.say_mode(False, "a DataLoader without global_batch_size cannot re-split its steps over the ranks "
                                   "left")
        return False
    generation.say_mode(True, "the loop's steps are a global batch's")
    generation.announce()
    if not loader._follows_generations:
        loader._follows_generations = True
        generation.on_regroup(loader._onto_generation)
    return True


def regroup_onto(loader, survivors) -> None:
    """A new generation (live recovery): the loader re-split over its ranks from the step in flight, or, when the
    step the loop finished last was rolled back (a sharded optimizer's step that could not count everywhere),
    from that step, which the loop is handed again (the one it saw says `undone`)."""
    if not generation.undoing():
        loader.regroup(survivors.rank, survivors.world_size)
        return
    live = loader._live_steps()
    if live is not None and live._current is not None:
        live._current.undone = True
    loader.regroup(survivors.rank, survivors.world_size, step=max(0, loader._position["steps"] - 1))


def regroup_loader(loader, rank: int, world_size: int, step: int | None) -> None:
    """DataLoader.regroup's work (see there)."""
    plan = loader.plan
    if plan is None:
        raise DataConfigError(explain(
            "DataLoader.regroup needs a global batch: a per-rank batch's samples depend on the world size",
            rank=rank, seen="DataLoader(batch_size=...) without global_batch_size",
            expected="DataLoader(..., global_batch_size=B)",
            fix="Pass global_batch_size= (docs/data.md, \"A global batch\"): every step then averages the same "
                "samples at any world size, and a smaller world can take the rest of the epoch over."))
    sampler = loader._require_sampler("regroup")
    if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size):
        raise DataConfigError(explain("DataLoader.regroup got a rank outside the world", rank=rank,
                                      seen=f"rank={rank!r}, world_size={world_size!r}",
                                      expected="0 <= rank < world_size",
                                      fix="Pass this rank's place in the new group."))
    live = loader._live_steps()
    in_flight = live.in_flight() if live is not None else None
    if in_flight is not None and step is not None and step != in_flight.index:
        raise DataConfigError(explain(
            "DataLoader.regroup was asked to start at another step than the one in flight", rank=rank,
            seen=f"step={step} while step {in_flight.index}'s micro-batch loop is under way",
            expected=f"step={in_flight.index} or None", fix="Leave step=None: the step in flight starts over."))
    first = step if step is not None else (in_flight.index if in_flight is not None else loader._position["steps"])
    if not 0 <= first <= plan.steps_per_epoch:
        raise DataConfigError(explain("DataLoader.regroup's step is outside the epoch", rank=rank,
                                      seen=f"step={first}", expected=f"0..{plan.steps_per_epoch}"))
    state = {**loader.state_dict(), "steps": first}  # the epoch, the layout, the pass's seed: what a resume loads
    new_plan = GlobalBatchPlan.build(global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size,
                                     world_size=world_size, dataset_len=plan.dataset_len, drop_last=plan.drop_last,
                                     rank=rank)
    sampler.rank, sampler.num_replicas = rank, world_size
    sampler._relayout()
    loader.plan = loader._micro_sampler.plan = new_plan
    loader._load_global_position(sampler, state)  # another num_replicas than the state's: re-dealt from `first`
    progress.plan(**new_plan.as_dict())
    if rank == 0:
        logger.info("%s from step %d of epoch %d (regrouped from %d ranks)", new_plan, first, sampler.epoch,
                    plan.world_size)
    if live is not None:
        live.adopt(loader._iter_steps(True), in_flight)
        loader._live_steps = weakref.ref(live)  # the user's loop holds this one, not the pass just made
        loader._resume_pending = False
