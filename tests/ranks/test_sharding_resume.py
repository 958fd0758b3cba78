"""Checkpoints of sharded runs restore at any world size and in any shard mode.

The modes are the shard levels: "none", "optimizer", "gradients", and "parameters" (torch's FSDP2).
A run trains 4 steps on N ranks in one mode and saves; another run restores it on M ranks in another
mode and trains 4 more. Every rank takes its rows of the same global batch, so the result must be
one process training 8 steps on the whole batch (float64: the sums differ only in their order).
Resumed at the same world size and mode, the run must be bitwise the uninterrupted one.
"""

import pytest
import torch

import phalanx as px
from phalanx.testing import run_ranks
from tests.helpers.shard_cases import make_net, make_optimizer, train

STEPS = 4


def _build(mode):
    model = px.DistributedDataParallel(make_net(torch.float64), shard=mode, bucket_cap_mb=0.004)
    return model, model.shard_optimizer(make_optimizer("adamw", model))


def _first_half(rank, world, mode, directory):
    model, opt = _build(mode)
    train(rank, world, mode, steps=STEPS, dtype=torch.float64, model=model, opt=opt)
    px.Checkpointer(directory).save({"model": model, "optimizer": opt, "step": STEPS})


def _second_half(rank, world, mode, directory):
    model, opt = _build(mode)
    state = {"model": model, "optimizer": opt, "step": 0}
    assert px.Checkpointer(directory).restore(state)
    run = train(rank, world, mode, steps=STEPS, start=state["step"], dtype=torch.float64, model=model, opt=opt)
    return run["params"], run["optimizer"]


def _uninterrupted(rank, world, mode):
    model, opt = _build(mode)
    run = train(rank, world, mode, steps=2 * STEPS, dtype=torch.float64, model=model, opt=opt)
    return run["params"], run["optimizer"]


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_uninterrupted, 1, (1, "none"))[0]


MATRIX = [((2, "gradients"), (1, "none")), ((4, "optimizer"), (2, "gradients")), ((2, "none"), (2, "gradients")),
          ((2, "gradients"), (2, "none")), ((1, "none"), (3, "optimizer")), ((3, "gradients"), (4, "gradients")),
          ((2, "parameters"), (1, "none")), ((2, "gradients"), (2, "parameters")),
          ((4, "parameters"), (3, "optimizer"))]


@pytest.mark.parametrize("saved,restored", MATRIX, ids=[f"{a[0]}{a[1]}-to-{b[0]}{b[1]}" for a, b in MATRIX])
def test_resume_at_any_world_size_and_shard_mode(tmp_path, reference, saved, restored):
    """World sizes 1 to 4: save on `saved` (ranks, mode), restore on `restored`, finish the run."""
    run_ranks(_first_half, saved[0], (saved[0], saved[1], str(tmp_path)))
    results = run_ranks(_second_half, restored[0], (restored[0], restored[1], str(tmp_path)))
    expected_params, expected_state = reference
    for params, state in results:
        for got, want in zip(params, expected_params):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
        assert state["param_groups"] == expected_state["param_groups"]
        for index, entry in expected_state["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(torch.as_tensor(state["state"][index][key]), torch.as_tensor(value),
                                           rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mode", ["optimizer", "gradients", "parameters"])
def test_resume_same_world_and_mode_is_bitwise(tmp_path, mode):
    """World size 2: saved after 4 steps and resumed, the run is bitwise the uninterrupted one."""
    run_ranks(_first_half, 2, (2, mode, str(tmp_path)))
    resumed = run_ranks(_second_half, 2, (2, mode, str(tmp_path)))
    uninterrupted = run_ranks(_uninterrupted, 2, (2, mode))
    for (params, state), (want, want_state) in zip(resumed, uninterrupted):
        assert all(torch.equal(a, b) for a, b in zip(params, want))
        assert all(torch.equal(torch.as_tensor(state["state"][i][k]), torch.as_tensor(v))
                   for i, entry in want_state["state"].items() for k, v in entry.items())
