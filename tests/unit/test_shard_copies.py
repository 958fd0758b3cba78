"""Who keeps whose optimizer shard, and how a chunk's state is described (sharding/shard_copies/)."""

import pytest
import torch

from phalanx.sharding.shard_copies import Layout, copies_on, keepers


@pytest.mark.parametrize("hosts, expected", [
    ([[0, 1], [2, 3], [4, 5]], {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}),  # on the next host, same local index
    ([[0, 1, 2]], {0: 1, 1: 2, 2: 0}),  # one host: the next rank
    ([[0], [1, 2]], {0: 1, 1: 0, 2: 0}),  # uneven hosts (after a loss): the local index wraps on a smaller host
    ([[0, 1], [2]], {0: 2, 1: 2, 2: 0}),
    ([[0]], {0: 0}),  # alone: no copy
])
def test_each_rank_is_kept_on_another_host_whenever_there_is_one(hosts, expected):
    kept = keepers(hosts)
    assert kept == expected
    host_of = {rank: h for h, ranks in enumerate(hosts) for rank in ranks}
    if len(hosts) > 1:
        assert all(host_of[rank] != host_of[keeper] for rank, keeper in kept.items())


def test_a_whole_host_lost_leaves_every_one_of_its_chunks_a_copy():
    hosts = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    kept = keepers(hosts)
    for lost_host in hosts:
        assert not any(kept[rank] in lost_host for rank in lost_host)


def test_adam_state_is_per_element_moments_and_a_scalar_step():
    param = torch.zeros(3, 4, requires_grad=True)
    param.grad = torch.ones(3, 4)
    optimizer = torch.optim.AdamW([param], lr=0.1)
    optimizer.step()
    state = optimizer.state[param]
    per_element, scalars = Layout.describe(state, param.shape)
    assert sorted(per_element) == ["exp_avg", "exp_avg_sq"]
    assert scalars == {"step": ("tensor", "float32", "cpu")}
    layout = Layout(per_element, scalars)
    value = layout.scalar_value("step", float(state["step"]), torch.device("cpu"))
    assert isinstance(value, torch.Tensor) and value.dtype == state["step"].dtype and float(value) == 1.0
    assert layout.piece_width == 2  # presence, then the step


def test_python_number_state_comes_back_as_its_type():
    per_element, scalars = Layout.describe({"momentum_buffer": torch.ones(2), "count": 3}, torch.Size([2]))
    layout = Layout(per_element, scalars)
    assert per_element == ["momentum_buffer"]
    value = layout.scalar_value("count", 3.0, torch.device("cpu"))
    assert value == 3 and isinstance(value, int)


def test_a_scalar_tensor_on_an_accelerator_comes_back_on_this_ranks_device():
    """A capturable or fused Adam keeps `step` on the GPU: the layout names the GPU of the rank that described it,
    and each rank puts the value back on its own (the meta device stands in for it on a machine without GPUs)."""
    layout = Layout(["exp_avg"], {"step": ("tensor", "float32", "cuda:0")})
    value = layout.scalar_value("step", 7.0, torch.device("meta"))
    assert value.device == torch.device("meta") and value.dtype == torch.float32


def test_the_copies_are_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("PHALANX_SHARD_COPIES", raising=False)
    assert copies_on()
    for off in ("0", "false", "off", "no"):
        monkeypatch.setenv("PHALANX_SHARD_COPIES", off)
        assert not copies_on()
