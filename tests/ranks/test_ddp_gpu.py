"""NCCL on CUDA tensors: phalanx DDP equals torch DDP and keeps replicas identical.

Runs one rank per visible GPU (at most 2); skipped where there is no GPU or no NCCL.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import phalanx

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs a CUDA GPU and NCCL")


def _cuda_versus_torch(rank: int) -> dict:
    device = phalanx.device()
    results = {}
    for wrapper in (phalanx.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 8)).to(device)
        model = wrapper(net, device_ids=[device.index], bucket_cap_mb=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        identical = True
        for step in range(8):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)  # inputs move to device_ids[0]
            F.mse_loss(out.float(), y.to(device)).backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            reference = flat.clone()
            dist.broadcast(reference, 0)
            identical &= bool(torch.equal(flat, reference))
        results[wrapper.__module__] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu(), identical)
    ours, theirs = results["phalanx.engine.ddp"], results["torch.nn.parallel.distributed"]
    return {"diff": (ours[0] - theirs[0]).abs().max().item(), "identical": ours[1]}


def test_nccl_phalanx_matches_torch_ddp():
    """World size: one rank per visible GPU, at most 2 (NCCL); skipped without a GPU."""
    world = min(2, torch.cuda.device_count())
    results = phalanx.spawn(_cuda_versus_torch, world, timeout=300, env={"PHALANX_BACKEND": "nccl"})
    for outcome in results:
        assert outcome["identical"]
        assert outcome["diff"] < 1e-5
