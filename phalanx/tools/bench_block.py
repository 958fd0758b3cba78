"""One timed block of training steps on every rank, shared by `phalanx bench` and `phalanx bench --memory`.

Every rank starts the block at a barrier and times each step; a synchronous step is as slow as its
slowest rank, so a block reports, per step, the slowest rank's time.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..world import group as world


def train_step(module, optimizer, batch, loss_fn) -> None:
    """One training step, as every variant and benchmark times it."""
    optimizer.zero_grad(set_to_none=True)
    inputs, target = batch
    loss_fn(module(inputs), target).backward()
    optimizer.step()


def _slowest_rank(times_ms: list[float], device: torch.device) -> list[float]:
    """Per step, the time of the slowest rank (a synchronous step is as slow as its slowest rank)."""
    local = torch.tensor(times_ms, dtype=torch.float64, device=device)
    if dist.get_world_size() == 1:
        return local.tolist()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).max(dim=0).values.tolist()


def run_block(module, optimizer, bench_model, batches, warmup: int, steps: int, device: torch.device) -> list[float]:
    """`warmup` untimed steps, then `steps` timed together on every rank: per step, the slowest rank's ms."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    world.barrier(name="bench-block")
    for i in range(warmup):
        train_step(module, optimizer, batches[i % len(batches)], bench_model.loss)
    sync()
    # Start the timed steps together, so that ranks without communication (compute-only) share
    # the cores the way they do in the DDP variants.
    world.barrier(name="bench-timed")
    times = []
    for i in range(steps):
        batch = batches[(warmup + i) % len(batches)]
        start = time.perf_counter()
        train_step(module, optimizer, batch, bench_model.loss)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return _slowest_rank(times, device)
