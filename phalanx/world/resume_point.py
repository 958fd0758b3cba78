"""One agreed place to resume after a loss: the collectives that redo themselves after a loss (a metric's all-reduce,
a save: generation.again_after_loss), counted on each rank, and compared by the ranks left when they regroup.

A peer lost in the middle of a collective can leave it finished on some of the ranks left and not on others: Gloo's
all-reduce ends on a rank once its own part came in, and a broadcast on its source once it was sent. The ranks that
finished went on to their next collective and meet the loss there; the others meet it in this one. Each would then
redo its own, different, collective on the new group, and the two would wait on each other for ever. So at the
regroup the ranks left compare how many such collectives each finished (settle): a rank one behind takes the result
from a rank that finished it, and every rank resumes at the same collective with the same value. A collective whose
result cannot be handed over (a save) makes that regroup fail with MembershipError (a restart from the newest
checkpoint), never a hang.

The count starts at 0 with the run and again at each join (every member is then at the same step); a loss does not
reset it, since the ranks left line up on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import MembershipError, explain

_finished = 0  # collectives finished here since the run began or the last join
_last = None  # the last one's result, when it is a tensor (what a rank behind would take)
_in_flight = None  # the collective under way here: (what it is, a tensor like its result, or None)
_handed = None  # set by settle() on a rank that was behind: the result of the collective it was in


def entering(what: str, like: torch.Tensor | None) -> None:
    """A collective that again_after_loss runs begins; `like`: a tensor of its result's shape and dtype, when a rank
    behind may take that result from another (None: it cannot)."""
    global _in_flight, _handed
    _in_flight, _handed = (what, like), None


def finished(result) -> None:
    """The collective under way ended here with `result` (the same on every rank that finished it)."""
    global _finished, _last, _in_flight
    _finished += 1
    # A copy: the caller may change the tensor it got in place (a mean divided into it), not what was reduced.
    _last = result.detach().clone() if isinstance(result, torch.Tensor) else None
    _in_flight = None


def abandoned() -> None:
    """The collective under way ended here in an error that is not a loss: it is no longer under way."""
    global _in_flight
    _in_flight = None


def take_handed():
    """After a regroup, the result of the collective under way here that a rank ahead handed over (settle), or None
    (this rank was not behind: it redoes the collective with the others)."""
    global _handed
    handed, _handed = _handed, None
    return handed


def restart_count() -> None:
    """At a join: every member is at the same step, and a joiner has run none of the run's collectives."""
    global _finished, _last
    _finished, _last = 0, None


def settle(group, rank: int, wait, applied: int = -1) -> None:
    """Collective over the ranks left after a loss, on their new Gloo `group` (None: one rank left): compare how many
    collectives each finished; those one behind take the last one's result from the first rank that finished it.
    `rank`: this rank's (for the errors); `wait(work, what)`: a watched wait (generation.wait_for); `applied`: the
    last step of the generation before that this rank applied, the same on every rank left (else the regroup fails:
    generations/commit.py's ranks in doubt, past the membership timeout)."""
    global _handed
    if group is None:
        return
    like = _in_flight[1] if _in_flight is not None else None
    mine = torch.tensor([_finished, int(_last is not None), int(like is not None), applied], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(group.size())]
    wait(dist.all_gather(everyone, mine, group=group, async_op=True), "the ranks' collectives finished, at a regroup")
    steps = [int(row[3]) for row in everyone]
    if len(set(steps)) > 1:
        raise MembershipError(explain(
            "the ranks left applied different steps before the loss", rank=rank,
            seen=f"the last step applied, per rank of the new group: {steps}", expected="the same step on each",
            fix="A rank in doubt about a step's outcome waited past the membership timeout for a rank that applied "
                "it (PHALANX_MEMBERSHIP_TIMEOUT): the run falls back to a restart from its newest checkpoint."))
    counts = [int(row[0]) for row in everyone]
    most, least = max(counts), min(counts)
    if most == least:
        return
    ahead = counts.index(most)
    behind = [index for index, count in enumerate(counts) if count < most]
    what = _in_flight[0] if _in_flight is not None and _finished < most else "a collective"
    if most - least > 1 or not int(everyone[ahead][1]) or not all(int(everyone[i][2]) for i in behind):
        raise MembershipError(explain(
            "the ranks left stopped at different collectives when a rank was lost, and this one's result cannot be "
            "handed over", rank=rank, seen=f"collectives finished per rank of the new group {counts}, the ranks "
                                          f"behind in {what}",
            expected="each rank at most one behind, in a collective whose result is a tensor (a metric)",
            fix="The run falls back to a restart from its newest checkpoint. A loss during a save can do this: "
                "the ranks that finished the save went on."))
    buffer = (_last if _finished == most else like).detach().to("cpu", copy=True).contiguous()
    wait(dist.broadcast(buffer, group=group, group_src=ahead, async_op=True),
         "the result of a collective the lost rank left unfinished here, at a regroup")
    if _finished < most:
        _handed = buffer.to(like.device)  # finished() counts it once again_after_loss returns it
