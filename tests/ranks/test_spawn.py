"""`phalanx.spawn`: the mp.spawn style (multi-process: world size 2, Gloo on CPU)."""

import time

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.errors import RankFailedError

ENV = {"PHALANX_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _sum_of_ranks(rank, offset):
    if rank == 0:
        time.sleep(1.0)  # rank 1 finishes first: the order of results must not follow finishing order
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank + offset, int(total.item())


def _rank_1_raises(rank):
    if rank == 1:
        raise KeyError(f"missing key seen by rank {rank}")
    dist.barrier()  # rank 0 waits for a peer that is gone: spawn must stop it


@pytest.mark.smoke
def test_results_come_back_in_rank_order():
    """World size 2 (phalanx.spawn)."""
    assert phalanx.spawn(_sum_of_ranks, 2, args=(10,), env=ENV, timeout=120) == [(10, 1), (11, 1)]


def test_child_exception_reaches_the_parent_with_its_traceback():
    """World size 2 (phalanx.spawn): rank 1 raises."""
    with pytest.raises(RankFailedError) as error:
        phalanx.spawn(_rank_1_raises, 2, env=ENV, timeout=120)
    assert error.value.rank == 1
    assert "_rank_1_raises" in error.value.traceback_text
    assert "KeyError: 'missing key seen by rank 1'" in error.value.traceback_text
    assert "missing key seen by rank 1" in str(error.value)
