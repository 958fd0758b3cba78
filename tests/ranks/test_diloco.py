"""across_hosts=px.DiLoCo(...) on 2 emulated hosts x 2 ranks (docs/diloco.md), all in one spawn of 4 ranks.

Hosts are emulated by each rank's GROUP_RANK (the launcher's node rank, what world/topology.py reads), set
before each model is built. The cases: every=1 with outer lr 1 and no momentum is today's exact DDP; an outer
step equals a one-process reference that simulates both hosts' inner runs and the Nesterov outer step; a save
in mid-period resumes bitwise; on one host the mode is exact DDP and says so once; bad arguments are typed.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

import phalanx as px
from phalanx.diagnose import step_clock
from phalanx.testing import run_ranks

LOCAL = 2  # ranks per emulated host


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 1, generator=g, dtype=torch.float64)


def _train(model, optimizer, rank: int, start: int, end: int) -> None:
    for step in range(start, end):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _reference(rank: int, world: int, every: int, steps: int, config: px.DiLoCo) -> list[torch.Tensor]:
    """One process: each host's inner run (SGD with momentum on the mean of its ranks' gradients), and every
    `every` steps the mean pseudo-gradient into a Nesterov SGD on the synced parameters. This rank's host's."""
    hosts = [_net() for _ in range(world // LOCAL)]
    inner = [torch.optim.SGD(h.parameters(), lr=0.1, momentum=0.9) for h in hosts]
    synced = [p.detach().clone() for p in hosts[0].parameters()]
    outer = torch.optim.SGD(synced, lr=config.outer_lr, momentum=config.momentum, nesterov=config.nesterov)
    for step in range(steps):
        for h, (model, optimizer) in enumerate(zip(hosts, inner)):
            optimizer.zero_grad()
            for r in range(h * LOCAL, (h + 1) * LOCAL):
                x, y = _batch(r, step)
                (torch.nn.functional.mse_loss(model(x), y) / LOCAL).backward()
            optimizer.step()
        if (step + 1) % every == 0:
            with torch.no_grad():
                for i, s in enumerate(synced):
                    s.grad = sum(s - list(m.parameters())[i] for m in hosts) / len(hosts)
                outer.step()
                for model in hosts:
                    for p, s in zip(model.parameters(), synced):
                        p.copy_(s)
    return _params(hosts[rank // LOCAL])


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _cases(rank: int, world: int, directory: str) -> dict:
    os.environ["GROUP_RANK"] = str(rank // LOCAL)  # 2 hosts of 2 ranks
    out = {}
    net = _net()

    # every=1, outer lr 1, momentum 0, inner SGD: the synchronous step, up to rounding.
    exact = px.DistributedDataParallel(copy.deepcopy(net))
    _train(exact, torch.optim.SGD(exact.parameters(), lr=0.1), rank, 0, 3)
    h1 = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=px.DiLoCo(every=1, outer_lr=1.0, momentum=0.0))
    _train(h1, torch.optim.SGD(h1.parameters(), lr=0.1), rank, 0, 3)
    out["h1_diff"] = _max_diff(_params(exact), _params(h1))
    out["h1_moved"] = _max_diff(_params(net), _params(h1))
    out["h1_host_group"] = h1.process_group.size()
    out["exchanges"] = (type(exact._reducer.exchange).__name__, type(h1._reducer.exchange).__name__)

    # Two outer steps and one inner step more (H=2, Nesterov 0.7 / 0.9): the one-process reference.
    config = px.DiLoCo(every=2)
    clock = step_clock.outer_totals()
    model = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=config, audit_every=1)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rank, 0, 5)
    out["ref_diff"] = _max_diff(_params(model), _reference(rank, world, 2, 5, config))
    out["outer_steps"] = model.outer_step.outer_steps
    out["bytes"] = model.outer_step.bytes_across_hosts
    out["clock"] = tuple(b - a for a, b in zip(clock, step_clock.outer_totals()))  # what StepLog's records count
    out["after_ref"] = _params(model)

    # A save in mid-period (step 5 of H=3) resumes bitwise: each host's own parameters and momentum come back.
    def fresh():
        m = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=px.DiLoCo(every=3))
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return m, o, {"model": m, "optimizer": o, "outer": m.outer_step, "step": 0}

    m, o, state = fresh()
    checkpointer = px.Checkpointer(directory)
    _train(m, o, rank, 0, 5)
    state["step"] = 5
    checkpointer.save(state)
    out["at_save"] = _params(m)
    _train(m, o, rank, 5, 8)
    checkpointer.wait()
    uninterrupted = _params(m)
    m, o, state = fresh()
    out["restored"] = px.Checkpointer(directory).restore(state)
    _train(m, o, rank, state["step"], 8)
    out["resume_equal"] = all(torch.equal(a, b) for a, b in zip(uninterrupted, _params(m)))
    out["resumed"] = _params(m)

    # Bad arguments: typed errors on every rank, before any collective of the mode.
    for name, kwargs in (("not_diloco", {"across_hosts": "diloco"}),
                         ("sharded", {"across_hosts": px.DiLoCo(every=2), "shard": "optimizer"})):
        try:
            px.DistributedDataParallel(copy.deepcopy(net), **kwargs)
            out[name] = None
        except Exception as exc:  # the type is what the test checks
            out[name] = (type(exc).__name__, str(exc))

    # One host: exact DDP, bitwise, and one log line that says so.
    os.environ["GROUP_RANK"] = "0"
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    px.logger.addHandler(handler)
    try:
        one = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=px.DiLoCo(every=2))
    finally:
        px.logger.removeHandler(handler)
    plain = px.DistributedDataParallel(copy.deepcopy(net))
    for model in (one, plain):
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rank, 0, 3)
    out["one_host_equal"] = all(torch.equal(a, b) for a, b in zip(_params(one), _params(plain)))
    out["one_host_outer"] = type(one.outer_step).__name__
    out["one_host_lines"] = [line for line in lines if "across_hosts" in line]

    # The mid-period checkpoint of 2 hosts, restored on one host: every rank goes on from host 0's model.
    one = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=px.DiLoCo(every=3))
    state = {"model": one, "optimizer": torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9),
             "outer": one.outer_step, "step": 0}
    out["one_host_restored"] = px.Checkpointer(directory).restore(state) and state["step"] == 5
    out["one_host_resumed"] = _params(one)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_cases, 4, (4, str(tmp_path_factory.mktemp("diloco"))), timeout=120)


def test_every_step_with_plain_outer_sgd_is_exact_ddp(results):
    """World size 4 (2 hosts x 2): every=1, outer_lr=1, momentum=0 under an inner SGD equals across_hosts=None."""
    for out in results:
        assert out["h1_moved"] > 1e-3
        assert out["h1_diff"] < 1e-12
        assert out["h1_host_group"] == LOCAL  # the gradient exchange stays inside the host
        # Where the exact step takes the two-level exchange (shared memory works), DiLoCo's host takes shared memory.
        assert out["exchanges"] in {("HierarchicalExchange", "ShmExchange"), ("AllReduceExchange", "AllReduceExchange")}


def test_outer_step_equals_one_process_reference(results):
    """World size 4 (2 hosts x 2): 5 steps at every=2 (two Nesterov outer steps) equal the simulated hosts."""
    for out in results:
        assert out["outer_steps"] == 2
        assert out["ref_diff"] < 1e-12
        assert out["bytes"] > 0
        assert out["clock"] == (2, out["bytes"])
    # Inside a host the replicas are bitwise equal; across hosts they differ in mid-period (step 5).
    assert all(torch.equal(a, b) for a, b in zip(results[0]["after_ref"], results[1]["after_ref"]))
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["after_ref"], results[2]["after_ref"]))


def test_resume_in_mid_period_is_bitwise(results):
    """World size 4 (2 hosts x 2): saved at step 5 of every=3 (background save), restored, trained to step 8."""
    for out in results:
        assert out["restored"]
        assert out["resume_equal"]
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["resumed"], results[2]["resumed"]))


def test_bad_arguments_are_typed(results):
    """World size 4: across_hosts that is no DiLoCo, and a sharded level, raise on every rank."""
    for out in results:
        kind, message = out["not_diloco"]
        assert kind == "AcrossHostsError" and "across_hosts='diloco'" in message and "px.DiLoCo" in message
        kind, message = out["sharded"]
        assert kind == "ShardingError" and "shard='optimizer'" in message


def test_one_host_is_exact_ddp_and_says_so(results):
    """World size 4 on one host: across_hosts=DiLoCo(every=2) is bitwise across_hosts=None, and says so once."""
    for out in results:
        assert out["one_host_equal"]
        assert out["one_host_outer"] == "OneHost"
        assert len(out["one_host_lines"]) == 1  # logged at INFO: printed by the main rank only
        assert "one host: exact DDP" in out["one_host_lines"][0]


def test_resume_at_another_host_count_goes_on_from_host_0(results):
    """World size 4: the checkpoint of 2 hosts x 2 saved in mid-period, restored on 1 host x 4."""
    for out in results:
        assert out["one_host_restored"]
        assert all(torch.equal(a, b) for a, b in zip(out["one_host_resumed"], results[0]["at_save"]))
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["at_save"], results[2]["at_save"]))


def _live_cases(rank: int) -> dict:
    os.environ["GROUP_RANK"] = str(rank)  # 2 hosts of 1 rank
    out = {}
    try:
        px.DistributedDataParallel(_net(), across_hosts=px.DiLoCo(every=4, delay=1))
        out["delay"] = None
    except Exception as exc:  # the type is what the test checks
        out["delay"] = (type(exc).__name__, str(exc))
    model = px.DistributedDataParallel(_net(), across_hosts=px.DiLoCo(every=4, fragments=2))
    out["fragments"] = (type(model.outer_step).__name__, model.outer_step.hosts, model.outer_step.fragments)
    return out


def test_live_recovery_refuses_a_delay_and_takes_fragments():
    """World size 2 (2 hosts x 1) under live recovery: delay>0 is refused (an average on its way when a host is
    lost could be merged on some hosts only); fragments with delay=0 follow live recovery."""
    for out in run_ranks(_live_cases, 2, min_world_size=2, timeout=120):
        kind, message = out["delay"]
        assert kind == "AcrossHostsError" and "delay=1 with live recovery on" in message and "delay=0" in message
        assert out["fragments"] == ("OuterStep", 2, [[0], [1, 2, 3]])
