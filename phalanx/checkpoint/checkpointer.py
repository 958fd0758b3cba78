"""`Checkpointer`: save a training run's state, resume it exactly, and save once more when asked to stop.

Every rank calls `save(state)`: every rank's random states are gathered (and a sharded optimizer's
state, to torch's unsharded format). In the background (the default) each rank snapshots its share
into a reused staging buffer and returns; its writer process writes it, and rank 0's commits the
checkpoint once every rank's part is written (saving/in_background.py on background/; the replicated model and
optimizer are spread over the ranks, spreading.py). With async_save=False rank 0 writes one file
(atomically, see atomic_files.py) with the unwrapped model, the other stateful objects and the plain
values, and all ranks pass a barrier (saving/synchronous.py).
`restore(state)` loads the newest complete file on every rank (restoring.py). `step(state)`, once per
optimizer step, saves every N steps and, when a stop is requested of any rank, saves at a step all
ranks agree on (agreement.py) and ends the process: a preempted job loses no step. Under live recovery
it also takes in ranks that join the run, and a joiner's restore() loads the state they hand it (handover.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..diagnose import progress, recorder
from ..errors import CheckpointError, explain
from ..log import logger
from ..world import generation, joining, step_count, stop
from ..world import group as world
from . import atomic_files, background, handover, random_state, restoring
from .agreement import StopAgreement
from .audit_trail import AuditTrail
from .background import BackgroundSaves
from .saving import in_background, synchronous
from .saving.decisions import FAILED, LOAD, NOTHING, agree_on_writes, from_rank0


class Checkpointer:
    """Atomic, safely loadable checkpoints of a training run in `directory`, keeping the last `keep`.

    `state` maps names to objects with state_dict()/load_state_dict() (models, DDP-wrapped or not,
    optimizers, schedulers, GradScaler, phalanx.DataLoader / DistributedSampler) and to plain values
    (numbers, strings, small lists and dicts), which `restore` writes back into the dict. Every
    rank's random states are saved and restored too. Call `save`, `restore` and `step` on every rank;
    `step(state)` once per optimizer step saves every `every` steps, and once more, at a step all ranks
    agree on, when the job is asked to stop (SIGTERM, SIGINT, SIGUSR1), then ends the process.

    With `async_save=True` (the default) a save returns once the state is copied into a reused staging
    buffer; a writer process commits it in the background (`wait()` waits for that), each rank writing
    its share of the replicated model and optimizer. `async_save=False` writes before returning.

    >>> import phalanx as px, torch                                  # doctest: +SKIP
    >>> px.init()
    >>> model = px.DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> state = {"model": model, "optimizer": opt, "step": 0}
    >>> ckpt = px.Checkpointer("runs/demo", keep=2)
    >>> ckpt.restore(state)                  # False on the first run, True after a restart
    False
    >>> state["step"] += 1; ckpt.save(state)
    PosixPath('runs/demo/ckpt-00000001.pt')
    >>> ckpt.wait()                          # committed
    """

    def __init__(self, directory, keep: int = 2, *, every: int | None = None, timeout: float | None = None,
                 async_save: bool = True):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(explain("Checkpointer keep must be a positive number of checkpoints",
                                     seen=f"keep={keep!r}", expected="an int >= 1", fix="Pass keep=2 (the default)."))
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(explain("Checkpointer every must be a positive number of steps", seen=f"every={every!r}",
                                     expected="an int >= 1, or None (save only when asked to stop, or by save())",
                                     fix="Pass every=1000, say: a save every 1000 calls of step()."))
        self.directory = Path(directory)
        self.keep = keep
        self.every = every
        self.timeout = timeout  # seconds the barrier after a save waits for all ranks (None: PHALANX_TIMEOUT)
        self.saved_world_size: int | None = None  # world size of the checkpoint last restored
        self.steps = 0  # calls of step(), counted on from the restored checkpoint's
        self._agreement: StopAgreement | None = None
        self._last_save = (None, 0.0)  # (path, seconds) of the newest save
        self.async_save = bool(async_save)
        self._background = BackgroundSaves(self.directory) if self.async_save else None
        self._trail = AuditTrail(self)  # the saves the replica audit vouches for, or sets aside
        progress.checkpointer(str(self.directory))
        self._agree_after = 0  # live recovery: the ranks left start their stop agreement past this step count
        if generation.live_recovery():
            generation.on_regroup(self._onto_generation)
        if every is not None:  # the loop will call step(): a stop request can wait for it
            stop.listen()
            progress.listening()

    # -- saving -----------------------------------------------------------------------------------

    def save(self, state: dict) -> Path:
        """Save `state` and every rank's random state as a new checkpoint; returns its path on every rank.

        In the background (the default) it returns once the state is copied: the checkpoint is committed
        later (`wait()` waits for it), and holds the state exactly as it was at this call. A save that comes
        while the previous one is still being written waits for it first."""
        previous, before = recorder.phase(recorder.SAVING), progress.saving()
        step_count.say_saving()  # every StepLog ends its window here: a resume from this save starts a new one
        started = time.monotonic()
        path = None
        try:
            path = in_background.save(self, state) if self.async_save else synchronous.save(self, state)
            self._trail.saved(atomic_files.sequence_of(path.name))
            return path
        finally:
            recorder.phase(previous)
            if path is not None:
                ended = time.monotonic()
                self._last_save = (path, ended - started)
                progress.saved(self.steps, path, started, ended, before)

    def wait(self) -> None:
        """Block until every checkpoint write in flight is committed; raise CheckpointWriteError (on every rank)
        if one failed. Call it on every rank, like save(). Without background saves it returns at once.

        >>> checkpointer.save(state); checkpointer.wait()          # doctest: +SKIP
        """
        if self._background is None:
            return
        started = time.monotonic()
        _, failed = self._background.settle()
        try:
            agree_on_writes(self.directory, failed["error"] if failed else None)
        finally:
            progress.save_blocked(time.monotonic() - started)

    def _settle_quietly(self) -> None:
        """Wait for this process's writes in flight to the directory (this Checkpointer's or another's)."""
        for failed in background.settle_directory(self.directory):
            logger.warning("a background checkpoint write in %s failed: %s; the previous checkpoint is the newest "
                           "complete one", self.directory, failed["error"])

    # -- restoring --------------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """The complete checkpoints listed in the manifest, oldest first (after this rank's write in flight)."""
        self._settle_quietly()
        return [self.directory / e.file for e in atomic_files.read_manifest(self.directory) or []]

    def restore(self, state: dict) -> bool:
        """Load the newest complete checkpoint into `state`; False (and `state` untouched) if there is none. A rank
        that joins a run in progress (world/joining.py) loads the state the ranks that train hand it instead."""
        if joining.pending():
            return handover.join_the_run(self, state)
        before, started = progress.restoring(), time.monotonic()
        self._settle_quietly()  # rank 0's write in flight is committed once its writer answers
        device = random_state.own_device()
        location = restoring.map_location(device)
        chosen, failure = None, None
        if world.group_rank() == 0:
            try:
                chosen = restoring.choose(self.directory, location)
            except Exception as exc:  # told to the other ranks below, then raised here
                failure = exc
        code, sequence = from_rank0(FAILED if failure else (LOAD if chosen else NOTHING),
                                    chosen[0] if chosen else None)
        if failure is not None:
            raise failure
        if code == FAILED:
            raise CheckpointError(explain(f"rank 0 could not restore a checkpoint from {self.directory}",
                                          rank=world.group_rank(), fix="See rank 0's error."))
        if code == NOTHING:
            progress.back_to(before)
            step_count.forget()  # a run of its own: no step of an earlier one holds
            return False
        path, payload = chosen if chosen else restoring.load_chosen(self.directory, sequence, location)
        restoring.apply(self.directory, payload, state, path)
        restoring.restore_random_states(payload["random_states"], device, state)
        self.saved_world_size = payload["world_size"]
        self.steps = int(payload.get("steps", 0))  # files from before step() existed: counted from 0
        self._trail.restored(atomic_files.sequence_of(path.name))
        step_count.say_restored(self.steps, self)  # every StepLog logs on from here, in the state or not
        progress.restored(self.steps, path, started, time.monotonic())
        if world.group_rank() == 0:
            plain = {k: v for k, v in state.items() if type(v) in (int, float, str, bool)}
            logger.info("resumed from %s (saved by %d rank(s), now %d)%s", path, payload["world_size"],
                              world.group_size(), f": {plain}" if plain else "")
        return True

    # -- the training loop ------------------------------------------------------------------------

    def step(self, state: dict, *, last: bool = False) -> Path | None:
        """Call once per optimizer step, on every rank, last in the step (after its logging or evaluation, so
        that a stop saves what the step left). Saves every `every` steps (and when `last`); when a stop was
        requested of any rank, every rank saves at the same step and the process ends: RunStopped, a
        SystemExit with code 75, is raised after the save. Returns the path of a save made here, else None.

        >>> for x, y in loader:                              # doctest: +SKIP
        ...     loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
        ...     checkpointer.step(state)
        """
        stop.listen()
        self.steps += 1
        progress.step(self.steps)
        stopping = self._agree()
        if generation.recovers_in_process():
            joining.say_taken()  # joiners are taken in here: its launcher may let a node join in-process
        if not stopping and self._agreement is not None and self._agreement.joiners_due:
            handover.take_in_joiners(state, self.steps, self._agreement)
        path = None
        if stopping or last or (self.every is not None and self.steps % self.every == 0):
            path = self._save_recovering(state)
        if stopping or last:  # the agreed stop commits its checkpoint before the process ends: nothing redone
            started = time.monotonic()
            self.wait()
            self._last_save = (path, self._last_save[1] + time.monotonic() - started)
        if stopping:
            self._leave(path)
        return path

    def _agree(self) -> bool:
        """The stop agreement's answer at this step; after a loss (live recovery) on the ranks left. A peer lost
        since the last exchange is noticed here: the ranks left
        regroup, and this step is no stop. Their new agreement starts at the next step on every one of them,
        whether a rank found the loss here or in the next step's exchange: its reads must fall on the same
        steps everywhere, or one rank would stop a step before another."""
        if self.steps <= self._agree_after:  # this rank met the loss a step before another (_onto_generation)
            return False
        try:
            return self._agreement_of_the_ranks().at_step()
        except RuntimeError as lost:
            if not generation.is_loss(lost):
                raise
            generation.recover(lost)
            return False

    def _onto_generation(self, survivors) -> None:
        """Live recovery, collective over the new generation: its ranks start their stop agreement at the same step,
        past the highest step count any of them had. A rank can meet a loss one step before another when hosts
        exchange apart (DiLoCo): in that step's own exchange, which it redoes, while the others met it at that
        step's agreement; the first rank then sits that step's agreement out, or the two would stop a step apart."""
        group = world.control_group()
        if group is None:  # a world of one
            self._agree_after = self.steps
            return
        steps = torch.tensor([self.steps], dtype=torch.int64)
        work = dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group, async_op=True)
        generation.wait_for(work, "the ranks' step counts after a regroup")
        self._agree_after = int(steps.item())

    def _agreement_of_the_ranks(self) -> StopAgreement:
        if self._agreement is None or self._agreement.generation != world.live_generation():  # ranks were lost
            progress.listening()
            self._agreement = StopAgreement(self.timeout)
        return self._agreement

    def _save_recovering(self, state: dict) -> Path:
        """save(state); with live recovery, a peer lost during the save regroups the ranks left, which save again."""
        return generation.again_after_loss(lambda: self.save(state), what="a checkpoint's save")

    def _leave(self, path: Path) -> None:
        """The agreed stop: everything is saved; leave the world together and end the process."""
        reason = stop.requested() or "requested"
        seconds = self._last_save[1]
        stop.stopping()
        progress.stopped(self.steps, path, seconds, reason, stop.requested_at())
        stopped = stop.RunStopped(self.steps, path, reason, seconds)
        if world.group_rank() == 0:
            logger.info("%s", stopped)
        if world.is_initialized():
            world.shutdown()  # every rank is here, just past the save's barrier: no peer is left mid-collective
        else:
            world.run_before_shutdown()  # a StepLog's last records, while the user's group is still there
        raise stopped
