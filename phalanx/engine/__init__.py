"""The DDP engine's top layer: the fronts users wrap their models in, and what drives a step.

`ddp.py` is `DistributedDataParallel` (its pickling, state dict and join surfaces mixed in from
`pickling.py`, `state_dict.py`, `join.py`); `fully_sharded.py` is the front of `shard="parameters"`
(torch's FSDP2); `reducer.py` decides when a bucket is ready and launches buckets in order;
`replicas.py` keeps the replicas identical; `diloco/` is `across_hosts=px.DiLoCo(...)`, exact DDP inside a
host and an outer optimizer step across hosts every H steps; `torch_surface.py` (torch DDP's surface that libraries
reach for: `device_ids`, `.reducer`, static graph, logging data), `dist_autograd.py` and
`comm_hook_checks.py` serve the front. How a bucket is averaged is exchange/'s business, and the front only asks
exchange/choose.py for an exchange.

May import: bucket, exchange, sharding, world, nn, diagnose, allocator, errors, log.
"""

from __future__ import annotations

import sys
from types import ModuleType


def _keep_old_paths() -> None:
    """`phalanx.engine.<module>` for the modules that moved out of engine/ (issue 23) still imports, and
    gives the same objects: each old path is the new module, or a module holding the names of the
    modules its content went to."""
    from ..bucket import buckets, shard_levels, shard_plan, step_guard
    from ..exchange import all_reduce, base, comm_hook, phase_timer, sharded, shm, shm_copy_in, shm_sharded
    from ..sharding import full_state, grad_norm, optimizer_view, shard_waits, sharded_optimizer
    from . import torch_surface

    moved = {"buckets": [buckets], "step_guard": [step_guard], "shard_plan": [shard_plan],
             "exchange": [base, all_reduce, comm_hook], "shm_exchange": [shm], "shm_copy_in": [shm_copy_in],
             "sharded_exchange": [sharded, shard_levels], "shm_sharded_exchange": [shm_sharded],
             "phase_timer": [phase_timer], "sharded_optimizer": [sharded_optimizer],
             "optimizer_view": [optimizer_view], "full_state": [full_state], "grad_norm": [grad_norm],
             "shard_waits": [shard_waits], "devices": [torch_surface]}  # devices.py: issue 28
    package = sys.modules[__name__]
    for old, modules in moved.items():
        module = modules[0]
        if len(modules) > 1:
            module = ModuleType(f"{__name__}.{old}", f"Moved (issue 23) to {', '.join(m.__name__ for m in modules)}.")
            for source in modules:
                module.__dict__.update((k, v) for k, v in vars(source).items() if not k.startswith("__"))
        sys.modules[f"{__name__}.{old}"] = module
        setattr(package, old, module)


_keep_old_paths()
