"""Layers, batches and generators shared by the SyncBatchNorm tests of tests/unit and tests/ranks."""

from __future__ import annotations

import zlib

import torch

C = 3
STEPS = 2
TOL = dict(rtol=1e-9, atol=1e-10)
CL = {4: torch.channels_last, 5: torch.channels_last_3d}

# sizes: samples per rank (per member of `members` when given); tail: dimensions after (N, C).
DEFAULT = dict(tail=(), affine=True, bias=True, momentum=0.1, track=True, channels_last=False, members=None)


def generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def batch(name, spec, step):
    """The whole group's batch for one step and the fixed weights of its loss (out * weights).sum()."""
    g = generator(name, step)
    shape = (sum(spec["sizes"]), C) + spec["tail"]
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 3  # an offset: the mean matters
    return x, torch.randn(shape, generator=g, dtype=torch.float64)


def make_layer(cls, name, spec, **extra):
    layer = cls(C, momentum=spec["momentum"], affine=spec["affine"], track_running_stats=spec["track"],
                dtype=torch.float64, bias=spec["bias"], **extra)
    if spec["affine"]:
        g = generator(name, "params")
        with torch.no_grad():
            layer.weight.copy_(torch.rand(C, generator=g, dtype=torch.float64) + 0.5)
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(C, generator=g, dtype=torch.float64))
    return layer
