"""The launcher's side of live recovery (launch/regroup.py KeptSurvivors): which losses it keeps in-process, what it
tells the run summary, and which nodes it waits for at the end, from the workers' progress records."""

from __future__ import annotations

from datetime import timedelta

from phalanx.diagnose.progress import Progress
from phalanx.launch.regroup import KeptSurvivors


def record(rank: int, *events: dict, state: str = "training", step: int = 5) -> Progress:
    return Progress(rank, 1000 + rank, state, 0.0, 1.0, 1.0, 2.0, step, 0, 1.0, -1, 0.0, 0.0, 0, 0.0, 0, -1, 0.0,
                    False, list(events))


LIVE, OFF = {"event": "recovery", "live": True}, {"event": "recovery", "live": False}


class _Node:
    def __init__(self, address: str, pid: int):
        self.addr, self.pid = address, pid

    def __str__(self) -> str:
        return f"node ({self.addr})"


def test_a_node_is_kept_only_when_every_running_worker_recovers(capsys):
    survivors = KeptSurvivors(2, [])
    survivors.local_world_size = 2
    assert not survivors.node_lost(_Node("10.0.0.3", 7), 6, {0: record(0, LIVE), 1: record(1)})
    assert "rank(s) [1] had not reached a global-batch loop" in survivors.why_not
    assert not survivors.node_lost(_Node("10.0.0.3", 7), 6, {0: record(0, LIVE), 1: record(1, OFF)})
    assert "rank(s) [1] cannot regroup in-process" in survivors.why_not
    assert survivors.node_lost(_Node("10.0.0.3", 7), 6, {0: record(0, LIVE), 1: record(1, LIVE)})
    assert survivors.ranks_lost() == 2
    assert "its ranks are lost, the 4 ranks left go on in-process" in capsys.readouterr().err


def test_too_few_left_is_not_kept():
    survivors = KeptSurvivors(5, [])
    survivors.local_world_size = 2
    assert not survivors.node_lost(_Node("10.0.0.3", 7), 6, {0: record(0, LIVE)})
    assert "4 rank(s) would be left, fewer than --min-world-size 5" in survivors.why_not


def test_a_new_attempt_starts_with_nobody_lost():
    """A regroup at the larger world (a node joined) or a restart: the losses of the attempt before do not count
    against the next one (the chaos run found a rank's loss refused after two nodes had come back)."""
    changes: list = []
    survivors = KeptSurvivors(2, changes)
    survivors.local_world_size = 2
    assert survivors.node_lost(_Node("10.0.0.2", 7), 6, {0: record(0, LIVE)})
    assert survivors.node_lost(_Node("10.0.0.3", 8), 6, {0: record(0, LIVE)})
    assert survivors.ranks_lost() == 4 and survivors.exit_barrier_size(3) == 1
    survivors.new_attempt()
    assert survivors.ranks_lost() == 0 and survivors.exit_barrier_size(3) == 3
    assert survivors.node_lost(_Node("10.0.0.3", 9), 6, {0: record(0, LIVE)})


def test_each_regroup_of_the_workers_is_a_change_of_the_summary():
    """The changes come from the workers' regroups, the same on every node; a rank of this node lost is named with
    its signal and timed to the next step."""
    changes: list = []
    survivors = KeptSurvivors(2, changes)
    survivors.local_world_size = 2
    first = {"event": "generation", "number": 1, "members": [0, 1, 2, 3], "lost": [4, 5], "seconds": 0.012,
             "redone": True, "step": 7, "at": 0.0}
    second = {"event": "generation", "number": 2, "members": [0, 2, 3], "lost": [1], "seconds": 0.004,
              "redone": False, "step": 9, "at": 0.0}
    assert survivors.node_lost(_Node("10.0.0.3", 7), 6, {0: record(0, LIVE), 1: record(1, LIVE)})
    survivors.tell_the_regroups({0: record(0, LIVE, first), 1: record(1, LIVE, first)})
    assert changes == [{"change": "rank(s) [4, 5] lost, kept in-process", "world": [6, 4], "step": 7, "seconds": None,
                        "regroup_seconds": 0.012, "redone": 7}]
    survivors._note(1, -9, 6, {0: None, 1: -9}, {0: record(0, LIVE, first), 1: record(1, LIVE, first)})
    survivors.tell_the_regroups({0: record(0, LIVE, first, second), 1: record(1, LIVE, first)})
    assert changes[-1]["change"] == "rank 1 lost (SIGKILL), kept in-process" and changes[-1]["world"] == [4, 3]
    assert changes[-1]["redone"] is None and len(changes) == 2
    survivors._time_the_change({0: record(0, LIVE, first, second, step=6)})
    assert changes[-1]["seconds"] is not None  # the next step came: the change is timed
    survivors.new_attempt()
    survivors.tell_the_regroups({0: record(0, LIVE)})  # a new attempt's workers have not regrouped: no change
    assert len(changes) == 2


def test_a_fixed_node_count_does_not_wait_for_nodes_its_workers_regrouped_without(capsys):
    survivors = KeptSurvivors(2, [])
    survivors.local_world_size = 2
    regrouped = {"event": "generation", "number": 1, "members": [0, 1, 2], "lost": [3, 4, 5], "seconds": 0.01,
                 "redone": False, "step": 3}
    records = {0: record(0, LIVE, regrouped, state="exited"), 1: record(1, LIVE, regrouped, state="exited")}
    assert survivors.exit_barrier_size(3, records) == 2  # node 1 keeps rank 2; node 2 (ranks 4, 5) is gone
    assert "node 2 is not waited for at the end: its ranks [4, 5] were lost" in capsys.readouterr().err
    assert survivors.exit_barrier_size(3, {0: record(0, LIVE)}) == 3  # no regroup: everyone is waited for


def test_a_node_lost_after_this_nodes_workers_finished_is_counted_not_regrouped_for():
    """The workers of this node are done (exited) when the lost node's heartbeats expire: the launcher must count it
    lost for the meeting at the end, not restart a finished group (a run then hung in the exit barrier)."""
    survivors = KeptSurvivors(2, [])
    survivors.local_world_size = 1
    assert survivors.node_lost(_Node("10.0.0.3", 7), 3, {1: record(1, LIVE, state="exited")})
    assert survivors.exit_barrier_size(3) == 2


class _Rendezvous:
    """An elastic rendezvous where one node waits to join."""

    round, current, previous = 1, [], []

    def lost(self):
        return []

    def waiting(self):
        return ["node 2 (10.0.0.3)"]


def test_workers_that_finish_while_asked_to_save_for_a_joining_node_end_the_run(capsys):
    """A node asks to join as the workers end their training: they were asked to save for it (SIGTERM), and exit
    having finished instead. The launcher must then let the run end, not wait for a save that will never come."""
    from phalanx.launch.regroup import Regroup

    regroup = Regroup(_Rendezvous(), grace_period=30.0, changes=[])
    running = {0: record(0, LIVE), 1: record(1, LIVE)}
    assert regroup.poll([], lambda: running) is None  # pids [] : nobody to signal in this test
    assert regroup.growing_since is not None
    assert "node(s) waiting to join" in capsys.readouterr().err
    finished = {0: record(0, LIVE, state="exited"), 1: record(1, LIVE, state="exited")}
    assert regroup.poll([], lambda: finished) is None
    assert regroup.growing_since is None  # the agent then reads the workers' exit: the run succeeded


JOINS = {"event": "joins", "taken": True, "why": ""}


class _JoiningRendezvous(_Rendezvous):
    """A node waits; the first launcher's answer (decide_join) binds the others."""

    def __init__(self, decided=None):
        self.decided, self.asked = decided, []

    def decide_join(self, attempt):
        self.asked.append(attempt)
        if self.decided is None:
            self.decided = f"live:{attempt}" if attempt else "restart"
        return self.decided[len("live:"):] if self.decided.startswith("live:") else None

    def join_decided(self):
        return bool(self.decided) and self.decided.startswith("live:")


def test_a_node_joins_the_workers_in_progress_only_when_every_one_takes_joiners_in(capsys, monkeypatch):
    """Workers that said they take joiners in (live recovery, no sharded optimizer): the waiting node joins them
    in-process ("join", no SIGTERM). One worker that cannot (a sharded optimizer refused, or not yet in its loop): the
    launchers answer "restart", the agreed save and the larger round as before. A launcher whose workers could not
    still follows another's decision to take the node in."""
    from phalanx.launch.regroup import Regroup

    monkeypatch.setenv("PHALANX_STORE_ATTEMPT", "round-1")
    rendezvous = _JoiningRendezvous()
    regroup = Regroup(rendezvous, grace_period=30.0, changes=[], survivors=KeptSurvivors(2, []))
    able = {0: record(0, LIVE, JOINS), 1: record(1, LIVE, JOINS)}
    assert regroup.poll([], lambda: able) == "join" and rendezvous.asked == ["round-1"]
    assert regroup.growing_since is None and "take them in at a step boundary, in-process" in capsys.readouterr().err

    refused = {0: record(0, LIVE, JOINS), 1: record(1, LIVE, {"event": "joins", "taken": False,
                                                              "why": "shard='optimizer': not handed over"})}
    for workers in (refused, {0: record(0, LIVE, JOINS), 1: record(1, LIVE)}, {0: record(0, LIVE, JOINS),
                                                                                1: record(1)}):
        rendezvous = _JoiningRendezvous()
        regroup = Regroup(rendezvous, grace_period=30.0, changes=[], survivors=KeptSurvivors(2, []))
        assert regroup.poll([], lambda w=workers: w) is None and rendezvous.asked == [None]
        assert regroup.growing_since is not None  # asked to save at an agreed step, then the larger round
    assert "regrouping at the larger world (rank(s) [1] had not reached a global-batch loop)" in capsys.readouterr().err

    follower = Regroup(_JoiningRendezvous(decided="live:round-1"), grace_period=30.0, changes=[],
                       survivors=KeptSurvivors(2, []))
    assert follower.poll([], lambda: {0: record(0, LIVE)}) == "join"


def test_a_join_is_a_change_of_the_summary_with_the_bytes_healed():
    from phalanx.launch.goodput import Invocation, _as_dict, summary_lines

    changes: list = []
    survivors = KeptSurvivors(2, changes)
    joined = {"event": "generation", "number": 2, "members": [0, 1, 3], "lost": [], "joined": [3], "seconds": 0.031,
              "healed": [20_000_000, 0.9], "redone": False, "step": 40, "at": 0.0}
    survivors.tell_the_regroups({0: record(0, LIVE, JOINS, joined)})
    assert changes == [{"change": "rank(s) [3] joined in-process", "world": [2, 3], "step": 40, "seconds": None,
                        "regroup_seconds": 0.031, "healed": [20_000_000, 0.9], "redone": None}]
    now = Invocation()
    now.changes = changes
    text = "\n".join(summary_lines(now, [_as_dict(now)], None))
    assert ("rank(s) [3] joined in-process: world size 2 -> 3, taken in after step 40, regrouped in 0.031 s, 20.0 MB "
            "of state healed in 0.90 s, no step redone") in text, text


def test_a_join_round_that_finds_the_run_closed_lets_this_nodes_workers_finish():
    """The launchers decided to take a node in as the run ended: another node's workers finished and its launcher
    closed the rendezvous. The round then raises RunEndedError (not a lost store), and this launcher stops meeting
    rounds: its workers finish too, and their exit decides the run (seen in the chaos run: exit 1 on a run that had
    finished)."""
    import pytest
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from phalanx.errors import RunEndedError
    from phalanx.launch.regroup import Regroup
    from phalanx.world.meeting.membership import ElasticRendezvous

    class _Closed:
        def next_rendezvous(self):
            raise RendezvousClosedError()

    handler = object.__new__(ElasticRendezvous)
    handler._inner, handler.master_addr, handler.master_port = _Closed(), "10.0.0.1", 29500
    handler.timeout = timedelta(seconds=60)  # what __init__ sets: the round's waiting line counts down from it
    with pytest.raises(RunEndedError, match="ended before this node met the others"):
        handler.next_rendezvous()
    regroup = Regroup(_JoiningRendezvous(decided="live:round-1"), grace_period=30.0, changes=[],
                      survivors=KeptSurvivors(2, []))
    workers = {0: record(0, LIVE, JOINS), 1: record(1, LIVE, JOINS)}
    assert regroup.poll([], lambda: workers) == "join"
    regroup.run_ended = True  # what the agent sets when that round raised RunEndedError
    assert regroup.poll([], lambda: workers) is None and regroup.growing_since is None
