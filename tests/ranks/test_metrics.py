"""phalanx.metrics on 3 spawned Gloo ranks (one spawn for all checks): on uneven shards the all-reduced
metrics equal the single-process values, and gather_in_order returns predictions in dataset order
without padding duplicates. The tests without a world are in tests/unit/test_metrics.py.
"""

import math

import pytest
import torch

from phalanx import DataLoader, DistributedSampler
from phalanx.metrics import Mean, all_reduce_max, all_reduce_mean, all_reduce_min, all_reduce_sum, gather_in_order
from phalanx.testing import run_ranks
from tests.helpers.metrics_cases import SHARD_LAYOUTS, SIZE, VALUES, model


def metrics_on_this_rank(rank):
    """On a spawned rank: every metric over this rank's uneven share of VALUES."""
    dataset = torch.utils.data.TensorDataset(VALUES)
    sampler = DistributedSampler(dataset, seed=3, pad=False)
    batch_means, per_sample = Mean(), Mean()
    for (batch,) in DataLoader(dataset, batch_size=4, sampler=sampler):
        batch_means.update(batch.mean(), weight=len(batch))  # the usual loop: mean loss times batch size
        per_sample.update(batch)
    local = VALUES[list(sampler)]
    results = {
        "batch_means": batch_means.compute(),
        "per_sample": per_sample.compute(),
        "sum": all_reduce_sum(local.sum()).item(),
        "count": all_reduce_sum(len(local)),
        "max": all_reduce_max(local.max().item()),
        "min": all_reduce_min(local.min()).item(),
        "mean_of_ranks": all_reduce_mean(rank),
    }
    collectives = []
    real_all_reduce = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *args, **kwargs: collectives.append(1) or real_all_reduce(*args, **kwargs)
    try:
        per_sample.compute()
    finally:
        torch.distributed.all_reduce = real_all_reduce
    results["collectives_per_mean"] = len(collectives)
    for name, layout in SHARD_LAYOUTS.items():
        eval_sampler = DistributedSampler(dataset, shuffle=True, seed=9, **layout)
        eval_sampler.set_epoch(1)
        results[name] = gather_in_order(model(VALUES[list(eval_sampler)]), eval_sampler)
        results[name + "/objects"] = gather_in_order([f"item{i}" for i in eval_sampler], eval_sampler)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(metrics_on_this_rank, 3)  # world size 3


class TestThreeRanks:

    @pytest.mark.smoke
    def test_means_on_uneven_shards_equal_the_single_process_mean(self, per_rank):
        """World size 3."""
        for results in per_rank:
            assert math.isclose(results["batch_means"], VALUES.mean().item(), rel_tol=1e-12)
            assert math.isclose(results["per_sample"], VALUES.mean().item(), rel_tol=1e-12)

    def test_sum_max_min_and_count_are_over_all_samples(self, per_rank):
        """World size 3."""
        for results in per_rank:
            assert math.isclose(results["sum"], VALUES.sum().item(), rel_tol=1e-12)
            assert results["count"] == SIZE
            assert (results["max"], results["min"]) == (VALUES.max().item(), VALUES.min().item())
            assert results["mean_of_ranks"] == 1.0  # (0 + 1 + 2) / 3

    def test_a_mean_is_one_collective(self, per_rank):
        """World size 3."""
        assert [results["collectives_per_mean"] for results in per_rank] == [1, 1, 1]

    @pytest.mark.parametrize("layout", SHARD_LAYOUTS, ids=SHARD_LAYOUTS.keys())
    def test_gather_returns_dataset_order_without_duplicates(self, per_rank, layout):
        """World size 3."""
        sampler = DistributedSampler(range(SIZE), num_replicas=3, rank=0, seed=9, **SHARD_LAYOUTS[layout])
        sampler.set_epoch(1)
        kept = sorted(set(sampler.global_order().tolist()))  # all indices, or those drop_last kept
        assert len(kept) == (SIZE if layout != "drop-last" else SIZE - SIZE % 3)
        for results in per_rank:
            assert torch.equal(results[layout], model(VALUES)[kept])
            assert results[layout + "/objects"] == [f"item{i}" for i in kept]
