"""Sharded DDP on CUDA tensors over NCCL, world size 1: each shard level (FSDP2's "parameters" too)
trains as shard='none' does, and holds less GPU memory (torch.cuda.max_memory_allocated, printed).
Skipped without a GPU."""

import gc

import pytest
import torch
import torch.distributed as dist

import phalanx
from tests.helpers.shard_cases import whole_parameters

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs a CUDA GPU and NCCL")


def _train_cuda(rank: int) -> dict:
    device = phalanx.device()
    results = {}
    for mode in ("none", "optimizer", "gradients", "parameters"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(device)
        model = phalanx.DistributedDataParallel(net, device_ids=[device.index], shard=mode, bucket_cap_mb=4)
        opt = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
        for step in range(10):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 1024, generator=g).to(device)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            model.clip_grad_norm_(1.0)
            opt.step()
        torch.cuda.synchronize(device)
        results[mode] = (torch.cat([p.detach().reshape(-1) for p in whole_parameters(model)]).cpu(),
                         torch.cuda.max_memory_allocated(device))
        # The next level's peak must not count this one's leftovers: phalanx's levels free at `del`
        # (test_sharding_features), FSDP2's "parameters" module only at a collection.
        del model, opt, net
        gc.collect()
    return results


def test_shard_modes_on_cuda_match_none_and_hold_less_memory(capsys):
    """World size 1 (NCCL); skipped without a GPU."""
    [results] = phalanx.spawn(_train_cuda, 1, timeout=300, env={"PHALANX_BACKEND": "nccl"})
    reference, reference_bytes = results["none"]
    with capsys.disabled():
        print(f"\nmax_memory_allocated: none {reference_bytes / 2**20:.1f} MiB")
    for mode in ("optimizer", "gradients", "parameters"):
        params, peak = results[mode]
        torch.testing.assert_close(params, reference, rtol=1e-5, atol=1e-6)
        with capsys.disabled():
            print(f"max_memory_allocated: {mode} {peak / 2**20:.1f} MiB ({peak / reference_bytes:.3f} of none)")
        if mode != "parameters":  # at world size 1, FSDP2 shards nothing: its figure is printed, not bounded
            assert peak < reference_bytes


def _meta_on_cuda(rank: int) -> bool:
    device = phalanx.device()
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).to(device)
    torch.manual_seed(0)
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    model = phalanx.DistributedDataParallel(net, device_ids=[device.index], shard="parameters")
    got = whole_parameters(model)
    return all(a.device == device and torch.equal(a, b) for a, b in zip(got, expected.parameters()))


def test_meta_build_on_cuda_equals_the_cpu_build_moved():
    """World size 1 (NCCL); skipped without a GPU: initialized on the CPU's generator, as a normal build, then
    each rank's slices go to its GPU."""
    assert phalanx.spawn(_meta_on_cuda, 1, timeout=300, env={"PHALANX_BACKEND": "nccl"}) == [True]
