"""Stragglers: which rank arrives late at the gradient exchanges, and by how much.

The all-reduce makes every rank leave an exchange together, so per-rank backward times look equal
even when one rank is slow; only the arrival times differ. Each bucket exchange is numbered the
same on every rank, and its arrival time is on a clock shared by the processes of a host, so the
lateness of rank r at exchange n is its arrival minus the earliest arrival at n. No collective.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from . import recorder
from .record import Snapshot, read_rings

WINDOW = 400  # the most recent exchanges considered
CONSISTENT = 0.75  # last at this fraction of exchanges or more...
MIN_LATE_MS = 2.0  # ...by at least this much (median): a straggler worth a line


@dataclass
class RankSkew:
    rank: int
    late_ms: float  # median lateness over the exchanges (0 where it arrived first)
    last_fraction: float  # fraction of exchanges at which it arrived last
    data_wait_ms_per_step: float
    exchanges: int

    def as_dict(self) -> dict:
        return asdict(self)


def skew(snapshots: dict[int, Snapshot], since_seq: int = 0, window: int = WINDOW) -> dict[int, RankSkew]:
    """Arrival skew per rank over the bucket exchanges every rank recorded (numbered >= since_seq)."""
    arrivals: dict[int, dict[int, int]] = {}
    for rank, snap in snapshots.items():
        arrivals[rank] = {e.seq: e.entered_ns for e in snap.entries if e.kind == "bucket" and e.seq >= since_seq}
    if len(arrivals) < 2:
        return {}
    common = sorted(set.intersection(*(set(a) for a in arrivals.values())))[-window:]
    late = {rank: [] for rank in arrivals}
    last = dict.fromkeys(arrivals, 0)
    for seq in common:
        times = {rank: arrivals[rank][seq] for rank in arrivals}
        first = min(times.values())
        for rank, t in times.items():
            late[rank].append((t - first) / 1e6)
        last[max(times, key=times.get)] += 1
    result = {}
    for rank, snap in snapshots.items():
        n = len(common)
        data = snap.data_ns / 1e6 / (snap.step - 1) if snap.step > 1 else 0.0
        result[rank] = RankSkew(rank, round(statistics.median(late[rank]), 3) if n else 0.0,
                                round(last[rank] / n, 3) if n else 0.0, round(data, 3), n)
    return result


def straggler(skews: dict[int, RankSkew]) -> RankSkew | None:
    """The rank that is consistently last by a margin worth reporting, if there is one."""
    if not skews:
        return None
    worst = max(skews.values(), key=lambda s: s.late_ms)
    if worst.last_fraction >= CONSISTENT and worst.late_ms >= MIN_LATE_MS:
        return worst
    return None


def summary(skew_of: RankSkew) -> str:
    """'rank 3 arrives 48.0 ms late at 92 % of exchanges; its data wait is 45.0 ms/step'."""
    return (f"rank {skew_of.rank} arrives {skew_of.late_ms:.1f} ms late at {skew_of.last_fraction:.0%} of "
            f"{skew_of.exchanges} gradient exchanges; its data wait is {skew_of.data_wait_ms_per_step:.1f} ms/step")


def straggler_report() -> dict[int, RankSkew]:
    """Arrival skew of every rank of this host at the recent gradient exchanges, from their rings.

    Empty when this process records nothing (a world of one, PHALANX_RECORD=0). Ranks on other hosts
    are not included: their rings are on their hosts.

    >>> import phalanx                                             # doctest: +SKIP
    >>> for rank, s in phalanx.straggler_report().items():
    ...     print(rank, s.late_ms, s.last_fraction, s.data_wait_ms_per_step)
    """
    directory = recorder.directory()
    return skew(read_rings(directory)) if directory else {}
