"""No host read in a steady-state DDP step, counted on the CPU: the engine takes the path a GPU takes (its
tag checks off, as StepGuard.reads_back says for a GPU) while every call that reads a tensor back on the
host is counted; after the first step (the one-time bucket rebuild) there must be none but the non-finite
gradient check's verdict: as on a GPU, the step before's, copied to the host on the way and read at the next
optimizer step, which does not wait (on_nonfinite="off": none). A world of one, in-process;
tests/ranks/test_ddp_host_sync.py checks the same on a GPU, where it matters.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.bucket.step_guard import StepGuard
from phalanx.hooks import allreduce_hook

# What reads a tensor's value on the host (on a GPU each waits for the kernels queued before it).
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@contextmanager
def counting_host_reads(calls: list):
    """Count every host read of a tensor (`READS`) made while the block runs: each is a (name, caller) pair."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            calls.append((name, f"{caller.filename}:{caller.lineno}"))
            return original(self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _net() -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm: buffers, so each forward broadcasts them as well.
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _step(model, optimizer, batch) -> None:
    x, y = batch
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


SETTINGS = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "small buckets": {"bucket_cap_mb": 0.001},
    "comm hook": {},
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_steady_step_reads_nothing_back_on_the_host(world_of_one, monkeypatch, setting):
    """World size 1 (in-process Gloo): steps 2-4 of phalanx DDP make no .item() / .tolist() / bool() / ...
    call on a tensor (the non-finite check off: its one read is counted below)."""
    monkeypatch.setattr(StepGuard, "reads_back", lambda self, device: False)  # as on a GPU
    model = phalanx.DistributedDataParallel(_net(), on_nonfinite="off", **SETTINGS[setting])
    if setting == "comm hook":
        model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]
    _step(model, optimizer, batches[0])  # the first step rebuilds the buckets: it may read back
    calls: list = []
    with counting_host_reads(calls):
        for batch in batches[1:]:
            _step(model, optimizer, batch)
    assert calls == [], f"{setting}: host reads in steady-state steps: {calls}"


def test_the_non_finite_check_reads_its_verdict_once_per_step(world_of_one, monkeypatch):
    """World size 1: with the check on (the default), a steady step reads back one thing, the all-reduced flags
    of whether any rank saw a NaN or Inf in the step before, when the optimizer is about to step
    (engine/replicas/nonfinite.py: on a GPU those flags are on the host by then)."""
    monkeypatch.setattr(StepGuard, "reads_back", lambda self, device: False)
    model = phalanx.DistributedDataParallel(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]
    _step(model, optimizer, batches[0])
    calls: list = []
    with counting_host_reads(calls):
        for batch in batches[1:]:
            _step(model, optimizer, batch)
    assert [name for name, _ in calls] == ["tolist"] * 3, calls
    assert all("replicas/nonfinite.py" in where for _, where in calls), calls


def test_the_counter_sees_a_read():
    calls: list = []
    with counting_host_reads(calls):
        torch.ones(1).item()
        bool(torch.ones(1))
    assert [name for name, _ in calls] == ["item", "__bool__"]


class _HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_a_parameter_unused_here_is_looked_up_and_keeps_none(world_of_one, monkeypatch):
    """World size 1: with find_unused_parameters, a parameter this rank left without a gradient needs the
    map read back (the one read a steady step may make; torch's reducer reads it at every step), and a
    parameter no rank used keeps .grad None."""
    monkeypatch.setattr(StepGuard, "reads_back", lambda self, device: False)
    model = phalanx.DistributedDataParallel(_HalfUsed(), find_unused_parameters=True, on_nonfinite="off")
    calls: list = []
    for step in range(3):
        model.zero_grad()
        with counting_host_reads(calls) if step == 2 else nullcontext():
            model(torch.randn(2, 4)).sum().backward()
    assert [name for name, _ in calls] == ["tolist"]
    assert model.module.unused.weight.grad is None and model.module.used.weight.grad is not None
