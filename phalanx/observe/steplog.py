"""`StepLog`: one record every N steps with the run's loss, throughput and each rank's busy time.

Every rank calls `log.step(loss=..., samples=...)` once per optimizer step. It sums locally (no
collective, no device sync): its step time, the part of it spent waiting for peers in phalanx's
exchanges and for phalanx's loader (diagnose/step_clock.py), its loss times its samples. Every N
steps the window becomes a row; rows travel to every rank in one small all-gather (gather.py),
batched so that one happens about every half second, and rank 0 turns them into records
(window.py): a line on the terminal, a line of steps.jsonl, TensorBoard scalars (outputs.py).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from ..diagnose import progress, step_clock
from ..errors import StepLogError, explain
from ..log import logger
from ..world import generation, step_count
from ..world import group as world
from . import outputs
from .gather import RowGather
from .generations import FollowsGenerations
from .window import FIELDS, INDEX, line, make_record

GATHER_SECONDS = 0.5  # records are gathered about this often; a record slower than this is gathered at once
MAX_BATCH = 1000  # windows per gather, at most
PEAK_READ_NS = 200_000_000  # the peak resident set is read at most this often (it only grows)


class StepLog(FollowsGenerations):
    """Log the run every `every` steps to the terminal (rank 0), `log_dir/steps.jsonl` and TensorBoard.

    Make it on every rank, and call `step(loss=..., samples=...)` on every rank once per optimizer step:
    `loss` is this rank's loss for the step (a tensor or a number, the mean over its samples) and
    `samples` its sample count; `tokens` its token count, for tokens/s. The record's loss is the mean
    over every sample of every rank. It follows the run's step through a `Checkpointer`, whether or not it is
    in the checkpoint's state: a restore sets its step count (records of the steps to be redone are trimmed),
    and each save ends its window, so that a run resumed from any checkpoint logs every step in exactly one
    record. A log whose step count nothing told (no checkpoint restored, not in a restored state) never
    rewrites a steps.jsonl that holds records: it starts steps.2.jsonl beside it, and says so.

    Options: `optimizer` (its first group's lr is logged), `flops_per_sample` or `flops_per_token`
    with `peak_flops` (one device's peak, FLOP/s: `mfu` is logged only with both), `total_steps` (the
    loop's length, for `phalanx run`'s ETA), `tensorboard` (None: when tensorboardX is installed;
    True: required; False: off), `print_every` (records between two printed lines, 0: none), `print_fn`
    (what prints a line, default print: e.g. a progress bar's write),
    `timeout` (seconds a rank waits for the others; default PHALANX_TIMEOUT or 600).

    >>> import phalanx as px                                        # doctest: +SKIP
    >>> log = px.StepLog("runs/my-job", every=10, optimizer=optimizer)
    >>> for x, y in loader:
    ...     loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
    ...     log.step(loss=loss, samples=len(x))
    step 10 | loss 0.5321 | 1,204 samples/s | 41.2 ms/step | busy 38.0/38.9/40.1 ms, slowest rank 1 | ...
    """

    def __init__(self, log_dir, every: int = 10, *, optimizer=None, flops_per_sample: float | None = None,
                 flops_per_token: float | None = None, peak_flops: float | None = None,
                 total_steps: int | None = None, tensorboard: bool | None = None, print_every: int = 1,
                 print_fn=print, timeout: float | None = None):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise StepLogError(explain("StepLog every must be a positive number of steps", seen=f"every={every!r}",
                                       expected="an int >= 1", fix="Pass every=10, say: a record every 10 steps."))
        self.directory = Path(log_dir)
        self.every, self.optimizer, self.total_steps = every, optimizer, total_steps
        self.flops_per_sample, self.flops_per_token, self.peak_flops = flops_per_sample, flops_per_token, peak_flops
        self.print_every, self.print_fn = print_every, print_fn
        self.timeout = float(timeout if timeout is not None else os.environ.get("PHALANX_TIMEOUT", 600))
        self.steps = 0  # steps counted, from the restored value on
        self._known = False  # whether the step count is the run's: a restore, the log's own state or the others said
        self._state_loaded = False  # load_state_dict() ran in the restore under way: its step count wins
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise StepLogError(explain("StepLog was made before this process joined its world",
                                       seen=f"WORLD_SIZE={os.environ['WORLD_SIZE']}, no process group",
                                       expected="px.init() (or init_process_group) first",
                                       fix="Make the StepLog after px.init(): every rank would write as rank 0."))
        # The ranks that train (after a loss, the ranks left; a rank that joins is a world of its own until taken in).
        self.rank, self.world_size = world.group_rank(), world.group_size()
        self._members = world.live_members() if dist.is_initialized() else (0,)
        self.main = world.is_main() if world.is_initialized() else self.rank == 0
        self._cuda = _training_on_cuda()
        self._peak, self._peak_read_ns = 0.0, -PEAK_READ_NS  # the resident set's peak, read at most every 0.2 s
        self._start_step = 0  # the step count this process started logging from (after a restore)
        self._rows: list[list[float]] = []  # finished windows not gathered yet
        # This rank's rows of the gather in flight, and of the last one that completed here: were the world to change
        # before the main rank wrote them, the ranks left gather them again (_onto_generation).
        self._in_flight: list[list[float]] = []
        self._held: list[list[float]] = []
        self._written_through = 0  # the main rank: the step of the last record in its file
        self._gather_every = 1  # windows per gather: agreed from the gathered rows, the same on every rank
        self._records_written = 0
        self._jsonl = self._tensorboard = None
        self._closed = False
        self._tensorboard_wanted = tensorboard
        if self.main:
            self._open_outputs()
        elif tensorboard is True:
            outputs.tensorboard_module(required=True)  # the same error on every rank
        self._gather = None
        if self.world_size > 1 and world.live_generation() == 0:
            # Under live recovery on the control group made at init: a group made here would hang the others in
            # Gloo's connection set-up, which nothing can watch, if a host were lost meanwhile.
            live = generation.live_recovery() and world.control_group() is not None
            self._gather = self._control_gather() if live else RowGather(len(FIELDS), self.timeout)
        self._key = self._gather.key if self._gather is not None else f"steplog-{id(self):x}"
        self._new_window()
        self._mark()
        if step_count.restored() is not None:  # made after a restore: log on from its step
            self._resume_at(step_count.restored())
        step_count.follow(self)
        world.before_shutdown(self._at_shutdown)  # the agreed stop and the end of a run write what is left
        if generation.live_recovery():
            generation.on_regroup(self._onto_generation)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self, loss, samples: int, tokens: int | None = None) -> None:
        """Count one optimizer step of this rank: its loss (mean over its `samples`) and sample count."""
        now = step_clock.now_ns()
        waited, data = step_clock.totals()
        wall = now - self._last_ns
        exchange = waited - self._last_wait
        window = self._window
        window[_STEPS] += 1
        window[_WALL] += wall * 1e-9
        window[_WAIT] += exchange * 1e-9
        window[_BUSY] += (wall - exchange) * 1e-9
        window[_DATA] += (data - self._last_data) * 1e-9
        skipped = step_clock.skipped_steps()
        window[_SKIPPED] += skipped - self._last_skipped
        outer, across = step_clock.outer_totals()
        window[_OUTER] += outer - self._last_outer[0]
        window[_ACROSS] += across - self._last_outer[1]
        self._add_loss(loss, samples)
        if tokens is not None:
            window[_TOKENS] += tokens
            window[_TOKENS_GIVEN] += 1
        self.steps += 1
        progress.logged(self.steps, self.total_steps)
        if self.steps % self.every == 0:
            self._end_window()
            if not self._logged_by_the_others() and len(self._rows) >= self._gather_every:
                self._exchange(wait=self._gather_every == 1)
        self._mark()

    def _add_loss(self, loss, samples) -> None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            if isinstance(samples, torch.Tensor) and samples.numel() == 1:
                samples = int(samples)
            else:
                raise StepLogError(explain("log.step() samples must be this rank's sample count for the step",
                                           rank=self.rank, seen=f"samples={samples!r}", expected="an int >= 0",
                                           fix="Pass samples=len(x) (the batch this rank trained on)."))
        self._window[_SAMPLES] += samples
        if isinstance(loss, torch.Tensor) and loss.device.type != "cpu":
            # No .item(): on a GPU that would wait for the step; the sum stays on the device until the record.
            term = loss.detach().reshape(()).to(torch.float64) * samples
            self._loss = term if self._loss is None else self._loss + term
        else:
            try:
                self._window[_LOSS] += float(loss.detach() if isinstance(loss, torch.Tensor) else loss) * samples
            except (TypeError, ValueError):
                raise StepLogError(explain("log.step() loss must be a number or a one-element tensor",
                                           rank=self.rank, seen=f"loss={loss!r}", expected="the step's loss",
                                           fix="Pass loss=loss (the tensor backward() was called on).")) from None

    def _mark(self) -> None:
        """Now is the start of the next step: the clocks are read from here."""
        self._last_ns = step_clock.now_ns()
        self._last_wait, self._last_data = step_clock.totals()
        self._last_skipped = step_clock.skipped_steps()
        self._last_outer = step_clock.outer_totals()

    def _new_window(self) -> None:
        self._window = [0.0] * len(FIELDS)
        self._loss = None

    def _end_window(self) -> None:
        window = self._window
        if self._loss is not None:
            window[_LOSS] += float(self._loss)  # the one device sync of a window
        window[_END] = self.steps
        window[_PEAK] = self._peak_memory()
        self._rows.append(window)
        self._new_window()

    def _peak_memory(self) -> float:
        if self._cuda:
            return float(torch.cuda.max_memory_allocated())
        now = step_clock.now_ns()
        if now - self._peak_read_ns > PEAK_READ_NS:  # getrusage costs ~100 us in a process with many threads
            self._peak_read_ns = now
            self._peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: kilobytes
        return self._peak

    # -- records ----------------------------------------------------------------------------------

    def _exchange(self, wait: bool) -> None:
        """Emit the gather in flight; launch one of the windows since (waiting for it too when `wait`)."""
        if self._gather is None:  # a world of one: the rows are the records
            rows, self._rows = self._rows, []
            self._emit([[row] for row in rows])
            return
        if self._gather.pending and not self._emit_gathered():
            return  # a rank was lost: the ranks left gathered the windows again (_onto_generation)
        if self._rows:
            self._gather.launch(torch.tensor(self._rows, dtype=torch.float64))
            self._in_flight, self._rows = self._rows, []
            if wait:
                self._emit_gathered()

    def _emit_gathered(self) -> bool:
        """Write the records of the gather in flight; False when a rank was lost in it (live recovery: the ranks
        left regroup, and gather what it held again)."""
        try:
            per_rank = self._gather.result(f"the records up to step {self.steps}")
        except RuntimeError as lost:  # PeerFailedError is one
            if not generation.is_loss(lost):
                raise
            generation.recover(lost)
            return False
        self._held, self._in_flight = self._in_flight, []
        by_rank = [rows.tolist() for rows in per_rank]
        windows = [[by_rank[r][k] for r in range(self.world_size)] for k in range(len(by_rank[0]))]
        # The next cadence from what every rank saw, so every rank adopts the same: a gather about every
        # GATHER_SECONDS; records slower than that are gathered (and shown) at once.
        slowest = max(row[INDEX["wall_s"]] for row in windows[-1])
        self._gather_every = max(1, min(MAX_BATCH, int(GATHER_SECONDS / slowest) if slowest > 0 else MAX_BATCH))
        self._emit(windows)
        return True

    def _emit(self, windows: list[list[list[float]]], ranks: list[tuple[int, ...]] | None = None) -> None:
        """Write one record per window (each rank's row of it); `ranks`: the launch ranks whose rows each window
        holds (default: the members, in order). Records name ranks by their launch ranks, which never change."""
        if not self.main or not windows:
            return
        lr = _lr(self.optimizer)
        records = []
        for rows, members in zip(windows, ranks or [self._members] * len(windows)):
            record = make_record(rows, lr=lr, memory_kind="cuda" if self._cuda else "rss",
                                 flops_per_sample=self.flops_per_sample, flops_per_token=self.flops_per_token,
                                 peak_flops=self.peak_flops)
            for key in ("slowest_rank", "peak_memory_rank"):
                record[key] = members[record[key]]
            records.append(record)
        if self._jsonl is None:
            self._choose_file()
        self._jsonl.write(records)
        self._written_through = records[-1]["step"]
        if self._tensorboard is not None:
            self._tensorboard.write(records, self._start_step + 1 if self._known else None)
        for record in records:
            self._records_written += 1
            if self.print_every and (self._records_written - 1) % self.print_every == 0:
                self.print_fn(line(record))

    def flush(self) -> None:
        """Collective: record the steps since the last record (a shorter window) and write everything pending.
        Called by close(), and by px.shutdown() (at the end of a run, and at an agreed stop)."""
        if self.steps % self.every and self._window[_STEPS]:
            self._end_window()
        self._exchange(wait=True)

    def close(self) -> None:
        """Collective (every rank): flush, then close the TensorBoard file. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def _at_shutdown(self) -> None:
        self.close()

    def _choose_file(self) -> None:
        """The main rank's first write: the records file to append to. A step count that is the run's continues the
        newest file, trimmed of the steps to be redone; one that nothing told never overwrites records: a new file
        beside them."""
        files = outputs.jsonl_files(self.directory)
        path = files[-1] if files else self.directory / outputs.JSONL_NAME
        if self._known:
            outputs.trim(path, self._start_step)
        elif outputs.last_step(path) is not None:
            path = outputs.file_beside(self.directory)
            logger.warning("StepLog: %s holds the records of an earlier run, and this log was not told its step (no "
                           "checkpoint restored, the log not in a restored state): they are kept, and this run's go "
                           "to %s", files[-1], path)
        self._jsonl = outputs.JsonlFile(path)

    def _open_outputs(self) -> None:
        """This rank writes the records: steps.jsonl (chosen at the first write: _choose_file), and TensorBoard's file
        unless tensorboard=False (True: the package required; None: used when installed, said once when not)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        protos = None
        if self._tensorboard_wanted is not False:
            protos = outputs.tensorboard_module(required=self._tensorboard_wanted is True)
            if protos is None:
                outputs.warn_no_tensorboard()
        self._tensorboard = outputs.TensorBoardFile(self.directory, protos) if protos else None

    def _control_gather(self, key: str | None = None) -> RowGather:
        """A RowGather on the control group of the ranks that train (made with their generation, under live
        recovery: no group is made in a step)."""
        return RowGather(len(FIELDS), self.timeout, group=world.control_group(), members=world.live_members(),
                         key=key)

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The step count, for a checkpoint: a restored run logs on from it."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state["steps"]`: steps.jsonl keeps the records up to it and TensorBoard purges the rest."""
        steps = state.get("steps")
        if not isinstance(steps, int) or steps < 0:
            raise StepLogError(explain("a StepLog state must hold its step count", rank=self.rank,
                                       seen=f"{state!r}", expected="{'steps': <int >= 0>}",
                                       fix="Restore a state saved from StepLog.state_dict()."))
        self._state_loaded = True
        self._resume_at(steps)

    def follow_restore(self, step: int) -> None:
        """A Checkpointer restored the run at `step` (world/step_count.py): log on from it, unless this log's own
        state was restored with it (its count wins: it counts log.step() calls)."""
        if self._state_loaded:
            self._state_loaded = False
            return
        self._resume_at(step)

    def follow_save(self) -> None:
        """A checkpoint is taken at this step, on every rank: the window ends here (no collective: its row is gathered
        with the next), so that a run resumed from it starts a window where a record ended."""
        if self._window[_STEPS]:
            self._end_window()

    def _resume_at(self, steps: int) -> None:
        self.steps = self._start_step = steps
        self._known = True
        self._rows, self._in_flight, self._held = [], [], []
        self._new_window()
        self._mark()
        if self.main:
            self._written_through = steps
            if self._jsonl is not None:
                self._jsonl.close()  # trimming replaces the file: the next write opens the new one
                self._jsonl = None
            files = outputs.jsonl_files(self.directory)
            dropped = outputs.trim(files[-1], steps) if files else 0
            if dropped:
                print(f"StepLog: resumed at step {steps}; {dropped} record(s) of later steps removed from "
                      f"{files[-1]}", flush=True)
        progress.logged(self.steps, self.total_steps)


(_STEPS, _END, _LOSS, _SAMPLES, _TOKENS, _TOKENS_GIVEN, _BUSY, _WALL, _WAIT, _DATA, _PEAK, _SKIPPED, _OUTER,
 _ACROSS) = (INDEX[name] for name in FIELDS)


def _lr(optimizer) -> float | None:
    if optimizer is None:
        return None
    try:
        value = optimizer.param_groups[0]["lr"]
        return float(value)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


def _training_on_cuda() -> bool:
    """Memory is CUDA's max allocated when this process trains on a GPU, else its peak resident set."""
    try:
        if world.is_initialized():
            return world.device().type == "cuda"
        return dist.is_initialized() and dist.get_backend() == "nccl"  # a group the user made (torchrun)
    except Exception:
        return False

