"""Sparse gradients (nn.Embedding(sparse=True)) averaged as torch DDP averages them on Gloo: phalanx
DDP on 2 ranks (world size 2), over both transports, against torch DDP and against one process
averaging both ranks' losses; with gradient_as_bucket_view, with a comm hook, and with a rank that
leaves the embedding unused (find_unused_parameters), which torch DDP itself cannot do ("Expected
sparse gradient to be defined")."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import phalanx
from phalanx.testing import run_ranks

STEPS = 4
CONFIGS = {"default": {}, "as_view": {"gradient_as_bucket_view": True}, "hook": {},
           "unused_on_rank_1": {"find_unused_parameters": True}}


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(50, 8, sparse=True)
        self.dense = nn.Linear(8, 1)

    def forward(self, ids, use_embedding: bool = True):
        features = self.embedding(ids).mean(dim=1) if use_embedding else torch.zeros(ids.shape[0], 8)
        return self.dense(features)


def _batch(config: str, rank: int, step: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    ids, y = torch.randint(0, 50, (6, 3), generator=g), torch.randn(6, 1, generator=g)
    return ids, y, not (config == "unused_on_rank_1" and rank == 1 and step % 2)


def _reference(config: str) -> list[torch.Tensor]:
    """One process: each step averages the two ranks' losses, as DDP averages their gradients."""
    net = Recommender()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        losses = [nn.functional.mse_loss(net(ids, use), y) for ids, y, use in (_batch(config, r, step) for r in (0, 1))]
        (sum(losses) / 2).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _train(cls, config: str, rank: int) -> list[torch.Tensor]:
    net = Recommender()
    model = cls(net, **CONFIGS[config])
    if config == "hook":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        ids, y, use = _batch(config, rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(ids, use), y).backward()
        assert net.embedding.weight.grad is None or net.embedding.weight.grad.is_sparse
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _compare(rank: int) -> dict:
    out = {}
    for config in CONFIGS:
        ours = _train(phalanx.DistributedDataParallel, config, rank)
        reference = _reference(config)
        out[config] = {"ours": ours, "vs_one_process": _max_diff(ours, reference),
                       "moved": _max_diff(ours, [p.detach() for p in Recommender().parameters()])}
        if config != "unused_on_rank_1":  # torch DDP raises there
            out[config]["vs_torch"] = _max_diff(ours, _train(torch.nn.parallel.DistributedDataParallel, config, rank))
    return out


def _max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module", params=["shm", "process group"])
def results(request):
    return run_ranks(_compare, 2, env={"PHALANX_SHM": "1" if request.param == "shm" else "0"})


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sparse_gradients_match_torch_ddp(results, config):
    for per_rank in results:
        outcome = per_rank[config]
        assert outcome["moved"] > 1e-3, "the model did not train"
        assert outcome["vs_one_process"] < 1e-6, outcome["vs_one_process"]
        assert outcome.get("vs_torch", 0.0) < 1e-6, outcome["vs_torch"]
    for mine, theirs in zip(results[0][config]["ours"], results[1][config]["ours"]):
        assert torch.equal(mine, theirs), "replicas differ"
