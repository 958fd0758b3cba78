"""A regroup's two Gloo groups among S ranks, fitted from the units' rounds at N <= 16 clients (regroup_units.py), for
control_plane_model.py: full-mesh groups (each rank reads every member's address and connects every pair as the group
is made) and the generations' lazy groups (generations/current.py generation_group: each rank reads the addresses of,
and connects, only the peers of a ring all-reduce and of a broadcast from rank 0: joining.connect_lazy).

  full mesh  G(S) = g0 + g1 (S - 1) + k S (S - 1) s   (S - 1 peers per rank; k store ops per rank and peer)
  lazy       G(S) = g0 + g1 h(S) + k pairs(S) s       (h(S) = 1 + ceil(log2 S): the connect's steps, a message each
                                                       way between ring neighbours, then a broadcast from rank 0;
                                                       pairs(S): the ring's and the broadcast tree's, at most
                                                       2 + log2 S per rank; k store ops per pair, both ends' reads
                                                       and their addresses: joining.connect_lazy)
s: the store's CPU per operation (it serves them one at a time); g0, g1: least squares over the counts measured, less
the store's part (with more clients than cores, g1 is this machine's, its CPU shared), neither negative (the best
line through the origin where the free line would start below 0, the flat one where it would fall).
"""

from __future__ import annotations

import math
import statistics


def lazy_pairs(ranks: int) -> int:
    """The pairs a lazy group connects in generation_group: the ring's (i, i + 1) and the broadcast tree's from rank
    0 (Gloo's binomial tree: rank i's parent is i less its highest power of 2)."""
    ring = {frozenset((i, (i + 1) % ranks)) for i in range(ranks)} if ranks > 1 else set()
    tree = {frozenset((i, i - (1 << (i.bit_length() - 1)))) for i in range(1, ranks)}
    return len(ring | tree)


def steps(ranks: int) -> float:
    """The connect's steps (joining.connect_lazy): a message each way between ring neighbours, and a broadcast's
    log2 S, taken as one after the other."""
    return 1 + math.ceil(math.log2(ranks)) if ranks > 1 else 0.0


class GroupFit:
    """One kind of group (`lazy` or full mesh): its store ops and the fitted times of the regroup's two groups."""

    def __init__(self, groups: dict, s: float, lazy: bool, k: float | None = None):
        groups = {int(n): v for n, v in groups.items()}
        self.s, self.lazy = s, lazy
        largest = max(groups)
        # store operations (2 segments an op, back to back) per pair connected: per rank and peer for a full mesh
        # (`k`: as another fit of the same groups found it, for rounds that did not count them)
        self.k = groups[largest]["store_segs"] / 2 / self.pairs(largest) if k is None else k
        # each rank's CPU in making a group, and the cores its rounds' ranks shared (the workers' units: group_units.py)
        measured_cpu = all("cpu_first" in v and "cores" in v for v in groups.values())
        self.cores = min(v["cores"] for v in groups.values()) if measured_cpu else None
        # `third`: the meeting's end once the groups are made (the formation, the new watch), where the rounds did it
        self.parts = ("first", "second", "third") if all("third" in v for v in groups.values()) else ("first", "second")
        self.cpu = tuple(statistics.mean(v[f"cpu_{part}"] for v in groups.values()) if measured_cpu else 0.0
                         for part in self.parts)
        # a saved set from before the units made the regroup's two groups holds one group's `seconds` from a start
        self.fits = tuple(self._fit({n: v.get(part, v.get("seconds")) for n, v in groups.items()}, cpu,
                                    store=part != "third") for part, cpu in zip(self.parts, self.cpu))

    @property
    def first(self) -> tuple[float, float]:
        """(g0, g1) of the main group, from the decision."""
        return self.fits[0]

    @property
    def second(self) -> tuple[float, float]:
        """(g0, g1) of the control group, after the main one."""
        return self.fits[1]

    def pairs(self, ranks: int) -> int:
        """The pairs whose store reads the group's making costs: every ordered pair for a full mesh."""
        return lazy_pairs(ranks) if self.lazy else ranks * (ranks - 1)

    def work(self, ranks: int) -> float:
        """What g1 multiplies: the steps of the connect's collectives (lazy), or the peers per rank (full mesh)."""
        return steps(ranks) if self.lazy else ranks - 1

    def store_ops(self, ranks: int) -> float:
        return self.k * self.pairs(ranks)

    @staticmethod
    def sharing(ranks: int, cores: int | None) -> float:
        """How many ranks' CPU each rank waits for while `ranks` make a group on `cores` cores (None: a core each)."""
        return max(1.0, ranks / cores) if cores else 1.0

    def _fit(self, seconds: dict[int, float], cpu: float, store: bool = True) -> tuple[float, float]:
        xs = [self.work(n) for n in seconds]
        # less the store's part, and the ranks' CPU as the rounds' cores served it
        ys = [v - (self.store_ops(n) * self.s if store else 0.0) - cpu * self.sharing(n, self.cores)
              for n, v in seconds.items()]
        mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        g1 = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0)
        if mean_y - g1 * mean_x >= 0.0:
            return mean_y - g1 * mean_x, g1
        # neither may be negative: the best line through the origin (clamping g0 alone would keep a slope fitted
        # with a negative g0 and overshoot every count)
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)) if any(xs) else 0.0

    def seconds(self, ranks: int, cores: int | None = None) -> tuple[float, ...]:
        """The main group's (from the decision) and the control group's (after it) seconds among `ranks`, then the
        meeting's end where measured (`third`), on `cores` cores that all of them share (None: a core each, as on
        hosts with a core per rank). The store's part is the groups' (the meeting's end makes a few operations)."""
        store, sharing = self.store_ops(ranks) * self.s, self.sharing(ranks, cores)
        return tuple(g0 + g1 * self.work(ranks) + (store if part != "third" else 0.0) + cpu * sharing
                     for part, (g0, g1), cpu in zip(self.parts, self.fits, self.cpu))

    def describe(self) -> str:
        unit = "step of its connect" if self.lazy else "peer"
        what = "pair connected" if self.lazy else "rank and peer"
        cpu = (f", + each rank's CPU, {' / '.join(f'{1e3 * c:.1f}' for c in self.cpu)} ms, times the ranks a core "
               f"serves (fitted on {self.cores})" if self.cores else "")
        if len(self.fits) > 2:
            cpu = (f"; the meeting's end (formation, new watch) {1e3 * self.fits[2][0]:.1f} ms + "
                   f"{1e3 * self.fits[2][1]:.2f} ms per {unit}{cpu}")
        return (f"{1e3 * self.first[0]:.1f} ms + {1e3 * self.first[1]:.2f} ms per {unit} (the main one, from the "
                f"decision), then {1e3 * self.second[0]:.1f} ms + {1e3 * self.second[1]:.2f} ms per {unit} (the "
                f"control one), + {self.k:.2f} store ops per {what}{cpu}")
