"""torch.compile and overlap, on 2 Gloo ranks: a compiled module's backward is one autograd node, so
without help every gradient arrives at its end. phalanx DDP names itself where Dynamo looks for the
DDP in charge, so Dynamo's DDPOptimizer splits the graph at bucket boundaries (as for torch DDP): the
first bucket is launched while compiled backward work is still ahead, and the result equals eager DDP.
The "aot_eager" backend keeps compilation short and still makes each graph's backward one node."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.testing import run_ranks

WIDTH, DEPTH = 256, 6  # 6 x 0.5 MiB of float64 weights: a few 1 MiB buckets, so a few graphs


def _net() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).double()


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)


def _compiled_nodes(root) -> list:
    """The backward nodes of compiled graphs in the autograd graph below `root`."""
    found, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _train(model, ddp, rank: int, steps: int = 3) -> dict:
    """Train `model` (phalanx DDP `ddp` inside); per step, whether bucket 0 was launched before the last
    compiled backward node started."""
    events: list[str] = []
    launch = ddp._reducer.exchange.launch

    def noting_launch(bucket):
        events.append(f"launch {bucket.index}")
        return launch(bucket)

    ddp._reducer.exchange.launch = noting_launch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    early, graphs = [], 0
    for step in range(steps):
        opt.zero_grad()
        loss = model(_batch(rank, step)).square().mean()
        nodes = _compiled_nodes(loss.grad_fn)
        graphs = max(graphs, len(nodes))
        for node in nodes:
            node.register_prehook(lambda grad_outputs: events.append("compiled backward"))
        events.clear()
        loss.backward()
        opt.step()
        if nodes:
            last_node = len(events) - 1 - events[::-1].index("compiled backward")
            early.append(events.index("launch 0") < last_node)
    return {"early": early, "graphs": graphs, "weights": torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])}


def _variants(rank: int) -> dict:
    out = {}
    eager = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=1)
    out["eager"] = _train(eager, eager, rank)
    inner = phalanx.DistributedDataParallel(torch.compile(_net(), backend="aot_eager"), bucket_cap_mb=1)
    out["ddp(compile)"] = _train(inner, inner, rank)
    ddp = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=1)
    out["compile(ddp)"] = _train(torch.compile(ddp, backend="aot_eager"), ddp, rank)
    # A cap under Dynamo's 1 MiB first bucket: DDPOptimizer would refuse it; phalanx then leaves it out.
    small = phalanx.DistributedDataParallel(torch.compile(nn.Linear(3, 2).double(), backend="aot_eager"),
                                            bucket_cap_mb=0.5)
    small(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    out["small_cap_grad"] = small.module.weight.grad.clone()
    return out


@pytest.fixture(scope="module")
def variants():
    return run_ranks(_variants, 2, timeout=300)


@pytest.mark.parametrize("variant", ["ddp(compile)", "compile(ddp)"])
def test_a_compiled_model_launches_its_first_bucket_while_backward_goes_on(variants, variant):
    for outcome in variants:
        assert outcome[variant]["graphs"] >= 2, "Dynamo's DDPOptimizer did not split the graph at bucket boundaries"
        assert all(outcome[variant]["early"]), outcome[variant]["early"]


@pytest.mark.parametrize("variant", ["ddp(compile)", "compile(ddp)"])
def test_a_compiled_model_trains_as_eager_ddp(variants, variant):
    for outcome in variants:
        torch.testing.assert_close(outcome[variant]["weights"], outcome["eager"]["weights"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(variants[0][variant]["weights"], variants[1][variant]["weights"], rtol=0, atol=0)


def test_a_bucket_cap_under_one_mib_still_trains_compiled(variants):
    torch.testing.assert_close(variants[0]["small_cap_grad"], variants[1]["small_cap_grad"], rtol=0, atol=0)
