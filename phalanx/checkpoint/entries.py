"""What a checkpoint's state entries are: models (saved unwrapped), objects with a state_dict, plain values.

A plain value must load back with `weights_only=True`, so anything else is refused at save time with
an error naming the entry; a model is saved without its DDP or torch.compile wrappers, so its keys
load into a wrapped or unwrapped model alike.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..errors import CheckpointValueError, explain
from ..world import group as world

_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple, set)
_SHOWN_KEYS = 10


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel (torch's or phalanx's) and torch.compile wrappers, so a
    checkpoint holds the plain model's keys and loads into a compiled or uncompiled model alike."""
    while isinstance(model, torch.nn.Module):
        if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif _is_wrapper(model):
            model = model.module
        else:
            break
    return model


def _is_wrapper(model: torch.nn.Module) -> bool:
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return True
    try:
        from ..engine.ddp import DistributedDataParallel
    except ImportError:  # the engine is optional for checkpointing
        return False
    return isinstance(model, DistributedDataParallel)


def differs_across_hosts(value) -> bool:
    """Whether a state entry differs between hosts now: a model with `across_hosts=DiLoCo(...)` on several hosts, or
    its `outer_step` (each host's parameters and inner optimizer state are its own between outer steps)."""
    return getattr(getattr(value, "outer_step", value), "spans_hosts", False) is True


def kind_of(name: str, value) -> str:
    if isinstance(value, torch.nn.Module):
        return "model"
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "object"
    check_plain(value, f"state[{name!r}]")
    return "value"


def state_dict_of(value, kind: str) -> dict:
    """The state a checkpoint holds of an entry of kind "model" (the module inside any DDP wrapper, so that its
    keys are plain) or "object"."""
    return unwrap(value).state_dict() if kind == "model" else value.state_dict()


def check_plain(value, where: str) -> None:
    """Raise CheckpointValueError unless `value` is made of tensors and plain Python values only."""
    kind = type(value)
    if kind in _PLAIN_LEAVES or kind in (torch.Tensor, torch.nn.Parameter):
        return
    if kind in _PLAIN_CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict):
                check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
        return
    hint = " (convert NumPy values with .item() or torch.as_tensor())" if kind.__module__.startswith("numpy") else ""
    raise CheckpointValueError(explain(
        f"{where} cannot be saved in a checkpoint that loads safely", rank=world.group_rank(),
        seen=f"a {kind.__qualname__}",
        expected="tensors, numbers, strings, bytes, None, and lists/tuples/dicts/sets of them, "
                 "or an object with state_dict()/load_state_dict()",
        fix=f"Store the value as one of those{hint}."))


def listed(keys: list) -> str:
    shown = ", ".join(str(k) for k in keys[:_SHOWN_KEYS])
    more = len(keys) - _SHOWN_KEYS
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}]"
