"""`Checkpointer`: save a training run's state, resume it exactly, and save once more when asked to stop.

Every rank calls `save(state)`: every rank's random states are gathered (and a sharded optimizer's
state, to torch's unsharded format). In the background (the default) each rank snapshots its share
into a reused staging buffer and returns; its writer process writes it, and rank 0's commits the
checkpoint once every rank's part is written (background/; the replicated model and
optimizer are spread over the ranks, spreading.py). With async_save=False rank 0 writes one file
(atomically, see atomic_files.py) with the unwrapped model, the other stateful objects and the plain
values, and all ranks pass a barrier.
`restore(state)` loads the newest complete file on every rank (restoring.py). `step(state)`, once per
optimizer step, saves every N steps and, when a stop is requested of any rank, saves at a step all
ranks agree on (agreement.py) and ends the process: a preempted job loses no step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..diagnose import progress, recorder
from ..errors import CheckpointError, CheckpointWriteError, explain
from ..log import logger
from ..world import generation, joining, step_count, stop
from ..world import group as world
from . import atomic_files, background, handover, random_state, restoring, shard_files, spreading
from .agreement import StopAgreement
from .audit_trail import AuditTrail
from .background import BackgroundSaves, commit, report, staging
from .entries import check_plain, kind_of, unwrap

FORMAT = restoring.FORMAT
_NOTHING, _LOAD, _FAILED = 0, 1, 2  # what rank 0 tells the others after choosing or writing


def _own_device() -> torch.device:
    return world.device() if world.is_initialized() else torch.device("cpu")


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
        self._agreed_sequence = -1
        self._agreement: StopAgreement | None = None
        self._last_save = (None, 0.0)  # (path, seconds) of the newest save
        self.async_save = bool(async_save)
        self._background = BackgroundSaves(self.directory) if self.async_save else None
        self._trail = AuditTrail(self)  # the saves the replica audit vouches for, or sets aside
        progress.checkpointer(str(self.directory))
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
            path = self._save_background(state) if self.async_save else self._save(state)
            self._trail.saved(atomic_files.sequence_of(path.name))
            return path
        finally:
            recorder.phase(previous)
            if path is not None:
                ended = time.monotonic()
                self._last_save = (path, ended - started)
                progress.saved(self.steps, path, started, ended, before)

    def _save(self, state: dict) -> Path:
        kinds = {name: kind_of(name, value) for name, value in state.items()}  # same check, same error, on all ranks
        device = _own_device()
        states = random_state.gather(random_state.capture(device, state), world.collective_device())
        # FSDP2's shards (shard="parameters") are written by their ranks, each into a part file of its own;
        # a sharded optimizer's pieces (shard="optimizer"/"gradients") are gathered to rank 0, bucket by bucket.
        split = {name: shard_files.split(dtensors) for name, value in state.items()
                 if (dtensors := shard_files.dtensor_state(value, unwrap)) is not None}
        gathered = {name: value.state_dict(to=0) for name, value in state.items()
                    if shard_files.is_optimizer_view(value) and name not in split}
        path, failure, sequence, parts = None, None, -1, None
        if world.group_rank() == 0:
            try:
                sequence = self._next_sequence()
            except Exception as exc:  # told to the other ranks below, then raised here
                failure = exc
        if split:  # every rank writes its part first, under the sequence rank 0 chose
            code, sequence = self._from_rank0(_FAILED if failure else _LOAD, None, sequence)
            if code != _FAILED:
                local = {name: shards for name, (_, shards) in split.items()}
                parts = shard_files.write_parts(self.directory, sequence, local)
                gathered.update({name: skeleton for name, (skeleton, _) in split.items()})
        if world.group_rank() == 0 and failure is None:
            try:
                path = self._write(state, kinds, states, gathered, sequence, parts, set(split))
            except Exception as exc:  # told to the other ranks below, then raised here
                failure = exc
        self._barrier()
        code, sequence = self._from_rank0(_FAILED if failure else _LOAD, path)
        if failure is not None:
            if isinstance(failure, CheckpointError):
                raise failure
            raise CheckpointWriteError(explain(
                f"could not write a checkpoint in {self.directory}", rank=0,
                seen=f"{type(failure).__name__}: {failure}", expected="a writable directory with free space",
                fix="Free space or fix permissions; the previous checkpoint is intact.")) from failure
        if code == _FAILED:
            raise CheckpointWriteError(explain(
                f"rank 0 could not write a checkpoint in {self.directory}", rank=world.group_rank(),
                seen="a failure on rank 0", fix="See rank 0's error; the previous checkpoint is intact."))
        return self.directory / atomic_files.CHECKPOINT_NAME.format(sequence)

    def _save_background(self, state: dict) -> Path:
        kinds = {name: kind_of(name, value) for name, value in state.items()}
        _, failed = self._background.settle()  # at most one write in flight: a save while one writes waits for it
        rank, size = world.group_rank(), world.group_size()
        split = {name: shard_files.split(dtensors) for name, value in state.items()
                 if (dtensors := shard_files.dtensor_state(value, unwrap)) is not None}
        gathered = {name: value.state_dict(to=0) for name, value in state.items()
                    if shard_files.is_optimizer_view(value) and name not in split}
        states = random_state.gather(random_state.capture(_own_device(), state), world.collective_device())
        sequence, cause = -1, failed["error"] if failed else None
        if rank == 0 and failed is None:
            try:
                sequence = self._next_sequence()
            except Exception as exc:  # told to the other ranks below, then raised here
                cause = f"{type(exc).__name__}: {exc}"
        self._raise_if_failed(cause, sequence)
        sequence = self._agreed_sequence
        replicated = spreading.replicated(state, kinds, unwrap, size)
        part, entries, loads = {name: shards for name, (_, shards) in split.items()}, {}, [0] * size
        for name, value in state.items():
            if name in split:
                saved = split[name][0]
            elif name in replicated:  # every rank writes a share of it
                whole = unwrap(value).state_dict() if kinds[name] == "model" else value.state_dict()
                saved, part[name] = spreading.spread(whole, replicated[name], loads, size, rank)
            elif rank != 0:
                continue
            elif kinds[name] == "value":
                saved = value
            elif name in gathered:
                saved = gathered[name]
            else:
                saved = unwrap(value).state_dict() if kinds[name] == "model" else value.state_dict()
            if rank == 0:
                if kinds[name] != "value":
                    check_plain(saved, f"state[{name!r}].state_dict()")
                entries[name] = {"kind": kinds[name], "state": saved, "sharded": name in split or name in replicated}
                if kinds[name] == "value" and staging.has_cuda_tensor(saved):
                    entries[name]["on_gpu"] = True  # staged through host memory: restored onto the GPU again
        main = None
        if rank == 0:
            main = {"format": FORMAT, "sequence": sequence, "world_size": size, "entries": entries,
                    "random_states": states, "parts": [], "steps": self.steps}
        job = {"directory": str(self.directory), "sequence": sequence, "rank": rank, "world_size": size,
               "keep": self.keep, "timeout": self._limit(), "parts": bool(part), "protect": self._trail.trusted}
        self._background.submit(job, part or None, main)
        return self.directory / atomic_files.CHECKPOINT_NAME.format(sequence)

    def _raise_if_failed(self, cause: str | None, sequence: int = -1) -> None:
        """Collective: every rank learns which ranks' writes failed (and rank 0's sequence for the next save);
        every rank raises the same CheckpointWriteError if any did. Sets `_agreed_sequence`."""
        rank, size = world.group_rank(), world.group_size()
        flags = [(1 if cause else 0, sequence)]
        if size > 1:
            mine = torch.tensor(flags[0], dtype=torch.int64, device=world.collective_device())
            everyone = [torch.empty_like(mine) for _ in range(size)]
            entry = recorder.begin(recorder.CHECKPOINT, -1, mine.numel(), mine.dtype)
            generation.wait_for(dist.all_gather(everyone, mine, group=world.live_group(), async_op=True),
                                "a checkpoint's outcome")
            recorder.done(entry)
            flags = [(int(row[0]), int(row[1])) for row in everyone]
        self._agreed_sequence = flags[0][1]
        failed = [r for r, (flag, _) in enumerate(flags) if flag]
        if not failed:
            return
        if cause:
            raise report({"error": cause}, rank, self.directory)
        who = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
        raise CheckpointWriteError(explain(
            f"{who} could not write a checkpoint in {self.directory}", rank=rank,
            seen="a failed background write", expected="every rank's part written",
            fix="See those ranks' errors; the previous checkpoint is intact and the newest complete one."))

    def _limit(self) -> float:
        return float(self.timeout) if self.timeout is not None else float(os.environ.get("PHALANX_TIMEOUT", 600))

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
            self._raise_if_failed(failed["error"] if failed else None)
        finally:
            progress.save_blocked(time.monotonic() - started)

    def _next_sequence(self) -> int:
        """Rank 0: the sequence number of the next checkpoint (past any part a failed save left: its note could
        be taken for the new part's)."""
        listed = atomic_files.read_manifest(self.directory) or []
        present = atomic_files.checkpoint_files(self.directory)
        parts = shard_files.part_sequences(self.directory)
        return 1 + max([e.sequence for e in listed] + list(present) + parts, default=0)

    def _write(self, state: dict, kinds: dict, states: list, gathered: dict, sequence: int, parts: list | None,
               split: set) -> Path:
        started = time.monotonic()
        entries = {}
        for name, value in state.items():
            if kinds[name] == "value":
                saved = value
            elif name in gathered:
                saved = gathered[name]
            else:
                saved = unwrap(value).state_dict() if kinds[name] == "model" else value.state_dict()
                check_plain(saved, f"state[{name!r}].state_dict()")
            entries[name] = {"kind": kinds[name], "state": saved, "sharded": name in split}
        payload = {"format": FORMAT, "sequence": sequence, "world_size": world.group_size(),
                   "entries": entries, "random_states": states, "parts": parts or [], "steps": self.steps}
        path, size = commit(self.directory, payload, self.keep, self._trail.trusted)
        logger.info("saved checkpoint %s (%.1f MB in %.2fs)", path, size / 1e6, time.monotonic() - started)
        return path

    def _agree(self) -> bool:
        """The stop agreement's answer at this step; after a loss (live recovery) on the ranks left. A peer lost
        since the last exchange is noticed here: the ranks left
        regroup, and this step is no stop. Their new agreement starts at the next step on every one of them,
        whether a rank found the loss here or in the next step's exchange: its reads must fall on the same
        steps everywhere, or one rank would stop a step before another."""
        try:
            return self._agreement_of_the_ranks().at_step()
        except RuntimeError as lost:
            if not generation.is_loss(lost):
                raise
            generation.recover(lost)
            return False

    def _take_in_joiners(self, state: dict) -> None:
        """Ranks wait to join (world/joining.py) and every rank agreed on this step: take them in, hand them the
        state over the network, and go on in the larger generation."""
        started, before = time.monotonic(), world.live_members()
        joiners = generation.admit_joiners()
        if not joiners:
            self._agreement.resume()
            return
        members = world.live_members()
        try:
            healed = handover.send(state, self.steps, members, joiners)
            generation.regroup_followers(world.live_generation(), members, [], started, joined=joiners,
                                         healed=healed)
        except RuntimeError as lost:  # a joiner lost while it was taken in (PeerDiedError is one)
            if not generation.is_loss(lost):
                raise
            generation.recover(lost)  # the ranks left go on without it from the next step (it says so)
            return
        if world.is_main():
            logger.warning("rank(s) %s joined: %d ranks go on in generation %d (world size %d -> %d), taken in at step "
                           "%d in %.2f s, %.1f MB of state handed over in %.2f s", list(joiners), len(members),
                           world.live_generation(), len(before), len(members), self.steps,
                           time.monotonic() - started, healed[0] / 1e6, healed[1])

    def _join_the_run(self, state: dict) -> bool:
        """A joiner's restore(): wait until the ranks that train take it in, then load the state they hand over
        (no disk read), and regroup its model and loader onto the run's generation."""
        started = time.monotonic()
        joined, joiners = generation.join_run()
        members = joined.members
        self.steps, size, seconds = handover.receive(state, members, joiners)
        progress.step(self.steps)
        generation.regroup_followers(joined.number, members, [], started, joined=joiners, healed=(size, seconds))
        step_count.say_restored(self.steps, self)
        for value in state.values():  # a global-batch loader whose pass has not begun: dealt over the run's ranks
            if getattr(value, "plan", None) is not None and not getattr(value, "_follows_generations", True):
                value.regroup(joined.rank, joined.world_size)
        logger.info("rank %d joined the run at step %d (generation %d, %d ranks): %.1f MB of state received in "
                    "%.2f s, %.2f s after it was ready", dist.get_rank(), self.steps, joined.number, len(members),
                    size / 1e6, seconds, time.monotonic() - started)
        return True

    def _agreement_of_the_ranks(self) -> StopAgreement:
        if self._agreement is None or self._agreement.generation != world.live_generation():  # ranks were lost
            progress.listening()
            self._agreement = StopAgreement(self.timeout)
        return self._agreement

    def _save_recovering(self, state: dict) -> Path:
        """save(state); with live recovery, a peer lost during the save regroups the ranks left, which save again."""
        return generation.again_after_loss(lambda: self.save(state))

    def _barrier(self) -> None:
        if world.group_size() == 1:
            return
        if world.is_initialized():
            world.barrier(self.timeout, name="checkpoint")
        else:
            dist.barrier()

    def _from_rank0(self, code: int, path: Path | None, sequence: int = -1) -> tuple[int, int]:
        """Broadcast (code, checkpoint sequence) from rank 0, so every rank acts on the same decision."""
        sequence = atomic_files.sequence_of(path.name) if path is not None else sequence
        if world.group_size() == 1:
            return code, sequence
        message = torch.tensor([code, sequence], dtype=torch.int64, device=world.collective_device())
        entry = recorder.begin(recorder.CHECKPOINT, -1, message.numel(), message.dtype)
        generation.wait_for(dist.broadcast(message, group=world.live_group(), group_src=0, async_op=True),
                            "a checkpoint's decision")  # from the first rank training
        recorder.done(entry)
        return int(message[0]), int(message[1])

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
            return self._join_the_run(state)
        before, started = progress.restoring(), time.monotonic()
        self._settle_quietly()  # rank 0's write in flight is committed once its writer answers
        device = _own_device()
        location = restoring.map_location(device)
        chosen, failure = None, None
        if world.group_rank() == 0:
            try:
                chosen = restoring.choose(self.directory, location)
            except Exception as exc:  # told to the other ranks below, then raised here
                failure = exc
        code, sequence = self._from_rank0(_FAILED if failure else (_LOAD if chosen else _NOTHING),
                                          chosen[0] if chosen else None)
        if failure is not None:
            raise failure
        if code == _FAILED:
            raise CheckpointError(explain(f"rank 0 could not restore a checkpoint from {self.directory}",
                                          rank=world.group_rank(), fix="See rank 0's error."))
        if code == _NOTHING:
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
            self._take_in_joiners(state)
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
