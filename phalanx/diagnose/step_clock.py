"""Where this process's step time went that was not its own work: waiting for peers, waiting for data.

Two running totals in nanoseconds, added to by the engine's bounded waits (bucket/step_guard.py,
the shared-memory exchange's claim) and by phalanx's loader; a count of the optimizer steps skipped
for a non-finite gradient (engine/replicas/nonfinite.py); and the outer steps across hosts of DiLoCo
with their bytes (engine/diloco/outer.py). A reader (observe/steplog.py) takes
differences between two of its calls; nothing here resets. Process-wide, like the recorder: a wait
is the process's, whichever DDP instance or loader caused it. An addition costs two clock reads.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

_exchange_wait_ns = 0
_data_wait_ns = 0
_skipped_steps = 0
_outer_steps = 0
_across_bytes = 0

now_ns = time.perf_counter_ns


def add_exchange_wait(nanoseconds: int) -> None:
    """Time blocked until peers arrived (or their results did) in one of phalanx's collectives."""
    global _exchange_wait_ns
    _exchange_wait_ns += nanoseconds


def add_data_wait(nanoseconds: int) -> None:
    """Time the training loop waited for phalanx's DataLoader to hand it a batch."""
    global _data_wait_ns
    _data_wait_ns += nanoseconds


@contextmanager
def waiting_for_peers():
    """`with waiting_for_peers(): work.wait()`: the block's time counts as waiting on the exchange."""
    started = now_ns()
    try:
        yield
    finally:
        add_exchange_wait(now_ns() - started)


def totals() -> tuple[int, int]:
    """(nanoseconds waited for peers, nanoseconds waited for data) since the process started."""
    return _exchange_wait_ns, _data_wait_ns


def add_skipped_step() -> None:
    """Every rank skipped an optimizer step: a gradient was NaN or Inf (on_nonfinite="skip")."""
    global _skipped_steps
    _skipped_steps += 1


def skipped_steps() -> int:
    """Optimizer steps skipped for a non-finite gradient since the process started."""
    return _skipped_steps


def add_outer_step(nbytes: int) -> None:
    """An outer step of across_hosts=DiLoCo(...) ended: this rank sent `nbytes` of pseudo-gradient across hosts
    for it."""
    global _outer_steps, _across_bytes
    _outer_steps += 1
    _across_bytes += nbytes


def outer_totals() -> tuple[int, int]:
    """(outer steps, bytes this rank sent across hosts for them) since the process started."""
    return _outer_steps, _across_bytes
