"""The scale model's formulas (control_plane_model.py's docstring says what each term is): per rank and step, the
time to name a loss, the regroup's parts, the healthy commit's delay, from the unit costs measured here."""

from __future__ import annotations

import statistics

from benchmarks.control_plane.group_model import GroupFit
from phalanx.world.generations.commit_tree import tree_place
from phalanx.world.generations.settings import WATCH_EVERY as WATCH  # phalanx's own constants, as the code has them
from phalanx.world.liveness import PROBE_TIMEOUT, TICK
from phalanx.world.liveness import SILENT_WINDOW as WINDOW
from phalanx.world.watch import LOOK_EVERY

AGREE_OPS = 8  # the deciding survivor's store operations once every survivor is listed (generations/agreement.py)
FORM_OPS = 2  # a regroup's formation once its groups are made: each member's add, the last one's set (agreement.py)
WAITED_COMMIT = 2.0  # the new commit's store operations after its add: one blocking wait, one read of the counter
F_DEFAULT = 0.15  # seconds for the models and loaders, when no loss run was measured
WATCH_BEFORE = 0.1  # seconds between a waiting rank's looks in the designs before the tree (the code they describe)


def watch_every(design: str) -> float:
    """Seconds between a waiting rank's looks in `design`: phalanx's own WATCH for the tree, the code it runs now."""
    return WATCH if design == "tree" else WATCH_BEFORE


class Units:
    """The measured unit costs, and what is fitted from them."""

    def __init__(self, raw: dict):
        self.raw = raw
        self.rtt, self.seg_op = raw["store_rtt"], raw["segs_per_op_b2b"]
        self.seg_ack = max(0.0, raw["segs_per_op"] - raw["segs_per_op_b2b"])
        self.t_p, self.q = raw["probe"]["seconds"], raw["probe"]["segs"]
        self.keep = raw["keepalive_segs_per_s"]
        self.s = statistics.median(raw["store_cpu_per_op"].values())
        commits = {int(n): v for n, v in raw["commit"].items()}
        self.reads = {n: v["reads"] for n, v in commits.items()}
        self.full_mesh = GroupFit(raw["group"], self.s, lazy=False)
        # lazy groups as the loss runs' workers make them (group_units.py), else as the units' small clients do;
        # the workers' at each layout measured (ranks per host: a rank a host, and group_units.py --per-host L)
        self.lazy_by = "workers" if "group_lazy_workers" in raw else "clients"
        lazy = raw.get("group_lazy_workers") or raw.get("group_lazy")
        self.lazy = GroupFit(lazy, self.s, lazy=True) if lazy else None
        self.layouts = {1: self.lazy} if self.lazy_by == "workers" else {}
        for per_host, rounds in raw.get("group_lazy_workers_by_layout", {}).items():
            self.layouts[int(per_host)] = GroupFit(rounds, self.s, lazy=True, k=self.lazy.k)
        alone = raw.get("watch_end", {})
        self.t_end = alone.get("seconds", 0.0)
        # of which the victim's own teardown (its exit, as the kernel tells it): the rest is the watcher's part
        self.t_teardown = alone.get("teardown")
        # a host's victims dying together beside the runs' other ranks, on this machine's cores (watch_end.py
        # --per-host L --beside H), by L; a rank a host measured alone where not so
        self.ends_here = {1: alone, **{int(n): entry for n, entry in raw.get("watch_end_by_layout", {}).items()}}
        self.hop = raw.get("tree", {}).get("hop", self.rtt / 2)  # tree_units.py's: a tree message, one way

    def r(self, ranks: int) -> float:
        """The commit's reads per rank: as measured at the nearest count (beyond the largest: as there)."""
        nearest = min(self.reads, key=lambda n: (abs(n - ranks), -n))
        return self.reads[nearest]

    def reads_in_runs(self, row: dict, waits) -> float:
        """The commit's reads per rank that a namespace run shows: its store connection's segments per step (both
        ways) less the looks' reads, less the ACKs closing the bursts, over 2 a read, less the add."""
        ranks = row["hosts"] * row["per_host"]
        f = (ranks - 1) / ranks
        c = statistics.mean(looks(w, (ranks - row["per_host"]) * self.t_p + self.rtt) for w in waits)
        ops = (row["on"]["rank_store"] - self.seg_ack * (1 + f * c)) / self.seg_op
        return max(0.0, ops - 1 - f * c)

    def groups(self, ranks: int, lazy: bool = True, per_host: int = 1, here: bool = False) -> tuple[float, ...]:
        """A regroup's main group (from the decision) and control group (after it) among `ranks`, `per_host` ranks a
        host: lazy, as phalanx makes them, when the units measured those (group_model.py), as the workers made them
        at the measured layout nearest `per_host` (layout()). `here`: all of them on this machine's cores, as in the
        namespace runs (else a core each, as on the hosts the extrapolation is about)."""
        fit = self.full_mesh if not (lazy and self.lazy) else \
            self.layouts[self.layout(per_host)] if self.layouts else self.lazy
        return fit.seconds(ranks, fit.cores if here else None)

    def end(self, per_host: int, here: bool = False) -> tuple[float, float | None]:
        """(a kept watch's end after a kill of a host of `per_host` ranks: the first of its victims' verdicts, of
        which their teardown): `here`, as the namespace runs meet it, where a host's victims die together beside the
        other ranks on this machine's cores (measured at the layout nearest `per_host`); else one victim alone, as on
        hosts of a core a rank, the extrapolation's."""
        if not here:
            return self.t_end, self.t_teardown
        entry = self.ends_here[nearest_layout(self.ends_here, per_host)]
        return entry.get("seconds", 0.0), entry.get("teardown")

    def layout(self, per_host: int) -> int | None:
        """The ranks per host of the workers' groups unit taken for `per_host` (the nearest measured; of two as
        near, the larger); None where only the clients' unit was measured."""
        return nearest_layout(self.layouts, per_host)


def nearest_layout(measured, per_host: int) -> int | None:
    """Of the ranks per host `measured` at, the nearest `per_host` (of two as near, the larger); None if none."""
    return min(measured, key=lambda layout: (abs(layout - per_host), -layout), default=None)


def looks(wait: float, look: float, every: float = WATCH_BEFORE) -> int:
    """How many times a rank waiting `wait` seconds looks, `every` seconds apart, each look taking `look` seconds."""
    count = 0
    while (count + 1) * every + count * look <= wait:
        count += 1
    return count


def per_step(units: Units, design: str, ranks: int, per_host: int, waits, step: float, r=None) -> dict:
    """Store ops, connections and segments per rank and step; `waits`: the slow rank's lead in each step; `r`: the
    commit's reads per rank (default: the rounds' at that count)."""
    f = (ranks - 1) / ranks
    others = ranks - per_host  # members on other hosts
    r = units.r(ranks) if r is None else r
    if not others:  # one host: the shared-memory exchange ends alike on every rank (no commit), peers seen by pid
        return {"ops": 0.0, "connections": 0.0, "segments": 0.0, "speaker_segments": 0.0, "store_ops": 0.0,
                "store_busy": 0.0, "looks": 0.0}
    if design == "today":
        look = others * units.t_p + units.rtt
        c = statistics.mean(looks(w, look) for w in waits)
        ops = 1 + r + f * c
        conns = f * c * others
        segs = units.seg_op * ops + units.seg_ack * (1 + f * c) + units.q * conns
    elif design == "tree":  # the root decides alone; the looks ask the alarm's thread; the tree's edges, both ends
        c = statistics.mean(looks(w, 0.0, watch_every(design)) for w in waits)
        ops = 0.0
        conns = 0.0
        edges = ranks // per_host - 1
        segs = (units.seg_op + units.seg_ack) * 2 * edges / ranks + 2 * step / TICK
        # a host's speaker (its local rank 0, whose connections the runs count) carries its host's share of the edges
        speaker = (units.seg_op + units.seg_ack) * 2 * edges * per_host / ranks + 2 * step / TICK
    else:
        u = 1.0 if design == "new" else 1.0 / per_host
        c = statistics.mean(looks(w, units.rtt) for w in waits)
        ops = u * (1 + WAITED_COMMIT) + f * c
        conns = 0.0
        segs = units.seg_op * ops + units.seg_ack * (u + f * c) + 2 * step / TICK
    if design != "tree":
        speaker = segs
    return {"ops": ops, "connections": conns, "segments": segs, "speaker_segments": speaker, "store_ops": ranks * ops,
            "store_busy": ranks * ops * units.s / step, "looks": c}


def tree_depth(speakers: int) -> int:
    """The levels below the root of the speakers' tree (commit_tree.py's tree_place): a message's hops each way."""
    depth, index = 0, speakers - 1
    while index > 0:
        index, depth = tree_place(speakers, index)[0], depth + 1
    return depth


def commit_delay(units: Units, design: str, ranks: int, per_host: int) -> float | None:
    """Seconds a healthy step's commit adds once the last host is ready (None: not modelled for `design`).
    new-host: an add, the wait, a read (3 rtt), behind the store's serial service of every host's add and, once
    woken, of every host's read; tree: a message up and one down per level (`hop` each), the root deciding alone."""
    hosts = ranks // per_host
    if hosts < 2:
        return 0.0
    if design == "new-host":
        return 3 * units.rtt + 2 * hosts * units.s
    if design == "tree":
        return 2 * tree_depth(hosts) * units.hop
    return None


def named(units: Units, design: str, ranks: int, per_host: int, how: str,
          here: bool = False) -> tuple[float, float] | None:
    """Seconds from the loss to the first rank that names it and to every waiting rank knowing it (worst case);
    None: a host alone cannot be cut off. `here`: a kill's victims torn down as in the namespace runs (Units.end)."""
    others = ranks - per_host
    if how == "cut" and not others:
        return None
    if design == "today":  # each rank finds it itself, at a look
        first = watch_every(design) + others * units.t_p + units.rtt
        first += WINDOW + per_host * PROBE_TIMEOUT if how == "cut" else 0.0
        return first, first
    if not others:  # one host: its ranks check each other's pids at their looks (now at most every LOOK_EVERY)
        every = LOOK_EVERY if design == "tree" else WATCH_BEFORE
        return every, every
    first = units.end(per_host, here and how == "kill")[0] + 2 * units.rtt + (WINDOW + TICK if how == "cut" else 0.0)
    if design == "tree":  # the alarm wakes every member's thread, the store answering them in turn; then a look
        return first, first + units.rtt + ranks * units.s + watch_every(design)
    return first, first + watch_every(design) + units.rtt


def regroup_parts(units: Units, design: str, ranks: int, per_host: int, how: str = "kill",
                  lazy: bool = True, here: bool = False, decider_last: bool = False) -> tuple[float, ...]:
    """(E, A, main group, control group, the meeting's end): the regroup's parts, from the loss named (see the
    module docstring); `here`: the groups' ranks sharing this machine's cores, as in the namespace runs
    (Units.groups); `decider_last`: the deciding survivor is the last to enter, and waits for nobody (E: its own
    entry)."""
    survivors = ranks - per_host  # a host lost; its members on other hosts, each probed today
    enter = (0.0 if decider_last else last_entry(design, survivors)) + units.rtt
    if design == "today":
        agree = ranks * units.rtt + ranks * ranks * units.s + survivors * units.t_p
        if how == "cut":  # its poll probes the silent host's ranks, each waiting out the probe's timeout
            agree += per_host * PROBE_TIMEOUT
    else:
        agree = AGREE_OPS * units.rtt + survivors * units.s
    main, control, *end = units.groups(max(1, survivors), lazy, per_host, here)
    if not end:  # the groups' formation (agreement.groups_formed): every member's add, the last one's set
        end = [FORM_OPS * units.rtt + survivors * units.s if design == "tree" else 0.0]
    return enter, agree, main, control, end[0]


def last_entry(design: str, survivors: int) -> float:
    """Seconds the deciding survivor waits, past its own look, for the last survivor to enter the agreement. Before
    the tree: a whole look (the worst case). Now: each survivor enters at its next look, `every` seconds apart, in a
    phase of its own (independent phases: the expectation of max(0, M - U0), M the latest of the n others' phases, U0
    the decider's, all uniform, which is every * n / (2 (n + 2))); ranks that entered their waits together look in
    phase, and the wait is 0."""
    if design != "tree":
        return watch_every(design)
    others = max(0, survivors - 1)
    return watch_every(design) * others / (2 * (others + 2))


def regroup(units: Units, design: str, ranks: int, per_host: int, followers: float, how: str = "kill",
            lazy: bool = True) -> float:
    return sum(regroup_parts(units, design, ranks, per_host, how, lazy)) + followers


def own_segments(row: dict) -> float:
    """A namespace run's control plane per rank and step, segments both ways (control_plane.py's): its store
    connections, its kept watch and the commit tree's connections; nan where the run did not count the watch."""
    on = row["on"]
    return on["rank_store"] + on.get("rank_watch", float("nan")) + on.get("rank_tree", 0.0)
