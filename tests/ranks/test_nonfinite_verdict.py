"""How every rank learns another rank's non-finite gradient (engine/replicas/nonfinite.py) without a collective of
the check's own: over shared memory a posted bucket's summed tag carries it, a split bucket's stamps (shm/posted.py);
over Gloo the summed tag.

World size 3, on shared memory and on Gloo (PHALANX_SHM=0): rank 1, neither the first rank nor the last, makes a NaN
at step 3 of 4 in a bucket that is not the first: in a split bucket's chunk that rank 1 sums itself (its verdict is
known only after its tag left), in that bucket's chunk rank 0 sums (found by rank 1's copy-in), and in a posted
bucket. Every rank names rank 1, step 3 and the parameter before any applies the step; with on_nonfinite="skip"
every rank skips step 3 alone (a verdict read stale would skip step 4 too, or miss step 3).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.shm.reduce import chunk_bounds
from phalanx.shm.segment import SHM_DIR
from phalanx.testing import run_ranks

NAN_AT, STEPS, CULPRIT = 3, 4, 1
# 2.weight (64 x 512) is a split bucket of its own and 0.weight shares a posted one with 0.bias (bucket_cap_mb=0.1)
SPLIT_OWN = chunk_bounds(64 * 512, 4, 3)[CULPRIT]  # the first element of the chunk rank 1 sums
CASES = [("2.weight", SPLIT_OWN, "raise"), ("2.weight", 0, "raise"), ("0.weight", 5, "raise"),
         ("2.weight", SPLIT_OWN, "skip"), ("0.weight", 5, "skip"), (None, 0, "raise")]


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 256), torch.nn.Tanh(), torch.nn.Linear(256, 2))


def _run(rank: int, transport: str, parameter: str | None, element: int, mode: str) -> dict:
    """STEPS steps of SGD; rank CULPRIT's gradient of `parameter` gets a NaN at `element` at step NAN_AT."""
    if transport == "gloo":
        os.environ["PHALANX_SHM"] = "0"
    try:
        net = _net()
        model = px.DistributedDataParallel(net, bucket_cap_mb=0.1, on_nonfinite=mode)
    finally:
        os.environ.pop("PHALANX_SHM", None)
    params = dict(net.named_parameters())
    step = [0]

    def poison(grad):
        if step[0] != NAN_AT:
            return grad
        grad = grad.clone()
        grad.view(-1)[element] = float("nan")
        return grad
    if rank == CULPRIT and parameter is not None:
        params[parameter].register_hook(poison)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    out = {"error": None, "changed": [], "collectives": 0}
    for step[0] in range(1, STEPS + 1):
        optimizer.zero_grad()
        F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 2)).backward()
        out["collectives"] += model._audit.check._verdicts[-1].work is not None
        before = [p.detach().clone() for p in net.parameters()]
        try:
            optimizer.step()
        except px.NonFiniteGradientError as error:
            out["error"] = {"ranks": error.ranks, "step": error.step, "parameter": error.parameter}
            break
        out["changed"].append(not all(torch.equal(a, b) for a, b in zip(before, net.parameters())))
    exchange = model._reducer.exchange
    names = {id(p): name for name, p in params.items()}
    out["buckets"] = {names[id(p)]: (b.index, exchange.modes[b.index] if hasattr(exchange, "modes") else "gloo")
                      for b in model._reducer.buckets for p in b.params}
    out["params"] = [p.detach().clone() for p in net.parameters()]
    return out


def _three_ranks(rank):
    return {(transport, *case): _run(rank, transport, *case) for transport in ("shm", "gloo") for case in CASES}


@pytest.fixture(scope="module")
def three():
    if not os.path.isdir(SHM_DIR):
        pytest.skip("needs /dev/shm")
    return run_ranks(_three_ranks, 3, timeout=180)  # a verdict some ranks misread hangs the others


def test_the_buckets_are_the_ones_the_cases_mean(three):
    """World size 3: over shared memory 2.weight is a split bucket and 0.weight a posted one, neither the first."""
    buckets = three[0][("shm", None, 0, "raise")]["buckets"]
    assert buckets["2.weight"][1] == "split" and buckets["0.weight"][1] == "posted", buckets
    assert buckets["2.weight"][0] > 0 and buckets["0.weight"][0] > 0, buckets


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("parameter,element", [("2.weight", SPLIT_OWN), ("2.weight", 0), ("0.weight", 5)])
def test_every_rank_names_the_rank_step_and_parameter_before_any_applies_it(three, transport, parameter, element):
    """World size 3: every rank raises at step 3 naming rank 1 and the parameter; steps 1-2 were applied, step 3
    nowhere; the verdicts took no collective of the check's own."""
    for r in three:
        seen = r[(transport, parameter, element, "raise")]
        assert seen["error"] == {"ranks": [CULPRIT], "step": NAN_AT, "parameter": parameter}, seen["error"]
        assert seen["changed"] == [True, True] and seen["collectives"] == 0, seen


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("parameter,element", [("2.weight", SPLIT_OWN), ("0.weight", 5)])
def test_skip_skips_that_step_alone_on_every_rank(three, transport, parameter, element):
    """World size 3, on_nonfinite="skip": step 3 changed no rank's parameters, steps 1, 2 and 4 changed every
    rank's; the replicas end equal and finite."""
    runs = [r[(transport, parameter, element, "skip")] for r in three]
    for seen in runs:
        assert seen["error"] is None and seen["changed"] == [True, True, False, True], seen
        assert all(torch.isfinite(p).all() for p in seen["params"])
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0]["params"], r["params"]))


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_healthy_run_reports_nothing(three, transport):
    """World size 3: no NaN anywhere: every step applied on every rank, no collective of the check's own."""
    for r in three:
        seen = r[(transport, None, 0, "raise")]
        assert seen["error"] is None and seen["changed"] == [True] * STEPS and seen["collectives"] == 0, seen
