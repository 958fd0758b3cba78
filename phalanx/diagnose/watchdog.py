"""The stall watchdog inside the workers, for runs that `phalanx run` did not start (torchrun, srun).

Every rank runs one daemon thread that polls its host's rings. On a stall the first rank to claim
the report (a rank stuck holding the GIL cannot: its thread never runs) collects the stacks, prints
the verdict and writes stall-report.json; then every rank exits with STALL_EXIT_CODE, so the
launcher stops the group or restarts it under its own --max-restarts. PHALANX_ON_STALL=wait keeps
the processes alive for a debugger. A host only sees its own ranks: a rank stuck on another host is
named by that host's watchdog.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time

from .watch import StallWatch, collect

POLL_SECONDS = 1.0
STALL_EXIT_CODE = 86
REPORT_WAIT_SECONDS = 15.0  # how long a rank waits for the reporter before it exits anyway


class Watchdog(threading.Thread):
    """Polls the rings of this host's ranks (see the module docstring)."""

    def __init__(self, directory: str, rank: int, local_rank: int, local_world_size: int, world_size: int,
                 timeout: float, on_stall: str = "stop"):
        super().__init__(name="phalanx-stall-watchdog", daemon=True)
        first = rank - local_rank
        self.expected = list(range(first, first + local_world_size))
        self.elsewhere = [r for r in range(world_size) if r not in self.expected]
        self.directory, self.rank, self.on_stall = directory, rank, on_stall
        self.report_dir = os.environ.get("PHALANX_LOG_DIR") or directory
        self.watch = StallWatch(directory, timeout, self.expected)
        # Not `_stop`: that is a method of Thread, which a forked child (a DataLoader worker) calls on
        # every thread it inherits; an Event there prints "TypeError: 'Event' object is not callable".
        self._quit = threading.Event()

    def stop(self) -> None:
        self._quit.set()

    def run(self) -> None:
        while not self._quit.wait(POLL_SECONDS):
            if not self.watch.poll():
                continue
            report = os.path.join(self.report_dir, "stall-report.json")
            if self._claim():
                verdict = collect(self.directory, self.expected, elsewhere=self.elsewhere)
                sys.stderr.write(f"phalanx: STALL: no rank of this host made progress for "
                                 f"{self.watch.timeout:g}s (PHALANX_STALL_TIMEOUT)\n" + verdict.text())
                verdict.write(report)
                sys.stderr.write(f"phalanx: stall report written to {report}\n")
                sys.stderr.flush()
            if self.on_stall == "wait":
                continue
            deadline = time.monotonic() + REPORT_WAIT_SECONDS
            while not os.path.exists(report) and time.monotonic() < deadline:
                time.sleep(0.1)
            os._exit(STALL_EXIT_CODE)

    def _claim(self) -> bool:
        """True for the one rank of this host that reports this stall."""
        key = hashlib.sha256(self.watch.stall_key.encode()).hexdigest()[:12]
        try:
            os.close(os.open(os.path.join(self.directory, f"stall-{key}.claim"), os.O_CREAT | os.O_EXCL, 0o600))
            return True
        except FileExistsError:
            return False
