"""Sharded DDP (shard="optimizer" / "gradients") against unsharded phalanx DDP and torch DDP.

On one host the sharded exchange works in shared memory: after 20 AdamW steps its parameters must
be bitwise those of shard="none" (the same sums in the same order, the same elementwise updates).
On Gloo they must be close to torch DDP + AdamW and bitwise equal across replicas.
"""

import pytest
import torch

from phalanx.testing import run_ranks
from tests.helpers.shard_cases import exchange_name, replicas_identical, train

MODES = ["optimizer", "gradients"]


def _compare_modes(rank, world, optimizer):
    runs = {mode: train(rank, world, mode, optimizer=optimizer) for mode in ["none"] + MODES}
    clipped = {mode: train(rank, world, mode, optimizer=optimizer, clip=0.3) for mode in ["none"] + MODES}
    reference = runs["none"]
    out = {}
    for mode in MODES:
        run = runs[mode]
        out[mode] = {
            "exchange": exchange_name(run["model"]),
            "bitwise": all(torch.equal(a, b) for a, b in zip(reference["params"], run["params"])),
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(reference["params"], run["params"])),
            "moved": max(float((a - b).abs().max()) for a, b in
                         zip(train(rank, world, "none", steps=0)["params"], run["params"])),
            "norms": (clipped["none"]["norms"], clipped[mode]["norms"]),
            "clipped_diff": max(float((a - b).abs().max()) for a, b in
                                zip(clipped["none"]["params"], clipped[mode]["params"])),
            "state_equal": _same_state(reference["optimizer"], run["optimizer"]),
            "identical": replicas_identical(run["params"]),
        }
    return out


def _same_state(a, b):
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(a["state"][i].keys() == b["state"][i].keys() and
               all(torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(b["state"][i][k]))
                   for k in a["state"][i]) for i in a["state"])


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def shm_results(request):
    return run_ranks(_compare_modes, request.param, (request.param, "adamw"), timeout=240)


@pytest.mark.parametrize("mode", MODES)
def test_shared_memory_sharding_is_bitwise_the_unsharded_run(shm_results, mode):
    """World sizes 2 and 4, 20 AdamW steps with a no-decay group. Clipped (by a global norm summed in
    another order than torch's, so not bitwise), the norms and parameters stay close."""
    for rank, per_rank in enumerate(shm_results):
        outcome = per_rank[mode]
        assert outcome["exchange"] == "ShmShardedExchange"
        assert outcome["moved"] > 1e-2
        assert outcome["bitwise"], f"rank {rank}: {mode} is {outcome['max_diff']:.3g} from shard='none'"
        reference_norms, norms = outcome["norms"]
        assert len(norms) == 20 and min(reference_norms) > 0.3, "the clip must act for the comparison to mean anything"
        assert norms == pytest.approx(reference_norms, rel=1e-5), "the global norm must be the unsharded one"
        assert outcome["clipped_diff"] < 1e-5
        assert outcome["state_equal"], "state_dict() must be the unsharded optimizer's, bitwise"
        assert outcome["identical"]


def _against_torch(rank, world, optimizer):
    reference = train(rank, world, None, optimizer=optimizer, clip=0.5, torch_ddp=True)
    out = {}
    for mode in MODES:
        run = train(rank, world, mode, optimizer=optimizer, clip=0.5)
        out[mode] = {"exchange": exchange_name(run["model"]),
                     "max_diff": max(float((a - b).abs().max()) for a, b in zip(reference["params"], run["params"])),
                     "norms": (reference["norms"], run["norms"]), "identical": replicas_identical(run["params"])}
    return out


@pytest.mark.parametrize("optimizer", [pytest.param("adamw", marks=pytest.mark.smoke), "sgd", "rmsprop", "adagrad"])
def test_gloo_sharding_matches_torch_ddp(optimizer):
    """World size 2 over Gloo (shared memory off): close to torch DDP, replicas bitwise equal."""
    results = run_ranks(_against_torch, 2, (2, optimizer), env={"PHALANX_SHM": "0"}, timeout=240)
    for rank, per_rank in enumerate(results):
        for mode in MODES:
            outcome = per_rank[mode]
            assert outcome["exchange"] == "ShardedExchange"
            assert outcome["max_diff"] < 1e-5, f"rank {rank} {mode}/{optimizer}: {outcome['max_diff']:.3g}"
            assert outcome["norms"][1] == pytest.approx(outcome["norms"][0], rel=1e-5)
            assert outcome["identical"]


def _features(rank, world):
    out = {}
    cases = {"no_sync": {"accumulate": 3}, "unused": {"unused": True}, "one_bucket": {"bucket_cap_mb": 25},
             "overlap_forward": {"overlap": True}}
    for name, options in cases.items():
        reference = train(rank, world, "none", steps=6, **{k: v for k, v in options.items() if k != "overlap"})
        for mode in MODES:
            run = train(rank, world, mode, steps=6, **options)
            out[(name, mode)] = (all(torch.equal(a, b) for a, b in zip(reference["params"], run["params"])),
                                 _same_state(reference["optimizer"], run["optimizer"]))
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_no_sync_unused_parameters_and_overlap_work_sharded(transport):
    """World size 2: gradient accumulation under no_sync(), a branch no rank uses, one bucket for the
    whole model and the all-gather overlapping the next forward give the same parameters and optimizer
    state as shard='none' (the unused branch gets no state, as unsharded)."""
    env = {"PHALANX_SHM": "0" if transport == "gloo" else "1"}
    for per_rank in run_ranks(_features, 2, (2,), env=env, timeout=240):
        for key, (bitwise, state_equal) in per_rank.items():
            assert bitwise, f"{key}: parameters differ from shard='none'"
            assert state_equal, f"{key}: optimizer state differs from shard='none'"
