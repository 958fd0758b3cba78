"""world/resume_point.py on 3 ranks over Gloo: at a regroup, the ranks left compare how many of the collectives that
redo themselves (a metric's, a save) each finished. Ranks one behind take the last one's result from the first rank
that finished it, the same value on every rank; a rank ahead of a save, whose result cannot be handed over, makes
the regroup fail on every rank with MembershipError, never a hang. (The same, in a whole run with a rank SIGKILLed in
a metric that ended on one rank only: tests/ranks/test_live_recovery.py, moments "metric" and "metric-to-1".)"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.errors import MembershipError
from phalanx.testing import run_ranks
from phalanx.world import generation, resume_point


def _settle_after(rank: int, ahead: tuple[int, ...], result_kind: str):
    """Ranks in `ahead` finished one more collective (a metric's sum, or a save's path) than the others, which are in
    it; every rank settles on the world's Gloo group. Returns what each ends with."""
    resume_point.restart_count()
    for value in (1.0, 2.0):  # two collectives every rank finished
        resume_point.entering("a metric's collective", torch.tensor([value]))
        resume_point.finished(torch.tensor([value * 3]))
    like = torch.zeros(2, dtype=torch.float64) if result_kind == "metric" else None
    resume_point.entering("a metric's collective" if like is not None else "a checkpoint's save", like)
    if rank in ahead:
        resume_point.finished(torch.tensor([7.0, 8.0 + rank], dtype=torch.float64) if like is not None else "path")
    try:
        resume_point.settle(dist.group.WORLD, rank, generation.wait_for)
    except MembershipError as error:
        return str(error)
    handed = resume_point.take_handed()
    return None if handed is None else handed.tolist()


def test_the_ranks_behind_take_the_result_of_the_first_rank_that_finished():
    results = run_ranks(_settle_after, 3, ((1, 2), "metric"), timeout=60)
    assert results == [[7.0, 9.0], None, None], results  # rank 1's, the first ahead; ranks 1 and 2 redo nothing


def test_ranks_level_with_each_other_take_nothing():
    assert run_ranks(_settle_after, 3, ((0, 1, 2), "metric"), timeout=60) == [None, None, None]
    assert run_ranks(_settle_after, 3, ((), "metric"), timeout=60) == [None, None, None]


def test_a_rank_ahead_of_a_save_fails_the_regroup_on_every_rank_with_what_to_do():
    results = run_ranks(_settle_after, 3, ((0,), "save"), timeout=60)
    for rank, error in enumerate(results):
        assert error is not None and f"[rank {rank}]" in error, results
        assert "collectives finished per rank of the new group [3, 2, 2]" in error, error
        assert "restart from its newest checkpoint" in error, error


def _settle_applied(rank: int, applied: tuple[int, ...]):
    resume_point.restart_count()
    try:
        resume_point.settle(dist.group.WORLD, rank, generation.wait_for, applied[rank])
    except MembershipError as error:
        return str(error)
    return None


def test_ranks_left_that_applied_different_steps_fail_the_regroup_on_every_rank():
    """The ranks left must have applied the same steps of the generation before (a rank in doubt about a step waits
    for a rank that applied it; past the membership timeout it would not): a difference is a restart, never a split."""
    assert run_ranks(_settle_applied, 3, ((4, 4, 4),), timeout=60) == [None, None, None]
    results = run_ranks(_settle_applied, 3, ((4, 3, 4),), timeout=60)
    for rank, error in enumerate(results):
        assert error is not None and f"[rank {rank}]" in error, results
        assert "the last step applied, per rank of the new group: [4, 3, 4]" in error, error
        assert "PHALANX_MEMBERSHIP_TIMEOUT" in error, error
