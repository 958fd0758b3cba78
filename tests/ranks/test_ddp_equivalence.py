"""DDP over 2, 3 and 4 ranks equals one process trained on the concatenated batch.

On one host, 2 and 3 ranks exchange gradients by posting them in shared memory, 4 by the two-phase
all-reduce (shm.py): all three must give the reference.

Each world size is one spawned run that trains every case with SGD+momentum and with Adam
(float64, 10 steps) next to its one-process reference; the tests then read the results.
"""

import warnings

import pytest

from phalanx.testing import run_ranks
from tests.helpers.ddp_cases import equivalence_run

CASES = ["mlp", "cnn_bn_eval", "unused", "tied", "no_sync", "create_graph"]
OPTIMIZERS = ["sgd", "adam"]


def _all_cases(rank: int, world: int) -> dict:
    warnings.simplefilter("ignore")  # backward(create_graph=True) warns about a reference cycle
    return {(case, opt): equivalence_run(rank, world, case, opt) for case in CASES for opt in OPTIMIZERS}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["world2", "world3", "world4"])
def results(request):
    world = request.param
    return run_ranks(_all_cases, world, (world,), timeout=240)


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process_on_concatenated_batch(results, case, opt):
    """World sizes 2, 3 and 4 (one spawn each, read by every test of this file)."""
    for rank, per_rank in enumerate(results):
        outcome = per_rank[(case, opt)]
        assert outcome["moved"] > 1e-3, "training must change the parameters for the comparison to mean anything"
        assert outcome["max_diff"] < 1e-9, f"rank {rank}: {case}/{opt} is {outcome['max_diff']:.3g} from the reference"
        assert outcome["identical"], f"rank {rank}: replicas differ bitwise after some step"


def test_each_world_size_uses_its_exchange(results):
    """World sizes 2, 3 and 4: posted exchange up to 3 ranks, the two-phase all-reduce at 4."""
    world = len(results)
    if results[0][("mlp", "sgd")]["exchange"] == "process group":
        pytest.skip("no shared memory on this host: every world size uses the process group")
    expected = "posted" if world <= 3 else "shm all-reduce"
    assert {per_rank[key]["exchange"] for per_rank in results for key in per_rank} == {expected}
    # Buckets of few large gradients are exchanged split when posted (when the C kernel was built).
    split = {case for per_rank in results for (case, _), outcome in per_rank.items() if outcome["split_buckets"]}
    assert split == ({"mlp", "no_sync", "unused"} if world <= 3 else set())


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_unused_parameters_keep_none_and_partly_used_get_the_average(results, opt):
    """World sizes 2, 3 and 4."""
    for per_rank in results:
        outcome = per_rank[("unused", opt)]
        assert outcome["never_grad_is_none"], "a parameter unused on every rank must keep grad None"
        assert outcome["odd_grad_matches"], "a parameter used on some ranks gets the average over all ranks"
