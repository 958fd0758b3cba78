"""World size 1 (one spawned process): DDP trains exactly like the bare module; checkpoints
interchange with torch DDP ('module.' keys) and load in either form; misuse is reported.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.hooks import allreduce_hook
from phalanx.testing import run_ranks


def _net() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _world_of_one(rank: int) -> dict:
    out = {}
    bare = _net()
    model = phalanx.DDP(copy.deepcopy(bare), gradient_as_bucket_view=True)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, bare)]
    for _ in range(5):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        for m, opt in zip((model, bare), opts):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    out["bitwise_equal_to_bare"] = all(torch.equal(a, b) for a, b in zip(model.module.state_dict().values(),
                                                                        bare.state_dict().values()))
    state = model.state_dict()
    out["keys"] = list(state)
    out["bare_keys"] = list(model.module.state_dict())

    fresh = phalanx.DDP(_net())
    fresh.load_state_dict(state)
    out["load_prefixed"] = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))
    fresh = phalanx.DDP(_net())
    fresh.load_state_dict(model.module.state_dict())
    out["load_bare"] = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))
    theirs = torch.nn.parallel.DistributedDataParallel(_net())
    theirs.load_state_dict(state)
    out["torch_loads_ours"] = all(torch.equal(a, b) for a, b in zip(theirs.state_dict().values(), state.values()))
    try:
        fresh.load_state_dict({"module.nope": torch.zeros(1)})
        out["strict_still_strict"] = False
    except RuntimeError:
        out["strict_still_strict"] = True

    try:
        phalanx.DDP(nn.Linear(2, 2), device_ids=[0])
    except ValueError as exc:
        out["cpu_device_ids"] = str(exc)
    hooked = phalanx.DDP(nn.Linear(2, 2))
    hooked.register_comm_hook(None, allreduce_hook)
    try:
        hooked.register_comm_hook(None, allreduce_hook)
    except RuntimeError as exc:
        out["second_hook"] = str(exc)
    return out


@pytest.fixture(scope="module")
def single():
    return run_ranks(_world_of_one, 1, timeout=120)[0]


def test_world_of_one_trains_bitwise_like_the_bare_module(single):
    """World size 1 (one spawned process)."""
    assert single["bitwise_equal_to_bare"]


def test_state_dict_keys_carry_the_module_prefix(single):
    """World size 1 (one spawned process)."""
    assert single["keys"] == ["module." + key for key in single["bare_keys"]]


def test_load_state_dict_accepts_both_forms_and_torch_ddp_loads_ours(single):
    """World size 1 (one spawned process)."""
    assert single["load_prefixed"] and single["load_bare"] and single["torch_loads_ours"]
    assert single["strict_still_strict"]


def test_misuse_is_reported(single):
    """World size 1 (one spawned process)."""
    assert "device_ids" in single["cpu_device_ids"]
    assert "only be called once" in single["second_hook"]
