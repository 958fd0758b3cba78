"""torch DDP's surface that Accelerate and Lightning reach for, on phalanx's class against torch's, on 2 Gloo
ranks (world size 2): `reducer.prepare_for_backward` after a forward without sync, `_set_static_graph`,
`_get_ddp_logging_data`, `_ddp_params_and_buffers_to_ignore`, and the torch internals phalanx refuses.
The rank function runs every case with both classes; the tests compare."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.errors import TorchInternalError
from phalanx.testing import run_ranks

CLASSES = {"torch": torch.nn.parallel.DistributedDataParallel, "phalanx": phalanx.DistributedDataParallel}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def _trigger_sync(ddp, rank: int) -> list[torch.Tensor]:
    """Accelerate's trigger_sync_in_backward: two forwards under no_sync, the first backward local, then
    reducer.prepare_for_backward([]) makes the second backward average the accumulated gradients."""
    with ddp.no_sync():
        first, second = ddp(_batch(rank, 0)).sum(), ddp(_batch(rank, 1)).pow(2).sum()
    first.backward()
    local = _grads(ddp.module)
    ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_backward([])
    second.backward()
    return local + _grads(ddp.module)


def _manual_prepare(ddp, rank: int) -> list[torch.Tensor]:
    """Lightning's manual optimization: sync off after the forward, then _rebuild_buckets and
    prepare_for_backward(outputs) before backward; then a normal step. Twice, so the rebuild happens."""
    out = []
    for step in range(2):
        ddp.zero_grad()
        loss = ddp(_batch(rank, step)).sum()
        ddp.reducer._rebuild_buckets()
        ddp.reducer.prepare_for_backward([loss])
        loss.backward()
        out += _grads(ddp.module)
    return out


def _ignored(cls, rank: int) -> list[torch.Tensor]:
    """The last layer is ignored: not broadcast at construction, its gradient stays this rank's own."""
    net = _net()
    if rank == 1:
        with torch.no_grad():
            net[3].weight.add_(1.0)
    cls._set_params_and_buffers_to_ignore_for_model(net, ["3.weight", "3.bias"])
    ddp = cls(net)
    ddp(_batch(rank, 0)).sum().backward()
    return [p.detach().clone() for p in net.parameters()] + _grads(net)


def _surface(rank: int) -> dict:
    out = {}
    for name, cls in CLASSES.items():
        out[f"trigger/{name}"] = _trigger_sync(cls(_net()), rank)
        out[f"manual/{name}"] = _manual_prepare(cls(_net()), rank)
        out[f"ignored/{name}"] = _ignored(cls, rank)
        ddp = cls(_net())
        ddp._set_static_graph()
        out[f"static/{name}"] = bool(ddp.static_graph)
        data = ddp._get_ddp_logging_data()
        out[f"logging/{name}"] = {k: data[k] for k in ("world_size", "rank", "module_name", "backend_name",
                                                       "bucket_cap_bytes", "find_unused_parameters",
                                                       "gradient_as_bucket_view", "num_parameter_tensors",
                                                       "total_parameter_size_bytes", "broadcast_buffers")}
        out[f"buffers/{name}"] = ddp.will_sync_module_buffers()
    ddp = phalanx.DistributedDataParallel(_net())
    fsdp2 = phalanx.DistributedDataParallel(nn.Sequential(nn.Linear(6, 16), nn.Linear(16, 3)), shard="parameters")
    refused = {}
    for label, call in (("reducer._ddp_graph_static", lambda: ddp.reducer._ddp_graph_static()),
                        ("_register_fused_optim", lambda: ddp._register_fused_optim(torch.optim.SGD, lr=0.1)),
                        ("_set_ddp_runtime_logging_sample_rate", lambda: ddp._set_ddp_runtime_logging_sample_rate(5)),
                        ("DistributedDataParallel.reducer", lambda: fsdp2.reducer.prepare_for_backward([]))):
        try:
            call()
        except TorchInternalError as error:
            refused[label] = str(error)
    out["refused"] = refused
    out["hasattr"] = hasattr(ddp.reducer, "_ddp_graph_static")
    with phalanx.patch_torch_ddp():
        built = torch.nn.parallel.distributed.DistributedDataParallel(_net())
        out["patched"] = (type(built).__name__, type(built).__module__,
                          isinstance(built, torch.nn.parallel.DistributedDataParallel))
    out["unpatched"] = type(torch.nn.parallel.DistributedDataParallel(_net())).__module__
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_surface, 2)


@pytest.mark.parametrize("case", ["trigger", "manual", "ignored"])
def test_case_matches_torch_ddp(results, case):
    """World size 2: phalanx's gradients (and parameters) equal torch DDP's after the same calls, on each rank."""
    for rank, result in enumerate(results):
        torch_values, phalanx_values = result[f"{case}/torch"], result[f"{case}/phalanx"]
        assert len(torch_values) == len(phalanx_values)
        for t, p in zip(torch_values, phalanx_values):
            torch.testing.assert_close(p, t, rtol=1e-12, atol=1e-12, msg=f"{case}, rank {rank}")


def test_trigger_sync_averages_only_the_triggered_backward(results):
    """World size 2: the backward under no_sync stays local (the ranks differ), the triggered one is averaged."""
    half = len(results[0]["trigger/phalanx"]) // 2
    local0, local1 = results[0]["trigger/phalanx"][:half], results[1]["trigger/phalanx"][:half]
    synced0, synced1 = results[0]["trigger/phalanx"][half:], results[1]["trigger/phalanx"][half:]
    assert any(not torch.equal(a, b) for a, b in zip(local0, local1))
    assert all(torch.equal(a, b) for a, b in zip(synced0, synced1))


def test_ignored_parameters_are_neither_broadcast_nor_averaged(results):
    """World size 2: the ignored last layer keeps rank 1's own weights and its own gradient."""
    params0, params1 = results[0]["ignored/phalanx"], results[1]["ignored/phalanx"]
    assert not torch.equal(params0[4], params1[4])  # 3.weight: rank 1 added one before wrapping
    assert torch.equal(params0[0], params1[0])      # 0.weight: broadcast and averaged


def test_static_graph_logging_data_and_buffers_match_torch(results):
    """World size 2: _set_static_graph sets static_graph; _get_ddp_logging_data's construction keys equal torch's."""
    for result in results:
        assert result["static/torch"] and result["static/phalanx"]
        assert result["logging/phalanx"] == result["logging/torch"]
        assert result["buffers/phalanx"] == result["buffers/torch"]


def test_torch_internals_raise_a_typed_error_naming_them(results):
    """World size 2: a torch internal raises TorchInternalError naming it and the rank (`.reducer` of the FSDP2
    level too: FSDP2 has none); hasattr sees it absent."""
    refused = results[0]["refused"]
    assert set(refused) == {"reducer._ddp_graph_static", "_register_fused_optim",
                            "_set_ddp_runtime_logging_sample_rate", "DistributedDataParallel.reducer"}
    for name, message in refused.items():
        assert name in message and "[rank 0]" in message and "torch DDP internal" in message
    assert results[0]["hasattr"] is False


def test_patch_builds_phalanx_ddp_where_torch_ddp_is_named(results):
    """World size 2: under patch_torch_ddp() torch's name builds phalanx's class; after it, torch's again."""
    for result in results:
        assert result["patched"] == ("DistributedDataParallel", "phalanx.engine.ddp", True)
        assert result["unpatched"] == "torch.nn.parallel.distributed"
