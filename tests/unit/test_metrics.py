"""phalanx.metrics without a world: the reductions are the local values, Mean weighs every sample once,
gather_in_order undoes the shuffle and checks its sampler, and the docstring examples run.

The same metrics on 3 spawned Gloo ranks are in tests/ranks/test_metrics.py.
"""

import doctest
import math

import pytest
import torch

import phalanx.metrics
from phalanx import DataConfigError, DistributedSampler
from phalanx.metrics import (
    Mean,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_min,
    all_reduce_sum,
    gather_in_order,
    weighted_mean,
)
from tests.helpers.metrics_cases import SHARD_LAYOUTS, SIZE, VALUES, model


class TestOneProcess:
    def test_reductions_without_a_world_are_the_local_values(self):
        assert all_reduce_sum(3) == 3 and all_reduce_max(2.5) == 2.5 and all_reduce_min(-1) == -1
        assert torch.equal(all_reduce_sum(torch.tensor([1, 2])), torch.tensor([1, 2]))
        assert all_reduce_mean(3) == 3.0

    def test_mean_weighs_every_sample_once(self):
        mean = Mean()
        mean.update(VALUES[:5].mean(), weight=5)  # a batch mean over 5 samples
        mean.update(VALUES[5:7])  # per-sample values
        mean.update(VALUES[7:].mean().item(), weight=SIZE - 7)
        assert math.isclose(mean.compute(), VALUES.mean().item(), rel_tol=1e-12)
        mean.reset()
        assert math.isnan(mean.compute())

    def test_weighted_mean_of_nothing_is_nan(self):
        assert math.isnan(weighted_mean(0.0, 0))

    @pytest.mark.parametrize("layout", SHARD_LAYOUTS.values(), ids=SHARD_LAYOUTS.keys())
    def test_gather_in_order_alone_undoes_the_shuffle(self, layout):
        sampler = DistributedSampler(range(SIZE), num_replicas=1, rank=0, seed=4, **layout)
        sampler.set_epoch(2)
        assert torch.equal(gather_in_order(model(VALUES[list(sampler)]), sampler), model(VALUES))

    def test_gather_needs_one_result_per_index_of_the_shard(self):
        sampler = DistributedSampler(range(SIZE), num_replicas=1, rank=0)
        with pytest.raises(DataConfigError, match=f"len\\(sampler\\)={SIZE}"):
            gather_in_order(VALUES[:3], sampler)

    def test_gather_refuses_a_sampler_for_another_world(self):
        sampler = DistributedSampler(range(SIZE), num_replicas=2, rank=0)
        with pytest.raises(DataConfigError, match="num_replicas=2"):
            gather_in_order(VALUES[list(sampler)], sampler)

    def test_docstring_examples_run(self):
        for module in (phalanx.data.metrics, phalanx.data.sampler, phalanx.data.loader):
            assert doctest.testmod(module, extraglobs={"torch": torch}).failed == 0, module.__name__
