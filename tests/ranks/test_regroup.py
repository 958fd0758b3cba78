"""DistributedDataParallel.regroup: the ranks left after a loss train on in-process, on a new process group.

World size 3 on one host, with the shared-memory exchange and with Gloo's (PHALANX_SHM=0). Every rank
trains step 1; then rank 2 leaves (it takes no further part: it waits, idle, until the others are done),
ranks 0 and 1 compute step 2's gradients locally (the step in flight when the loss is noticed), meet on a
group of their own (dist.new_group(..., use_local_synchronization=True): rank 2 is not asked), regroup the
model, and train steps 2 and 3 again from the start on two ranks. Their parameters equal one process's SGD
on the same batches: step 1 averaged over three ranks' batches, steps 2 and 3 over two; the dropped
gradients of the step in flight count nowhere. The engine on the new group is the same kind (shared
memory among the ranks left, or Gloo's). A sharded level refuses with a typed error that says what to do.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import phalanx as px
from phalanx.errors import ShardingError
from phalanx.testing import run_ranks

BATCH, WIDTH, LR = 4, 6, 0.1
DONE = "test-regroup/done"


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).double()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64),
            torch.randn(BATCH, 1, generator=generator, dtype=torch.float64))


def _train_step(model, optimizer, inputs, targets) -> None:
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def _lose_rank_two(rank: int) -> dict:
    refused = ""
    sharded = px.DistributedDataParallel(_net(), shard="gradients")
    try:
        sharded.regroup(dist.group.WORLD)
    except ShardingError as error:
        refused = str(error)
    del sharded

    model = px.DistributedDataParallel(_net(), bucket_cap_mb=0.001)  # a bucket per layer or so: several
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    _train_step(model, optimizer, *_batch(1, rank))
    store = dist.distributed_c10d._get_default_store()
    if rank == 2:  # gone: no further collective, no further key; it only waits to be let go
        store.wait([DONE], timedelta(seconds=120))
        return {"refused": refused}
    kind_before = type(model._reducer.exchange).__name__
    with model.no_sync():  # step 2 in flight: gradients that were never averaged
        torch.nn.functional.mse_loss(model(_batch(2, rank)[0]), _batch(2, rank)[1]).backward()
    survivors = dist.new_group([0, 1], use_local_synchronization=True)
    model.regroup(survivors)
    dropped = all(p.grad is None for p in model.parameters())
    for step in (2, 3):
        _train_step(model, optimizer, *_batch(step, rank))
    dist.barrier(group=survivors)
    if rank == 0:
        store.set(DONE, "1")
    return {"refused": refused, "dropped": dropped, "kinds": (kind_before,
            type(model._reducer.exchange).__name__), "params": [p.detach().clone() for p in model.parameters()]}


def _reference() -> list[torch.Tensor]:
    """One process: step 1 on the three ranks' batches together, steps 2 and 3 on ranks 0 and 1's."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, ranks in ((1, (0, 1, 2)), (2, (0, 1)), (3, (0, 1))):
        batches = [_batch(step, rank) for rank in ranks]
        _train_step(model, optimizer, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("shm, kind", [("1", "ShmExchange"), ("0", "AllReduceExchange")], ids=["shm", "gloo"])
def test_the_ranks_left_train_on_as_one_process_on_their_batches(shm, kind):
    results = run_ranks(_lose_rank_two, 3, env={"PHALANX_SHM": shm}, timeout=180)
    expected = _reference()
    for rank, result in enumerate(results[:2]):
        assert result["dropped"], f"rank {rank}: the gradients of the step in flight were kept"
        assert result["kinds"] == (kind, kind), f"rank {rank}: exchanges {result['kinds']}, expected {kind}"
        for got, want in zip(result["params"], expected):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), f"rank {rank}: {(got - want).abs().max():.3g}"
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"])), "replicas differ"
    for rank, result in enumerate(results):
        assert "regroup() does not work with sharded DistributedDataParallel" in result["refused"], result["refused"]
        assert f"rank {rank}" in result["refused"] and "checkpoint" in result["refused"], result["refused"]
