"""The ranks' agreement on a stop, world size 2 (run_ranks): a request that reaches one rank stops both at the
same step after one save; a rank that left the loop is named in bounded time, never waited for forever."""

import time

import pytest
import torch

import phalanx as px
from phalanx.errors import PeerFailedError, RanksTimedOutError
from phalanx.testing import run_ranks
from phalanx.world import stop


def _stop_asked_of_one_rank(rank, directory, asked_at):
    torch.manual_seed(0)
    model = px.DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": optimizer}
    checkpointer = px.Checkpointer(directory, every=1000)
    for step in range(1, 500):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.005)
        if rank == 1 and step == asked_at:
            stop.request("SIGUSR1")  # what the signal handler does
        try:
            checkpointer.step(state)
        except px.RunStopped as stopped:
            return {"step": stopped.step, "path": str(stopped.path), "reason": stopped.reason,
                    "code": stopped.code, "every": checkpointer._agreement.every}
    return None


@pytest.mark.smoke
def test_a_request_to_one_rank_stops_both_at_the_same_step(tmp_path):
    """World size 2: rank 1 alone is asked at step 30; agreements every ~50 ms."""
    results = run_ranks(_stop_asked_of_one_rank, 2, (str(tmp_path), 30), env={"PHALANX_STOP_INTERVAL": "0.05"})
    assert None not in results, results
    assert results[0] == results[1], results  # same step, same checkpoint, and rank 0 learnt why
    outcome = results[0]
    assert outcome["code"] == 75 and outcome["reason"] == "SIGUSR1"
    assert 30 < outcome["step"] <= 30 + 2 * outcome["every"] + 1, outcome
    assert outcome["path"].endswith("ckpt-00000001.pt")
    # Saved in the background, and committed before the ranks left: listed in the manifest, restorable.
    restored = {"model": torch.nn.Linear(4, 2), "optimizer": None}
    restored["optimizer"] = torch.optim.SGD(restored["model"].parameters(), lr=0.1)
    checkpointer = px.Checkpointer(tmp_path)
    assert [p.name for p in checkpointer.checkpoints()] == ["ckpt-00000001.pt"]
    assert checkpointer.restore(restored) and checkpointer.steps == outcome["step"]


def _one_rank_leaves(rank, directory):
    checkpointer = px.Checkpointer(directory, timeout=5)
    steps = 3 if rank == 1 else 50
    started = time.monotonic()
    try:
        for _ in range(steps):
            checkpointer.step({})
            time.sleep(0.01)
    except (PeerFailedError, RanksTimedOutError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    return None


def test_a_rank_that_left_is_not_waited_for_forever(tmp_path):
    """World size 2: rank 1 calls step() 3 times and leaves; rank 0's step() fails within its timeout."""
    results = run_ranks(_one_rank_leaves, 2, (str(tmp_path),), env={"PHALANX_STOP_INTERVAL": "0"}, timeout=120)
    assert results[1] is None
    kind, message, took = results[0]
    assert kind in ("PeerFailedError", "RanksTimedOutError") and took < 30, results[0]
    assert "checkpointer.step() once per step" in message, message


def _agreed_answer(rank, asked):
    if asked and rank == 1:
        stop.request("SIGTERM")
    answers = [px.stop_requested(agree=True) for _ in range(3)]
    return answers, px.stop_requested()


def test_stop_requested_with_agree_answers_the_same_on_every_rank():
    """World size 2: asked of rank 1 only, both ranks see True; asked of none, both see False."""
    assert run_ranks(_agreed_answer, 2, (True,)) == [([True] * 3, True)] * 2
    assert run_ranks(_agreed_answer, 2, (False,)) == [([False] * 3, False)] * 2
