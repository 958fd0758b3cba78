"""What a launcher says while it waits for the other nodes, and the fixed nodes' roll call, on an in-process store."""

import re

import pytest
import torch.distributed as dist

from phalanx import DuplicateNodeRankError
from phalanx.errors import RendezvousTimeoutError
from phalanx.world.meeting import roll_call, waiting
from phalanx.world.meeting.roll_call import Launcher, check_duplicates, claim, gather
from phalanx.world.meeting.waiting import Ticker, elastic_line, fixed_line, rank_ranges, store_line

NODE_0 = Launcher("node-a", "10.0.0.1", 101)
NODE_1 = Launcher("node-b", "10.0.0.2", 202)
ALSO_1 = Launcher("node-c", "10.0.0.3", 303)


def test_missing_node_ranks_read_as_ranges_and_a_long_list_is_counted():
    assert rank_ranges([1]) == "1"
    assert rank_ranges([5, 1, 2, 3, 7]) == "1-3, 5, 7"
    assert rank_ranges(range(0, 100, 2), limit=2) == "0, 2 and 48 more"


def test_the_fixed_line_names_the_count_the_missing_the_store_and_the_time_left():
    assert fixed_line(2, 4, [1, 3], "10.0.0.1:29500", 589.6, 600) == (
        "waiting for the other nodes: 2 of 4 in, missing node ranks 1, 3; store at 10.0.0.1:29500; "
        "590 s left of --rdzv-timeout 600 s.")


def test_the_store_line_names_whose_store_and_where():
    assert store_line("node 0", "10.0.0.1:29500", "this is node 1 of --nnodes 2", 42.2, 60) == (
        "waiting for node 0: its store at 10.0.0.1:29500 does not answer yet (this is node 1 of --nnodes 2); "
        "42 s left of --rdzv-timeout 60 s.")


def test_the_elastic_lines_tell_a_round_filling_from_a_run_to_join():
    assert elastic_line(0, 1, 0, False, 2, 3, "h:1", 50, 60) == (
        "waiting for the other nodes: 1 node(s) in round 0, which starts with 2 (--nnodes 2:3); store at h:1; "
        "50 s left of --rdzv-timeout 60 s.")
    assert elastic_line(4, 2, 1, True, 1, 3, "h:1", 8, 60) == (
        "waiting to join the run in progress: 2 node(s) in its round 4 (--nnodes 1:3), 1 waiting to join; "
        "store at h:1; 8 s left of --rdzv-timeout 60 s.")
    full = elastic_line(4, 3, 0, True, 1, 3, "h:1", 8, 60)  # torch sets no deadline on a node waiting for a place
    assert "it is full (3 node(s) in its round 4, --nnodes 1:3)" in full and "left" not in full


def test_the_ticker_is_due_once_a_period_and_not_at_the_start():
    now = [100.0]
    ticker = Ticker(60, every=10, clock=lambda: now[0])
    assert not ticker.due()
    now[0] = 110.0
    assert ticker.due() and not ticker.due()
    now[0] = 119.0
    assert not ticker.due()
    now[0] = 121.0
    assert ticker.due()
    assert ticker.left() == pytest.approx(39.0)


def test_the_period_is_ten_seconds():
    assert waiting.PROGRESS_EVERY == 10.0


# -- the roll call ------------------------------------------------------------------------------------------------


def test_a_node_goes_on_once_every_node_rank_is_claimed():
    store = dist.HashStore()
    claim(store, "run", 0, 1, 2, NODE_1)
    gather(store, "run", 0, 0, 2, NODE_0, timeout=5, where="10.0.0.1:29500")  # returns at once


def test_a_node_rank_claimed_twice_fails_the_second_and_the_first_with_both_named():
    store = dist.HashStore()
    claim(store, "run", 0, 1, 3, NODE_1)
    with pytest.raises(DuplicateNodeRankError) as second:
        claim(store, "run", 0, 1, 3, ALSO_1)
    with pytest.raises(DuplicateNodeRankError) as first:  # what the first one's poll reads
        check_duplicates(store, "run", 0, 3)
    for raised in (second.value, first.value):
        assert raised.node_rank == 1
        assert raised.launchers == ["node-b (10.0.0.2, pid 202)", "node-c (10.0.0.3, pid 303)"]
        assert str(raised).startswith("node rank 1 was given to two launchers: seen node-b (10.0.0.2, pid 202) and "
                                      "node-c (10.0.0.3, pid 303)")
        assert "--node-rank" in str(raised)


def test_the_wait_names_the_missing_node_ranks_every_period_then_times_out(monkeypatch, capsys):
    monkeypatch.setattr(roll_call, "Ticker", lambda timeout: Ticker(timeout, every=0.2))
    monkeypatch.setattr(roll_call, "POLL", 0.05)
    store = dist.HashStore()
    claim(store, "run", 0, 2, 4, Launcher("node-c", "10.0.0.3", 3))
    with pytest.raises(RendezvousTimeoutError) as raised:
        gather(store, "run", 0, 0, 4, NODE_0, timeout=0.7, where="10.0.0.1:29500")
    assert raised.value.missing_ranks == [1, 3]
    assert "2 of 4 within --rdzv-timeout 0.7 s, missing node rank(s) 1, 3" in str(raised.value)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2
    for line in lines:
        assert re.fullmatch(r"phalanx run: waiting for the other nodes: 2 of 4 in, missing node ranks 1, 3; "
                            r"store at 10\.0\.0\.1:29500; \d s left of --rdzv-timeout 0\.7 s\.", line), line


def test_each_round_is_a_roll_call_of_its_own():
    """A restart (--max-restarts) meets again: last round's claims neither count nor clash."""
    store = dist.HashStore()
    claim(store, "run", 0, 1, 2, NODE_1)
    gather(store, "run", 0, 0, 2, NODE_0, timeout=5, where="w")
    with pytest.raises(RendezvousTimeoutError, match="missing node rank"):
        gather(store, "run", 1, 0, 2, NODE_0, timeout=0.3, where="w")


def test_a_late_launcher_with_a_node_rank_taken_ends_alone():
    """The nodes met, and restarted since: a third launcher claiming node rank 1 fails, their next round does not."""
    store = dist.HashStore()
    claim(store, "run", 0, 1, 2, NODE_1)
    gather(store, "run", 0, 0, 2, NODE_0, timeout=5, where="w")
    claim(store, "run", 1, 1, 2, NODE_1)
    with pytest.raises(DuplicateNodeRankError, match="node rank 1 was given to two launchers"):
        claim(store, "run", 0, 1, 2, ALSO_1)  # a launcher starts in round 0
    gather(store, "run", 1, 0, 2, NODE_0, timeout=5, where="w")


def test_a_launcher_reads_back_as_it_was_written():
    assert Launcher.decode(NODE_0.encode()) == NODE_0
    assert str(NODE_0) == "node-a (10.0.0.1, pid 101)"
