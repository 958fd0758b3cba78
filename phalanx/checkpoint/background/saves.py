"""A Checkpointer's background saves on one rank: its staging buffer, its writer, the write in flight.

At most one write is in flight: `settle()` waits for it (a save that comes while one is writing waits
here, and the time it waited is counted) and returns why it failed, if it did. `submit()` snapshots
the rank's share of the state into the staging buffer and hands it to the writer; it returns as soon
as the copy is complete. Every BackgroundSaves is settled when the process exits normally, so a last
save is committed even without `wait()`, and a restore or a listing of the directory in this process
waits for the writes in flight to it, whichever Checkpointer made them.

With live recovery a rank may be lost while its part of a checkpoint is being written: its writer dies with it,
and rank 0's writer would wait for that part. While a rank waits for its write in flight it tells rank 0's writer
which of the ranks that saved are lost (gone, or no longer in the generation that trains): that checkpoint is
given up, said in one line, and the newest complete one stays the newest.
"""

from __future__ import annotations

import atexit
import os
import time

from ...diagnose import progress
from ...log import logger
from ...world import generation
from ...world import group as world
from .staging import Staging
from .writer import BackgroundWriter, note_failed

_in_flight: set = set()  # held while their write is in flight, even when their Checkpointer is gone


class BackgroundSaves:
    def __init__(self, directory):
        self.directory = directory
        self.staging = Staging()
        self.writer: BackgroundWriter | None = None
        self.in_flight: dict | None = None  # the job being written: its sequence and when it was handed over
        self.waited = 0.0  # seconds saves and wait() spent waiting for a write in flight
        self.background = 0.0  # seconds the writer spent writing

    def settle(self) -> tuple[float, dict | None]:
        """Wait for the write in flight; (seconds waited, the failed answer or None)."""
        if self.in_flight is None or self.writer is None:
            return 0.0, None
        started = time.monotonic()
        answer = self.writer.result(self._say_lost_parts)
        waited = time.monotonic() - started
        flight, self.in_flight = self.in_flight, None
        _in_flight.discard(self)
        self.waited += waited
        if answer.get("died"):
            self.writer.close()
            self.writer = None  # the next save forks a new one
        if answer.get("lost"):
            logger.warning("checkpoint %d in %s is given up: %s; the newest complete checkpoint stays the newest",
                           answer["sequence"], self.directory, answer["error"])
            progress.written(0.0, waited)
            return waited, None
        if answer.get("ok"):
            self.background += answer["seconds"]
            progress.written(answer["seconds"], waited)
            return waited, None
        progress.written(0.0, waited)
        if answer.get("died"):  # rank 0's writer waits for this rank's part: tell it there will be none
            note_failed(self.directory, flight["sequence"], flight["rank"], answer["error"])
        return waited, answer

    def submit(self, job: dict, part, main) -> None:
        """Snapshot `part` and `main` (this rank's share) into the staging buffer, and hand them to the writer."""
        (part, main), grew = self.staging.snapshot((part, main))
        if grew and self.writer is not None:  # the writer maps the old buffer: a new one maps the new
            self.writer.close()
            self.writer = None
        if self.writer is None:
            self.writer = BackgroundWriter(self.staging.buffer)
        self.writer.submit({**job, "part": part, "main": main})
        self.in_flight = {"sequence": job["sequence"], "rank": job["rank"], "at": time.monotonic(),
                          "members": generation.current().members if generation.live_recovery() else ()}
        _in_flight.add(self)
        world.before_shutdown(_settle_all)  # a rank that ends through shutdown() and os._exit skips atexit

    def _say_lost_parts(self) -> None:
        """Tell rank 0's writer which ranks of those that saved the checkpoint in flight are lost (their parts will
        not come); a loss is then acted on by the training loop's next collective."""
        flight = self.in_flight
        if not flight or not flight["members"] or not world.is_initialized():
            return
        try:
            lost = generation.lost_since(flight["members"])
        except Exception as exc:  # the store gone with the run's end: the training loop hears of it
            logger.debug("could not look for lost ranks while a checkpoint is written: %s", exc)
            return
        for rank in sorted(lost):
            note_failed(self.directory, flight["sequence"], flight["members"].index(rank),
                        f"rank {rank} was lost (live recovery)", lost=True)

    def close(self) -> None:
        waited, failed = self.settle()
        if failed is not None:
            logger.error("the last background checkpoint write in %s failed: %s", self.directory, failed["error"])
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def settle_directory(directory) -> list[dict]:
    """Wait for every write in flight to `directory` from this process; the answers of those that failed."""
    target = os.path.realpath(directory)
    failed = []
    for saves in list(_in_flight):
        if os.path.realpath(saves.directory) == target:
            _, answer = saves.settle()
            if answer is not None:
                failed.append(answer)
    return failed


@atexit.register
def _settle_all() -> None:
    """At a normal exit: every write in flight is committed before the process (and its writers) end."""
    for saves in list(_in_flight):
        try:
            saves.close()
        except Exception as exc:  # an exit must not hang or fail on a checkpoint already reported
            logger.error("could not finish a background checkpoint write: %s", exc)
