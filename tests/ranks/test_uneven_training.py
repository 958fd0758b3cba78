"""Uneven inputs end to end (world sizes 2 and 3): `phalanx.DataLoader` over `pad=False` shards, so
ranks run out of data at different steps, trained under `with model.join(...)`, equals one process
that averages, at each step, the losses of the ranks still holding a batch.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import phalanx
from phalanx.testing import run_ranks

SAMPLES, BATCH, STEPS_LR = 31, 5, 0.1  # the tests train on the first 21 or 31 samples


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64),
                         torch.randn(SAMPLES, 2, generator=g, dtype=torch.float64))


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _train_with_join(rank: int, world: int, samples: int):
    dataset = _dataset()
    dataset.tensors = tuple(t[:samples] for t in dataset.tensors)
    sampler = phalanx.DistributedSampler(dataset, shuffle=True, seed=5, pad=False)
    loader = phalanx.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = phalanx.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=STEPS_LR)
    for epoch in range(2):
        loader.set_epoch(epoch)
        with model.join(divide_by_initial_world_size=False):
            for x, y in loader:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
    return len(loader), [p.detach().clone() for p in model.module.parameters()]


def _single_process(world: int, samples: int):
    """One process: at step s, the mean over the ranks that still have a batch of their batch losses."""
    dataset = _dataset()
    x_all, y_all = (t[:samples] for t in dataset.tensors)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=STEPS_LR)
    for epoch in range(2):
        shards = []
        for rank in range(world):
            sampler = phalanx.DistributedSampler(range(samples), num_replicas=world, rank=rank, shuffle=True,
                                                 seed=5, pad=False)
            sampler.set_epoch(epoch)
            indices = sampler.epoch_indices()
            shards.append([indices[i:i + BATCH] for i in range(0, len(indices), BATCH)])
        for step in range(max(len(s) for s in shards)):
            active = [s[step] for s in shards if step < len(s)]
            opt.zero_grad()
            loss = sum(F.mse_loss(model(x_all[b]), y_all[b]) for b in active) / len(active)
            loss.backward()
            opt.step()
    return [p.detach() for p in model.parameters()]


def _check(world: int, samples: int) -> None:
    results = run_ranks(_train_with_join, world, args=(world, samples))
    batches = [n for n, _ in results]
    assert len(set(batches)) > 1, f"the shards were meant to be uneven in batches, got {batches}"
    reference = _single_process(world, samples)
    for rank, (_, params) in enumerate(results):
        for ours, expected in zip(params, reference):
            assert torch.allclose(ours, expected, rtol=1e-10, atol=1e-12), f"rank {rank} differs from one process"
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][1])), "replicas differ"


@pytest.mark.smoke
def test_two_ranks_with_three_and_two_batches_equal_one_process():
    """World size 2."""
    _check(world=2, samples=21)  # shards 11 / 10 -> 3 / 2 batches of 5


def test_three_ranks_with_uneven_batch_counts_equal_one_process():
    """World size 3."""
    _check(world=3, samples=31)  # shards 11 / 10 / 10 -> 3 / 2 / 2 batches of 5
