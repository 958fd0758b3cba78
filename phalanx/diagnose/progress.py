"""Each rank's progress as `phalanx run` sees it: where training is, and where the time went.

The launcher reads it after each attempt for the stop report and the run summary (goodput). The
counters are float64 slots in a memory-mapped file written with plain stores (no syscall per step),
so a record outlives a SIGKILL; rare events (a restore, a save, the stop) are JSON lines beside it.
The launcher writes one slot itself, TEARDOWN, before it stops a group after a failure: a worker
that listens for stop requests must not take that SIGTERM for one. Times are time.monotonic(),
comparable between the processes of a host.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass, field

from .record import rank_files

MAGIC = float(0x50484C58)  # "PHLX"
VERSION = 1
(P_MAGIC, P_VERSION, P_PID, P_RANK, P_STATE, P_CREATED, P_READY, P_LOOP_START, P_LAST_STEP_AT, P_STEP, P_FIRST_STEP,
 P_LOOP_SECONDS, P_SAVED_STEP, P_LOOP_AT_SAVE, P_SAVE_SECONDS, P_SAVES, P_RESTORE_SECONDS, P_RESTORES, P_STOP_STEP,
 P_EXITED_AT, P_TEARDOWN, P_LISTENING, P_LOGGED_STEP, P_TOTAL_STEPS, P_SAVE_WAITED, P_SAVE_BACKGROUND) = range(26)
SLOTS = 32
STATES = ("startup", "ready", "restoring", "training", "saving", "stopped", "exited")
STATE = {name: code for code, name in enumerate(STATES)}


def record_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.progress")


def events_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.events")


class _Record:
    """The writer's side: this process's slots and its event file."""

    def __init__(self, directory: str, rank: int):
        path = record_path(directory, rank)
        fd = os.open(path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 8 * SLOTS)
            self._map = mmap.mmap(fd, 8 * SLOTS)
        finally:
            os.close(fd)
        self.slots = memoryview(self._map).cast("B").cast("d")
        self.events = events_path(directory, rank)
        self.excluded = 0.0  # time saved or restored since the last step: not step time
        for slot, value in ((P_VERSION, VERSION), (P_PID, os.getpid()), (P_RANK, rank), (P_CREATED, time.monotonic()),
                            (P_SAVED_STEP, -1), (P_STOP_STEP, -1)):
            self.slots[slot] = value
        self.slots[P_MAGIC] = MAGIC  # last: a reader that sees it sees the rest
        os.replace(path + ".tmp", path)

    def event(self, **fields) -> None:
        try:
            with open(self.events, "a") as handle:
                handle.write(json.dumps(fields) + "\n")
        except OSError:
            pass  # the summary is an aid: a full disk must not stop training


_record: _Record | None = None


def start(directory: str, rank: int) -> None:
    """Open this rank's record (idempotent); before it, and outside `phalanx run`, every call is a no-op."""
    global _record
    if _record is None:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            _record = _Record(directory, rank)
        except OSError:
            _record = None


def stop() -> None:
    global _record
    if _record is not None:
        exited()
    _record = None


def active() -> bool:
    return _record is not None


def ready() -> None:
    """init() is done: the rank is in the world."""
    if _record is not None:
        _record.slots[P_READY] = time.monotonic()
        _record.slots[P_STATE] = STATE["ready"]


def listening() -> None:
    if _record is not None:
        _record.slots[P_LISTENING] = 1


def checkpointer(directory: str) -> None:
    """A Checkpointer was made: its directory is where the run summary of the whole job is kept."""
    if _record is not None:
        slots = _record.slots
        if not slots[P_LOOP_START]:
            slots[P_LOOP_START] = slots[P_LAST_STEP_AT] = time.monotonic()
        _record.event(event="checkpointer", directory=os.path.abspath(directory))


def plan(text: str, **fields) -> None:
    """How the loader splits its global batch at this world size (`text`, and the numbers in `fields`), for
    `phalanx run` to show; `Progress.last("plan")` reads it back."""
    if _record is not None:
        _record.event(event="plan", text=text, **fields)


def restoring() -> int:
    """A restore begins; returns the state to go back to when there is nothing to restore."""
    return _enter("restoring")


def _enter(state: str) -> int:
    """This rank is now in `state`; returns the state it was in (-1 without a record)."""
    if _record is None:
        return -1
    previous = int(_record.slots[P_STATE])
    _record.slots[P_STATE] = STATE[state]
    return previous


def back_to(state: int) -> None:
    if _record is not None and state >= 0:
        _record.slots[P_STATE] = state


def restored(step: int, path, started: float, ended: float) -> None:
    """A checkpoint was loaded: training continues from `step`; the steps before it were done before."""
    record = _record
    if record is None:
        return
    slots = record.slots
    slots[P_RESTORE_SECONDS] += ended - started
    slots[P_RESTORES] += 1
    slots[P_STEP] = slots[P_FIRST_STEP] = slots[P_SAVED_STEP] = step
    slots[P_LOOP_SECONDS] = slots[P_LOOP_AT_SAVE] = 0.0
    slots[P_LOOP_START] = slots[P_LAST_STEP_AT] = ended
    record.excluded = 0.0
    slots[P_STATE] = STATE["training"]
    record.event(event="restored", step=step, path=str(path), seconds=round(ended - started, 4))


def step(count: int) -> None:
    """The training loop reached step `count` (checkpointer.step()): the time since the last one was a step."""
    record = _record
    if record is None:
        return
    slots, now = record.slots, time.monotonic()
    slots[P_LOOP_SECONDS] += now - slots[P_LAST_STEP_AT] - record.excluded
    slots[P_LAST_STEP_AT] = now
    slots[P_STEP] = count
    slots[P_STATE] = STATE["training"]
    record.excluded = 0.0


def logged(count: int, total: int | None) -> None:
    """A StepLog counted step `count` of `total` (None: the loop's length is unknown): `phalanx run`'s live status."""
    record = _record
    if record is not None:
        record.slots[P_LOGGED_STEP] = count
        record.slots[P_TOTAL_STEPS] = total or 0


def saving() -> int:
    """A save begins; returns the state to go back to."""
    return _enter("saving")


def saved(count: int, path, started: float, ended: float, previous: int) -> None:
    record = _record
    if record is None:
        return
    slots = record.slots
    slots[P_SAVE_SECONDS] += ended - started
    slots[P_SAVES] += 1
    slots[P_SAVED_STEP] = count
    slots[P_LOOP_AT_SAVE] = slots[P_LOOP_SECONDS]
    if slots[P_LOOP_START]:
        record.excluded += ended - started
    slots[P_STATE] = previous
    record.event(event="saved", step=count, path=str(path), seconds=round(ended - started, 4))


def save_blocked(seconds: float) -> None:
    """The training waited `seconds` for its checkpoint writes outside a save (checkpointer.wait())."""
    record = _record
    if record is not None:
        record.slots[P_SAVE_SECONDS] += seconds
        if record.slots[P_LOOP_START]:
            record.excluded += seconds


def written(seconds: float, waited: float) -> None:
    """A background checkpoint write ended after `seconds` of writing; the training process waited `waited`
    seconds for it (a save that came while it was writing, wait(), the stop)."""
    record = _record
    if record is not None:
        record.slots[P_SAVE_BACKGROUND] += seconds
        record.slots[P_SAVE_WAITED] += waited


def stopped(count: int, path, save_seconds: float, reason: str, requested_at: float) -> None:
    """The agreed stop: saved at `count`, leaving."""
    record = _record
    if record is None:
        return
    record.slots[P_STOP_STEP] = count
    record.slots[P_STATE] = STATE["stopped"]
    record.event(event="stopped", step=count, path=str(path), seconds=round(save_seconds, 4), reason=reason,
                 requested_at=requested_at)


def recovery(live: bool) -> None:
    """Whether this worker's loop recovers a lost rank in-process (world/generation.py): the launcher keeps the
    other workers only then."""
    if _record is not None:
        _record.event(event="recovery", live=live)


def joins(taken: bool, why: str = "") -> None:
    """Whether this worker takes ranks that join the run in at its step boundaries (world/joining.py), and if not
    why: a node that joins then makes the group save and restart."""
    if _record is not None:
        _record.event(event="joins", taken=taken, why=why)


def regrouped(number: int, members, lost, seconds: float, redone: bool, joined=(), healed=None) -> None:
    """Generation `number` of the world began: `members` go on without `lost` (and with `joined`, ranks taken in)
    after `seconds` of regrouping; `redone`: the step in flight (the one after `step`, the last applied) starts
    over at the new generation; `healed`: (bytes, seconds) of the state handed to the joiners."""
    if _record is not None:
        _record.event(event="generation", number=number, members=list(members), lost=list(lost),
                      joined=list(joined), healed=list(healed) if healed else None,
                      seconds=round(seconds, 4), redone=redone, step=int(_record.slots[P_STEP]), at=time.monotonic())


def event(kind: str, **fields) -> None:
    """A rare event of the training for the run summary (e.g. `replica_mismatch`, `nonfinite_skipped`: the
    replica audit's, engine/replicas/), with the step this rank is at."""
    if _record is not None:
        _record.event(event=kind, at_step=int(_record.slots[P_STEP]), **fields)


def exited() -> None:
    if _record is not None:
        slots = _record.slots
        slots[P_EXITED_AT] = time.monotonic()
        if slots[P_STATE] != STATE["stopped"]:
            slots[P_STATE] = STATE["exited"]


def teardown_requested() -> bool:
    """The launcher is stopping this group for a failure: a SIGTERM now means now."""
    return _record is not None and _record.slots[P_TEARDOWN] != 0


# -- the launcher's side --------------------------------------------------------------------------

@dataclass
class Progress:
    """One rank's record as read after (or during) an attempt."""

    rank: int
    pid: int
    state: str
    created: float
    ready: float  # 0: init() never finished
    loop_start: float  # 0: no Checkpointer, so no training loop seen
    last_step_at: float
    step: int
    first_step: int
    loop_seconds: float
    saved_step: int  # -1: nothing saved or restored in this attempt
    loop_at_save: float
    save_seconds: float
    saves: int
    restore_seconds: float
    restores: int
    stop_step: int
    exited_at: float
    listening: bool
    events: list[dict] = field(default_factory=list)
    save_waited: float = 0.0  # of the time saving: waiting for the previous background write
    save_background: float = 0.0  # seconds background writers spent writing (beside the training)

    def last(self, kind: str) -> dict | None:
        return next((e for e in reversed(self.events) if e.get("event") == kind), None)

    @property
    def steps_unsaved(self) -> int:
        """Steps this attempt made after its last save (or restore): what a failure now would lose."""
        return max(0, self.step - max(self.saved_step, self.first_step))


def read(directory: str) -> dict[int, Progress]:
    """Every rank's record in `directory` (an attempt's folder), by rank."""
    found = {}
    for s in _slots(directory):
        rank = int(s[P_RANK])
        found[rank] = Progress(
            rank, int(s[P_PID]), STATES[int(s[P_STATE])] if 0 <= s[P_STATE] < len(STATES) else "?", s[P_CREATED],
            s[P_READY], s[P_LOOP_START], s[P_LAST_STEP_AT], int(s[P_STEP]), int(s[P_FIRST_STEP]), s[P_LOOP_SECONDS],
            int(s[P_SAVED_STEP]), s[P_LOOP_AT_SAVE], s[P_SAVE_SECONDS], int(s[P_SAVES]), s[P_RESTORE_SECONDS],
            int(s[P_RESTORES]), int(s[P_STOP_STEP]), s[P_EXITED_AT], bool(s[P_LISTENING]),
            _events(events_path(directory, rank)), s[P_SAVE_WAITED], s[P_SAVE_BACKGROUND])
    return found


def live(directory: str) -> tuple[int, int] | None:
    """(steps a StepLog counted, the loop's length or 0) on the lowest rank of `directory` that has a StepLog;
    the slots alone, a few hundred bytes per rank, for a status line redrawn twice a second."""
    best = None
    for s in _slots(directory):
        if not s[P_LOGGED_STEP]:
            continue
        if best is None or s[P_RANK] < best[0]:
            best = (s[P_RANK], int(s[P_LOGGED_STEP]), int(s[P_TOTAL_STEPS]))
    return best[1:] if best is not None else None


def _slots(directory: str):
    """The slots of every rank's record in `directory` that is whole and of this version."""
    for path in rank_files(directory, ".progress"):
        try:
            with open(path, "rb") as handle:
                raw = handle.read(8 * SLOTS)
        except OSError:
            continue
        if len(raw) < 8 * SLOTS:
            continue
        s = struct.unpack(f"{SLOTS}d", raw)
        if s[P_MAGIC] == MAGIC and s[P_VERSION] == VERSION:
            yield s


def _events(path: str) -> list[dict]:
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a SIGKILL
    return events


def mark_teardown(directory: str) -> None:
    """Tell every worker recorded in `directory` that the SIGTERM coming is a teardown, not a stop request."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith("rank-") and n.endswith(".progress")]
    except OSError:
        return
    for name in names:
        try:
            with open(os.path.join(directory, name), "r+b") as handle:
                handle.seek(8 * P_TEARDOWN)
                handle.write(struct.pack("d", 1.0))
        except OSError:
            pass
