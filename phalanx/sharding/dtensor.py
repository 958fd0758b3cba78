"""DTensor questions asked without importing DTensor: only runs that shard parameters pay for it.

torch.distributed.tensor (and FSDP2, built on it) costs about 1 s of CPU to import, in every
process that imports phalanx: each worker at each start, each rank of a test. A tensor can only be
a DTensor once that module is loaded, so `is_dtensor` looks in sys.modules first, and the code that
builds DTensors imports them where it does.
"""

from __future__ import annotations

import sys

import torch

_MODULE = "torch.distributed.tensor"


def is_dtensor(value) -> bool:
    """isinstance(value, DTensor), without importing DTensor when nothing could be one."""
    module = sys.modules.get(_MODULE)
    dtensor = getattr(module, "DTensor", None)  # None also while the module is still being imported
    return dtensor is not None and isinstance(value, dtensor)


def local_region(like) -> tuple[list[int], list[int]]:
    """(shape, global offset) of this rank's part of the DTensor `like`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return [int(n) for n in shape], [int(o) for o in offset]


def from_local_like(local: torch.Tensor, like):
    """A DTensor of `like`'s mesh, placements, shape and stride holding this rank's part `local`."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())
