"""The StepLog across changes of the world (live recovery): no step left out of the records by a loss or a join.

After a loss the ranks left gather on their new control group. The windows ended but not yet written (in a gather
that failed, or completed on some ranks and not on the main one, or not launched yet) are gathered again among
them: the main rank says the last step it wrote, each rank sends its rows of the windows after it, a rank that
joined sends none (NaN rows), and each window's record is made from the rows of the ranks that have it (a lost
rank's rows are gone). A rank that joined counts on from the main rank's step.

A loss can find the ranks left a step apart: one had finished the step's metric and logged the step, another met the
loss in that metric (world/resume_point.py). The rank behind then logs that step once more than the others, and must
not gather there: its window ends without a gather (the main rank writes its own row alone, another rank's is
dropped), and from the next step on every rank gathers at the same steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..world import generation
from ..world import group as world
from . import outputs
from .window import FIELDS, INDEX

_END = INDEX["end_step"]


class FollowsGenerations:
    """StepLog's part under live recovery (steplog.py holds the rest); `_onto_generation` is called with each new
    generation (generation.on_regroup)."""

    _others_logged = 0  # after a loss that found this rank behind: the step count the others had logged

    def _onto_generation(self, current) -> None:
        """Gather on the new generation's control group from now on (made with the generation: no group is made in a
        step), after gathering again what the main rank has not written; the window in progress goes on."""
        # A gather in flight on the old group is dropped with its RowGather: the collective holds its own tensors
        # until it ends, and the old group is freed once it has (world/generation.py).
        after_a_loss = set(current.members) < set(self._members)
        held = self._held + self._in_flight + self._rows
        self._held, self._in_flight, self._rows, self._gather_every = [], [], [], 1
        self.rank, self.world_size, self._members = current.rank, current.world_size, tuple(current.members)
        self._gather = None
        if not self.main and world.is_main():
            self._become_main()
        if self.world_size == 1:
            pending = [row for row in held if row[_END] > self._written_through]
            self._emit([[row] for row in pending], [self._members] * len(pending))
            return
        self._gather = self._control_gather(key=f"{self._key}/generation{current.number}")
        count, mine = self._agree_on_the_count(held, after_a_loss)
        if count:
            self._gather_again(count, mine)

    def _agree_on_the_count(self, held: list, after_a_loss: bool) -> tuple[int, list]:
        """Collective over the new generation: the main rank's step count (a rank that joined logs on from it) and the
        last step it wrote; after a loss, also the highest step count (a rank behind it logs its next steps alone).
        Returns how many windows the main rank has not written, and this rank's rows of them, by step."""
        pending = [row for row in held if row[_END] > self._written_through]
        agreed = torch.tensor([self.steps, self._written_through, len(pending)], dtype=torch.int64)
        group = world.control_group()
        generation.wait_for(dist.broadcast(agreed, group=group, group_src=0, async_op=True),
                            "the StepLog's step count")
        steps, written, count = (int(value) for value in agreed)
        if after_a_loss:
            most = torch.tensor([self.steps], dtype=torch.int64)
            generation.wait_for(dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group, async_op=True),
                                "the StepLog's highest step count")
            self._others_logged = int(most)
        elif steps != self.steps:  # a rank that joined: it logs on from the others' count
            self.steps = self._start_step = steps
            self._known = True
            self._new_window()
            self._mark()
        return count, sorted((row for row in held if row[_END] > written), key=lambda row: row[_END])[:count]

    def _gather_again(self, count: int, mine: list) -> None:
        """Gather `count` rows from each rank that trains (NaN where it has none) and write the main rank's windows,
        each from the rows of the ranks that have it."""
        rows = torch.full((count, len(FIELDS)), float("nan"), dtype=torch.float64)
        if mine:
            rows[:len(mine)] = torch.tensor(mine, dtype=torch.float64)
        self._gather.launch(rows)
        per_rank = [gathered.tolist() for gathered in
                    self._gather.result("the records of the steps before the world changed")]
        if not self.main:
            return
        windows, ranks = [], []
        for own in per_rank[self.rank]:
            if own[_END] != own[_END]:  # NaN: a row of none
                continue
            present = [(member, row) for member, rows in zip(self._members, per_rank) for row in rows
                       if row[_END] == own[_END]]
            windows.append([row for _, row in present])
            ranks.append(tuple(member for member, _ in present))
        self._emit(windows, ranks)

    def _logged_by_the_others(self) -> bool:
        """Whether the window that just ended holds a step the others logged before a loss found this rank behind
        them: then it is not gathered (the others do not gather there); the main rank writes its own row alone."""
        if self.steps > self._others_logged:
            return False
        rows, self._rows = self._rows, []
        if self.main:
            self._emit([[row] for row in rows], [(self._members[self.rank],)] * len(rows))
        return True

    def _become_main(self) -> None:
        """The first rank was lost: this one writes the records from now on, after what the other wrote (in the
        newest records file, when it sees it: a shared file system)."""
        self.main = True
        self._known = True
        self._start_step = self.steps
        self._open_outputs()
        files = outputs.jsonl_files(self.directory)
        if files:
            outputs.trim(files[-1], self.steps)  # what it holds stays; a last line cut short by a kill goes
            self._jsonl = outputs.JsonlFile(files[-1])
            self._written_through = outputs.last_step(files[-1]) or 0
