"""What a DDP step over shared memory writes into .grad: bitwise the rank-order sum of every rank's
gradient times 1/N, computed here with torch ops, for every way a bucket is exchanged (posted
buckets of small and of large gradients, split buckets), with gradients missing on some ranks, a
strided gradient, and results written through the cache or with streaming stores.
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.shm import reduce as shm_reduce
from phalanx.shm.segment import SHM_DIR
from phalanx.testing import run_ranks

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")

STEPS = 3  # the first backward records the order, the second runs on the rebuilt buckets


class Mixed(nn.Module):
    """Many small gradients, two large ones, and a branch only rank 0 uses."""

    def __init__(self):
        super().__init__()
        self.small = nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)])
        self.large = nn.Linear(16, 300)
        self.head = nn.Linear(300, 200, bias=False)
        self.rank0_only = nn.Linear(16, 200)

    def forward(self, x, use_branch: bool):
        y = self.head(torch.tanh(self.large(self.small(x))))
        return y + self.rank0_only(x) if use_branch else y


def _local_gradients(model: nn.Module, x, y, use_branch: bool) -> list[torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x, use_branch), y).backward()
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _rank_order_average(per_rank: list[list[torch.Tensor | None]], like: list[torch.Tensor]) -> list:
    scale = 1.0 / len(per_rank)
    out = []
    for k, p in enumerate(like):
        terms = [torch.zeros_like(p) if grads[k] is None else grads[k] for grads in per_rank]
        total = terms[0] * scale
        for term in terms[1:]:
            total = total + term * scale
        out.append(total)
    return out


def _exchange_bits(rank: int, stream_min_bytes: int) -> dict:
    shm_reduce.STREAM_MIN_BYTES = stream_min_bytes
    world = dist.get_world_size()
    torch.manual_seed(0)
    plain = Mixed()
    model = phalanx.DistributedDataParallel(Mixed().requires_grad_(True), find_unused_parameters=True,
                                            bucket_cap_mb=0.1)
    model.module.load_state_dict(plain.state_dict())
    exchange = model._reducer.exchange
    assert type(exchange).__name__ == "ShmExchange", "shared memory was not used"
    equal, modes = True, set()
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(5, 16, generator=g), torch.randn(5, 200, generator=g)
        use_branch = rank == 0
        local = _local_gradients(plain, x, y, use_branch)
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        expected = _rank_order_average(gathered, list(plain.parameters()))
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x, use_branch), y).backward()
        got = [p.grad for p in model.module.parameters()]
        equal &= all(torch.equal(a, b) for a, b in zip(got, expected))
        modes |= set(exchange.modes)
    # One more step onto a strided zero gradient: autograd accumulates into it and keeps its strides.
    model.zero_grad(set_to_none=True)
    model.module.head.weight.grad = torch.zeros(300, 200).t()
    g = torch.Generator().manual_seed(99 + rank)
    x, y = torch.randn(5, 16, generator=g), torch.randn(5, 200, generator=g)
    plain.zero_grad(set_to_none=True)
    local = _local_gradients(plain, x, y, rank == 0)
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    expected = _rank_order_average(gathered, list(plain.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes that the gradient is not laid out like its parameter
        F.mse_loss(model(x, rank == 0), y).backward()
    strided = model.module.head.weight.grad
    equal &= not strided.is_contiguous()
    equal &= all(torch.equal(p.grad, e) for p, e in zip(model.module.parameters(), expected))
    return {"equal": equal, "modes": sorted(modes)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_over_shared_memory_gives_the_rank_order_average_bitwise(world_size):
    """World sizes 2 and 3; results through the cache, then with streaming stores everywhere."""
    for stream_min_bytes in (1 << 62, 0):
        outcome = run_ranks(_exchange_bits, world_size, (stream_min_bytes,), timeout=120)
        for rank, result in enumerate(outcome):
            assert result["equal"], f"rank {rank}: .grad is not the rank-order average (streaming from " \
                                    f"{stream_min_bytes} bytes)"
            assert result["modes"] == ["posted", "split"], result["modes"]
