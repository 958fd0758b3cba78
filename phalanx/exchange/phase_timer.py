"""Where an exchange's time goes: seconds per phase and per bucket, for `phalanx bench --profile`.

Every exchange times its phases through one `PhaseTimer`; switched off (the default) a phase costs
two attribute reads, so the timers stay in place in production code.
"""

from __future__ import annotations

import time
from collections import defaultdict

# copy_in: gradients into the bucket (scaled); reduce: summing over ranks; wait: for peers or for a
# transport's thread; copy_out: results into .grad (or fetched from their owners).
PHASES = ("copy_in", "reduce", "wait", "copy_out")


class PhaseTimer:
    """`with timer("copy_in", bucket.index): ...` adds the block's wall time when `enabled`."""

    __slots__ = ("enabled", "seconds", "_key", "_start")

    def __init__(self):
        self.enabled = False
        self.seconds: dict[tuple[str, int], float] = defaultdict(float)
        self._key = None
        self._start = 0.0

    def __call__(self, phase: str, bucket: int) -> PhaseTimer:
        if self.enabled:
            self._key = (phase, bucket)
        return self

    def __enter__(self) -> None:
        if self.enabled:
            self._start = time.perf_counter()

    def __exit__(self, *exc_info) -> None:
        if self.enabled:
            self.seconds[self._key] += time.perf_counter() - self._start

    def reset(self) -> None:
        self.seconds.clear()

    def totals(self) -> dict[str, float]:
        """Seconds per phase, summed over buckets."""
        out = dict.fromkeys(PHASES, 0.0)
        for (phase, _), seconds in self.seconds.items():
            out[phase] += seconds
        return out
