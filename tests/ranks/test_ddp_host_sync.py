"""No host synchronization in a steady-state DDP step on a GPU: a long kernel is queued first, and several
steps of phalanx DDP must be queued on the host before it ends, the non-finite gradient check on (by default it
reads each verdict at the next optimizer step, copied to the host on the way) or off; on_nonfinite="skip" must
read it before the step, and waits for the backward (shown beside). Skipped without a GPU; on every machine,
tests/unit/test_host_sync.py counts the host reads of the same steps on the CPU.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import phalanx


def _net(device) -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm: buffers, so each forward broadcasts them as well.
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).to(device)


def _step(model, optimizer, batch) -> None:
    x, y = batch
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


# -- on a GPU ---------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                               reason="needs a CUDA GPU and NCCL: that a steady step never waits for the GPU only a "
                                      "GPU can show (tests/unit/test_host_sync.py counts host reads on the CPU)")
QUEUED_STEPS = 4


def _cycles_per_ms(device) -> float:
    """torch.cuda._sleep's clock: cycles per millisecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def _runs_ahead(rank: int) -> dict:
    device = phalanx.device()
    results = {}
    cycles_per_ms = _cycles_per_ms(device)
    for wrapper, options in ((torch.nn.parallel.DistributedDataParallel, {}),
                             (phalanx.DistributedDataParallel, {}),
                             (phalanx.DistributedDataParallel, {"find_unused_parameters": True}),
                             (phalanx.DistributedDataParallel, {"gradient_as_bucket_view": True}),
                             (phalanx.DistributedDataParallel, {"on_nonfinite": "off"}),
                             (phalanx.DistributedDataParallel, {"on_nonfinite": "skip"})):
        model = wrapper(_net(device), device_ids=[device.index], **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator(device=device).manual_seed(rank)
        batches = [(torch.randn(8, 16, generator=g, device=device), torch.randn(8, 4, generator=g, device=device))
                   for _ in range(QUEUED_STEPS)]
        for batch in batches[:2]:  # the first step rebuilds the buckets (it may wait); the second is warm
            _step(model, optimizer, batch)
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for batch in batches:
            _step(model, optimizer, batch)
        host_ms = (time.perf_counter() - started) * 1e3  # what the steps cost the host, measured first
        # The long kernel: far longer than queueing the steps takes. Then the same steps, queued behind it.
        sleep_ms = max(2000.0, 50 * host_ms)
        slept = torch.cuda.Event()
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        slept.record()
        for batch in batches:
            _step(model, optimizer, batch)
        queued_ms = (time.perf_counter() - started) * 1e3
        still_sleeping = not slept.query()
        torch.cuda.synchronize(device)
        name = f"{wrapper.__module__}{options}"
        results[name] = {"sleep_ms": sleep_ms, "host_ms": host_ms, "queued_ms": queued_ms,
                         "ran_ahead": still_sleeping and queued_ms < sleep_ms / 2}
        del model, optimizer
    return results


@needs_gpu
def test_the_host_queues_steady_steps_ahead_of_the_gpu(capsys):
    """World size 1 (NCCL); skipped without a GPU. Behind a 2 s (or longer) kernel, 4 steady steps of phalanx
    DDP are all queued before the kernel ends: no step waited for the device. torch DDP is shown beside
    (its find_unused_parameters reads the map every step; phalanx's only when a parameter went unused)."""
    [results] = phalanx.spawn(_runs_ahead, 1, timeout=300, env={"PHALANX_BACKEND": "nccl"})
    with capsys.disabled():
        for name, figures in results.items():
            print(f"\n{name}: {figures}")
    for name, figures in results.items():
        if name.startswith("phalanx") and "'skip'" not in name:
            assert figures["ran_ahead"], f"{name}: a steady step waited for the GPU: {figures}"
