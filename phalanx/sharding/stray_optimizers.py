"""No silent stray optimizer: a torch optimizer that steps tensors a sharded model does not train fails
loudly at its first step.

Two ways an optimizer can miss the model. `shard="parameters"` replaces the module's parameters with
FSDP2's DTensor shards, so an optimizer built over the originals (before wrapping, as torch DDP
scripts do) steps tensors nothing reads. At `"optimizer"` and `"gradients"` the parameters stay, but
only `model.shard_optimizer(opt)` steps them right (each rank its chunk, then the all-gather); the
bare optimizer would step partial or missing gradients. Sharded models register those tensors here;
one global step pre-hook checks each optimizer once (again if its parameter count changes).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import StrayOptimizerError, explain

# tensor -> (parameter name, why the bare optimizer may not step it, what to do)
_registry: WeakIdKeyDictionary = WeakIdKeyDictionary()
_checked: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> its parameter count when checked
_hook = None


def forbid(tensors_by_name: dict, why: str, fix: str) -> None:
    """No bare torch optimizer may step these tensors (name -> tensor): `why` and `fix` go in the error."""
    global _hook
    for name, tensor in tensors_by_name.items():
        _registry[tensor] = (name, why, fix)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_step)
    _checked.clear()  # optimizers passed before may hold what was just registered


def allow(tensors) -> None:
    """Forget these tensors (the same parameters wrapped again, unsharded)."""
    for tensor in tensors:
        _registry.pop(tensor, None)


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    for number, group in enumerate(optimizer.param_groups):
        for tensor in group["params"]:
            entry = _registry.get(tensor)
            if entry is not None:
                name, why, fix = entry
                raise StrayOptimizerError(explain(
                    f"{type(optimizer).__name__}.step() would update parameter {name!r} (param group {number}) "
                    f"directly: {why}", rank=_rank(),
                    seen=f"a tensor of shape {tuple(tensor.shape)}", expected="the parameters the model trains",
                    fix=fix), parameter=name)
    _checked[optimizer] = count


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def guard_level(named: list, shard: str) -> None:
    """At shard="optimizer" / "gradients" only the optimizer shard_optimizer() returns may step the model's
    parameters; unsharded, any optimizer may (the same parameters may have been sharded before)."""
    if shard == "none":
        allow(p for _, p in named)
    else:
        forbid(dict(named), f"at shard={shard!r} each rank updates its own chunk of it and then the chunks are "
               "all-gathered, which the optimizer model.shard_optimizer(optimizer) returns does",
               "Step the optimizer that model.shard_optimizer(optimizer) returns (optimizer = "
               "model.shard_optimizer(optimizer)).")
