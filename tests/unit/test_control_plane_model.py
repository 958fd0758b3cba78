"""The control plane's scale model (benchmarks/control_plane/model_formulas.py): the terms a waiting rank's looks put
into a regroup and into the naming of a loss, against what they stand for."""

import json
import random
from pathlib import Path

import pytest

from benchmarks.control_plane.model_formulas import WATCH_BEFORE, Units, last_entry, looks, watch_every
from phalanx.world.generations.settings import WATCH_EVERY
from phalanx.world.watch import LOOK_EVERY
from tests.conftest import ROOT


@pytest.mark.parametrize("survivors", [2, 3, 8, 15, 63])
def test_last_entry_is_the_expected_wait_for_the_last_survivor_when_looks_are_out_of_phase(survivors):
    """The deciding survivor sees the loss at its look, at a uniform phase in [0, WATCH); so does every other one, and
    the decider waits for the latest of them, if it came later: the formula is that wait's expectation."""
    draw = random.Random(survivors)
    trials, total = 40_000, 0.0
    for _ in range(trials):
        decider = draw.uniform(0, WATCH_EVERY)
        latest = max(draw.uniform(0, WATCH_EVERY) for _ in range(survivors - 1))
        total += max(0.0, latest - decider)
    assert last_entry("tree", survivors) == pytest.approx(total / trials, rel=0.03)
    assert last_entry("tree", survivors) < WATCH_EVERY / 2


def test_a_survivor_alone_waits_for_nobody_and_the_designs_before_the_tree_keep_their_whole_look():
    assert last_entry("tree", 1) == 0.0
    assert last_entry("today", 15) == WATCH_BEFORE == 0.1
    assert watch_every("tree") == WATCH_EVERY < watch_every("new-host")


def test_looks_count_the_looks_that_fit_in_a_wait():
    assert looks(0.15, 0.0, every=0.02) == 7
    assert looks(0.15, 0.0) == 1  # every WATCH_BEFORE
    assert looks(0.24, 0.05) == 1  # a second look would end at 0.1 + 0.05 + 0.1 > 0.24
    assert LOOK_EVERY > WATCH_EVERY  # a look reads its host's pids at most every LOOK_EVERY


def test_a_hosts_speaker_carries_its_hosts_share_of_the_tree():
    """The runs count local rank 0's connections, its host's speaker in the tree: with one rank per host that is every
    rank's share; with 4, the speaker's edges are its host's, 4 times a rank's average."""
    from types import SimpleNamespace

    from benchmarks.control_plane.model_formulas import per_step
    from phalanx.world.liveness import TICK

    units = SimpleNamespace(seg_op=2.0, seg_ack=1.0, s=1e-5, r=lambda ranks: 0.0)
    watch = 2 * 0.2 / TICK
    alone, shared = (per_step(units, "tree", 16, per_host, [0.15], 0.2) for per_host in (1, 4))
    assert alone["speaker_segments"] == pytest.approx(alone["segments"]) == pytest.approx(3 * 2 * 15 / 16 + watch)
    assert shared["segments"] == pytest.approx(3 * 2 * 3 / 16 + watch)
    assert shared["speaker_segments"] == pytest.approx(3 * 2 * 3 / 4 + watch)


def test_the_groups_unit_is_the_workers_when_the_units_file_has_it_else_the_clients():
    """A units file saved by control_plane_units.py, and the same after group_units.py --into: the regroup's groups
    come from the workers' rounds there, and are slower than the small clients' (16 workers beside their launchers)."""
    raw = json.loads((Path(ROOT) / "benchmarks/results/control_plane_units_idle-2026-11-29.json").read_text())
    clients = Units({k: v for k, v in raw.items() if k != "group_lazy_workers"})
    workers = Units(raw)
    assert (clients.lazy_by, workers.lazy_by) == ("clients", "workers")
    assert sum(workers.groups(15)) > sum(clients.groups(15)) > 0


def test_the_groups_unit_is_the_one_measured_at_the_nearest_layout():
    """group_units.py --per-host L adds the workers' groups at L ranks a host: the model takes, for a layout, the one
    measured nearest it (of two as near, the larger), fitted over the ranks measured there; the store's part per pair
    is the one-rank-a-host rounds'."""
    raw = json.loads((Path(ROOT) / "benchmarks/results/control_plane_units_idle-2026-11-29.json").read_text())
    faster = {str(ranks): {"first": 0.5 * row["first"], "second": 0.5 * row["second"]}
              for ranks, row in raw["group_lazy_workers"].items() if int(ranks) >= 4}
    units = Units({**raw, "group_lazy_workers_by_layout": {"4": faster}})
    assert [units.layout(n) for n in (1, 2, 3, 4, 8)] == [1, 1, 4, 4, 4]
    assert units.layouts[4].k == units.lazy.k
    alone, shared = (sum(units.groups(12, per_host=n)) for n in (1, 4))
    assert 0 < shared < alone  # the layout's own rounds, halved here
    assert Units({k: v for k, v in raw.items() if k != "group_lazy_workers"}).layout(4) is None  # clients' only


def test_the_groups_fit_takes_the_ranks_cpu_as_the_rounds_cores_served_it():
    """The workers' rounds share this machine's cores: a part's time there is its latency (g0 + g1 steps) plus each
    rank's CPU times the ranks a core serves. The fit recovers the latency from rounds made that way; the namespace
    runs (`here`) get the same sharing, the extrapolation a core per rank."""
    from benchmarks.control_plane.group_model import GroupFit, steps

    def made(n, g0, g1, cpu):
        return g0 + g1 * steps(n) + cpu * max(1.0, n / 2)

    rounds = {str(n): {"first": made(n, 0.005, 0.002, 0.003), "second": made(n, 0.001, 0.0, 0.003),
                       "third": made(n, 0.0, 0.0005, 0.001), "cpu_first": 0.003, "cpu_second": 0.003,
                       "cpu_third": 0.001, "cores": 2, "store_segs": 0.0} for n in (2, 4, 8, 16)}
    fit = GroupFit(rounds, s=1e-5, lazy=True)
    assert fit.parts == ("first", "second", "third") and fit.cores == 2
    assert fit.first == pytest.approx((0.005, 0.002)) and fit.second == pytest.approx((0.001, 0.0))
    here, spread = fit.seconds(12, cores=2), fit.seconds(12)
    assert here == pytest.approx((made(12, 0.005, 0.002, 0.003), made(12, 0.001, 0.0, 0.003), made(12, 0, 5e-4, 1e-3)))
    assert spread == pytest.approx((0.005 + 0.002 * steps(12) + 0.003, 0.001 + 0.003, 0.0005 * steps(12) + 0.001))


def test_a_groups_fit_whose_line_would_start_below_zero_goes_through_the_origin():
    """Rounds at 8, 12 and 16 ranks a host of 4 (2026-11-30): 4, 5 and 5 steps, the least-squares line's g0 below 0.
    Neither term may be negative: the fit is the best line through the origin, not the free line's slope with g0 cut
    to 0, which overshot every count measured (65 ms at 12 ranks, measured in 47)."""
    from benchmarks.control_plane.group_model import GroupFit

    rounds = {"8": {"first": 0.0281, "cpu_first": 0.0028, "second": 0.0109, "cpu_second": 0.0027, "cores": 2,
                    "store_segs": 227.0},
              "12": {"first": 0.0468, "cpu_first": 0.0032, "second": 0.0141, "cpu_second": 0.0026, "cores": 2},
              "16": {"first": 0.0475, "cpu_first": 0.0029, "second": 0.0236, "cpu_second": 0.0025, "cores": 2,
                     "store_segs": 474.5}}
    fit = GroupFit(rounds, s=1e-5, lazy=True)
    assert fit.first[0] == 0.0 and fit.first[1] > 0
    for ranks, row in rounds.items():
        assert fit.seconds(int(ranks), cores=2)[0] == pytest.approx(row["first"], rel=0.25)


def test_a_kills_naming_takes_the_teardown_measured_beside_the_runs_load_at_the_nearest_layout():
    """watch_end.py --per-host L --beside H keeps a host's victims' end as the namespace runs meet it: the comparison
    with the runs (here) takes the one measured at the nearest layout, a rank a host the victim alone where nothing
    else was measured; the extrapolation (a core a rank) and a cut's naming (no teardown: the host goes silent) keep
    the victim alone."""
    from benchmarks.control_plane.model_formulas import named

    raw = json.loads((Path(ROOT) / "benchmarks/results/control_plane_units_idle-2026-11-29.json").read_text())
    alone = {"seconds": 0.017, "teardown": 0.016}
    loaded = {"seconds": 0.025, "teardown": 0.023}
    units = Units({**raw, "watch_end": alone, "watch_end_by_layout": {"4": loaded}})
    assert [units.end(n, here=True) for n in (1, 2, 3, 4, 8)] == [(0.017, 0.016)] * 2 + [(0.025, 0.023)] * 3
    assert units.end(4) == (0.017, 0.016)
    kill_here, kill_away = (named(units, "tree", 16, 4, "kill", here=here)[0] for here in (True, False))
    assert kill_here - kill_away == pytest.approx(0.008)
    assert named(units, "tree", 16, 4, "cut", here=True) == named(units, "tree", 16, 4, "cut")
    bare = Units({k: v for k, v in raw.items() if k != "watch_end"})
    assert bare.end(4, here=True) == bare.end(4) == (0.0, None)


def test_a_decider_entering_last_waits_for_nobody():
    """The kill runs strike right after the victim's step, while their rank 0 (the slow rank, which decides) is in its
    pause: it enters the agreement last, and its E is its own entry; otherwise E is the wait for the last survivor."""
    from benchmarks.control_plane.model_formulas import regroup_parts

    raw = json.loads((Path(ROOT) / "benchmarks/results/control_plane_units_idle-2026-11-29.json").read_text())
    units = Units(raw)
    waits, last = (regroup_parts(units, "tree", 16, 1, decider_last=flag) for flag in (False, True))
    assert last[0] == pytest.approx(units.rtt)
    assert waits[0] == pytest.approx(last_entry("tree", 15) + units.rtt)
    assert waits[1:] == last[1:]
