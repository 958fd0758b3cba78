"""Uneven inputs with join(), on 3 ranks holding 3, 4 and 5 batches.

With divide_by_initial_world_size=False each step averages over the ranks still training, which
equals one process trained on the concatenation of those ranks' batches. With the default (divide
by the initial world size) phalanx matches torch DDP's join, also when called through torch's
generic `Join([model])`. Afterwards replicas are identical and ordinary training continues.
"""


import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join

import phalanx
from phalanx.testing import run_ranks
from tests.helpers.ddp_cases import flat_params, replicas_identical

WORLD = 3


def _batches(rank: int) -> int:
    return 3 + rank


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)


def _model(with_batchnorm: bool) -> nn.Module:
    torch.manual_seed(3)
    # Wide enough for one bucket of few large gradients, which one host exchanges split (shm.py).
    layers = [nn.Linear(6, 512)] + ([nn.BatchNorm1d(512)] if with_batchnorm else []) + [
        nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 2)]
    return nn.Sequential(*layers).double()


def _train(model, rank: int, context) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with context(model):
        for step in range(_batches(rank)):
            opt.zero_grad()
            x, y = _data(step, rank)
            F.mse_loss(model(x), y).backward()
            opt.step()


def _reference() -> nn.Module:
    """One process: step s trains on the batches of the ranks that still have a batch s."""
    model = _model(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(_batches(WORLD - 1)):
        xs, ys = zip(*(_data(step, r) for r in range(WORLD) if step < _batches(r)))
        opt.zero_grad()
        F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model


def _join_cases(rank: int) -> dict:
    out = {}
    model = phalanx.DistributedDataParallel(_model(False))
    _train(model, rank, lambda m: m.join(divide_by_initial_world_size=False))
    out["active_mean_vs_reference"] = (flat_params(model.module) - flat_params(_reference())).abs().max().item()
    out["identical_after_join"] = replicas_identical(model.module)
    # Even training goes on normally after the join context (step counters and checks agree again).
    before = flat_params(model.module)
    F.mse_loss(model(torch.ones(2, 6, dtype=torch.float64) * rank), torch.zeros(2, 2, dtype=torch.float64)).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    out["trains_after_join"] = (flat_params(model.module) - before).abs().max().item() > 0
    out["identical_after_more"] = replicas_identical(model.module)

    results = {}
    for name, wrapper, context in [
        ("phalanx_join", phalanx.DistributedDataParallel, lambda m: m.join()),
        ("phalanx_generic_join", phalanx.DistributedDataParallel, lambda m: Join([m])),
        ("torch_join", torch.nn.parallel.DistributedDataParallel, lambda m: m.join()),
    ]:
        model = wrapper(_model(True))
        _train(model, rank, context)
        buffers = [b.double().reshape(-1) for b in model.module.buffers()]
        results[name] = torch.cat([flat_params(model.module)] + buffers)
        out[f"{name}_identical"] = replicas_identical(model.module)
    out["phalanx_vs_torch"] = (results["phalanx_join"] - results["torch_join"]).abs().max().item()
    out["generic_vs_method"] = (results["phalanx_generic_join"] - results["phalanx_join"]).abs().max().item()
    initial = flat_params(_model(True))
    out["moved"] = (results["phalanx_join"][:len(initial)] - initial).abs().max().item()
    return out


@pytest.fixture(scope="module")
def joined():
    return run_ranks(_join_cases, WORLD, timeout=120)


@pytest.mark.smoke
def test_join_averaging_over_active_ranks_equals_single_process(joined):
    """World size 3: the ranks hold 3, 4 and 5 batches."""
    for rank, outcome in enumerate(joined):
        assert outcome["active_mean_vs_reference"] < 1e-10, f"rank {rank}: {outcome['active_mean_vs_reference']:.3g}"
        assert outcome["identical_after_join"]


def test_training_continues_normally_after_join(joined):
    """World size 3."""
    for outcome in joined:
        assert outcome["trains_after_join"] and outcome["identical_after_more"]


def test_join_matches_torch_ddp_join_with_buffers(joined):
    """World size 3."""
    for rank, outcome in enumerate(joined):
        assert outcome["moved"] > 1e-3
        assert outcome["phalanx_vs_torch"] < 1e-10, f"rank {rank}: {outcome['phalanx_vs_torch']:.3g} from torch's join"
        assert outcome["phalanx_join_identical"] and outcome["torch_join_identical"]


def test_torch_generic_join_context_drives_phalanx_ddp(joined):
    """World size 3."""
    for outcome in joined:
        assert outcome["generic_vs_method"] == 0.0 and outcome["phalanx_generic_join_identical"]
