"""Re-target an optimizer built over a module's original parameters at the parameters the wrapped model
trains, in place, as torch DDP users expect when they build the optimizer before wrapping.

`shard="parameters"` replaces every parameter with FSDP2's DTensor shard. The optimizer's param
groups keep their order and options; each original is swapped for its shard, and state the
optimizer already holds for it (Adagrad's accumulators, a state dict loaded before wrapping) is cut
the same way, so the optimizer steps exactly what an optimizer built after wrapping would.
"""

from __future__ import annotations

import torch

from ..errors import StrayOptimizerError, explain
from .dtensor import from_local_like, is_dtensor
from .meta_init import own_rows


def retarget(optimizer: torch.optim.Optimizer, replaced, module: torch.nn.Module, rank: int) -> None:
    """Swap each original parameter in `optimizer` for `replaced[original]`; raise for a tensor `module` lacks."""
    trained = {id(p) for p in module.parameters()}
    names = {id(p): name for name, p in module.named_parameters()}
    for number, group in enumerate(optimizer.param_groups):
        targets = []
        for tensor in group["params"]:
            if id(tensor) in trained:
                targets.append(tensor)
                continue
            target = replaced.get(tensor)
            if target is None:
                raise StrayOptimizerError(explain(
                    f"param group {number} of the {type(optimizer).__name__} holds a tensor this model does not "
                    "train or replace", rank=rank, seen=f"a {_describe(tensor)}",
                    expected="the module's parameters (from before or after wrapping)",
                    fix="Build the optimizer over model.parameters() (or the wrapped module's), and give other "
                        "tensors an optimizer of their own."))
            if tensor in optimizer.state:
                optimizer.state[target] = {key: _cut(value, target, names[id(target)], rank)
                                           for key, value in optimizer.state.pop(tensor).items()}
            targets.append(target)
        group["params"] = targets


def _cut(value, target, name: str, rank: int):
    """A state value for the original parameter, as one for its shard (the DTensor `target`): per-element
    tensors are cut alike."""
    if not isinstance(value, torch.Tensor) or value.shape != target.shape or is_dtensor(value):
        return value
    if value.is_meta:
        raise StrayOptimizerError(explain(
            f"the optimizer holds state for {name!r} on the meta device, which has no values to keep",
            rank=rank, seen=f"a meta tensor of shape {tuple(value.shape)}", expected="state with values",
            fix="Build the optimizer after wrapping (over model.parameters()), once the shards hold values."),
            parameter=name)
    local = torch.empty_like(target.to_local(), dtype=value.dtype)
    local.copy_(own_rows(value.to(target.device), target))
    return from_local_like(local, target)


def _describe(tensor: torch.Tensor) -> str:
    kind = "DTensor" if is_dtensor(tensor) else "tensor"
    return f"{kind} of shape {tuple(tensor.shape)} on {tensor.device}"
