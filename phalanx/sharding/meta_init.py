"""Materialize a model built on the meta device as FSDP2 shards, one module at a time, so no rank ever
holds the whole model (`shard="parameters"`).

The model is sharded while it is still meta (no memory), the shards are allocated, and then each
module's own tensors are filled in: the module gets whole, plain stand-ins for its parameters and
buffers, on the CPU, initializes them as a normal build would (its `reset_parameters()`, children
before parents, which is the order their constructors ran), and each rank keeps its slice of each
on its device. The random numbers are drawn in the same order and on the same generator as when the
model is built on the CPU, so with the same seed the shards equal the normally built model's,
bitwise. A model with its own init passes `init=callable(module)`; `init=state_dict` copies saved weights, e.g.
`phalanx.load_weights(path, mmap=True)`: memory-mapped, each rank reads only its slices.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..errors import ShardingError, explain
from .dtensor import is_dtensor, local_region


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def check_all_meta(module: torch.nn.Module, rank: int) -> None:
    """A model is built on meta entirely or not at all: materializing would wipe tensors that hold values."""
    real = [name for name, t in list(module.named_parameters()) + list(module.named_buffers()) if not t.is_meta]
    if real:
        raise ShardingError(explain(
            "shard='parameters' takes a model built entirely on the meta device, or entirely on a real one",
            rank=rank, seen=f"meta tensors beside real ones ({', '.join(real[:5])}{', ...' if len(real) > 5 else ''})",
            expected="every parameter and buffer on meta",
            fix="Build the whole model under `with torch.device('meta'):`, or none of it."))


def initializer(init, rank: int):
    """What fills one module's own tensors (given as whole stand-ins): its `reset_parameters()`, as torch's
    layers run it in their constructors, then `init(module)` if given; or the values of a state dict."""
    if isinstance(init, Mapping):
        return StateDictSource(init, rank)
    if init is not None and not callable(init):
        raise ShardingError(explain("init= is a function of one module, or a state dict of whole tensors",
                                    rank=rank, seen=f"a {type(init).__name__}", expected="a callable or a mapping",
                                    fix="Pass init=my_init (called once per module) or "
                                        "init=phalanx.load_weights('weights.safetensors', mmap=True)."))

    def fill(module: torch.nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if reset is not None:
            reset()
        elif init is None:
            own = [n for n, _ in module.named_parameters(recurse=False)]
            own += [n for n, _ in module.named_buffers(recurse=False)]
            raise ShardingError(explain(
                f"cannot initialize {type(module).__name__}'s tensors {own} built on the meta device: the module "
                "has no reset_parameters()", rank=rank, seen=type(module).__name__,
                expected="torch layers (Linear, Embedding, LayerNorm, Conv*, ...), or an init= function",
                fix="Pass init=fn to DistributedDataParallel, where fn(module) fills the module's own tensors "
                    "(module.named_parameters(recurse=False)); see docs/sharding.md."))
        if init is not None:
            init(module)

    return fill


@torch.no_grad()
def materialize(module: torch.nn.Module, device: torch.device, fill, group, sync: bool) -> None:
    """Allocate the shards of a meta model already passed to fully_shard, then fill every module's own tensors
    (see the module docstring). With `sync`, each whole stand-in is rank 0's (broadcast) before it is cut."""
    module.to_empty(device=device)
    _retie(module)
    source = dist.get_global_rank(group, 0)
    done: set[int] = set()
    for prefix, sub in _children_first(module):
        own = [(n, t, "_parameters") for n, t in sub._parameters.items() if t is not None] + \
              [(n, t, "_buffers") for n, t in sub._buffers.items() if t is not None]
        if not own:
            continue
        if isinstance(fill, StateDictSource):
            fill.fill(prefix, own, done)
            continue
        # On the CPU, as a normal build runs before `.to(device)`: the same generator, so the same numbers.
        # A DTensor's shape is the whole tensor's.
        stand_ins = {name: torch.empty(t.shape, dtype=t.dtype) for name, t, _ in own}
        with _swapped(sub, own, stand_ins):
            fill(sub)
        for name, tensor, _ in own:
            if id(tensor) in done:  # tied: its first owner filled it (this draw kept the random order)
                continue
            done.add(id(tensor))
            whole = stand_ins[name].to(device)
            if sync:
                dist.broadcast(whole, source, group=group)
            if is_dtensor(tensor):
                tensor.to_local().copy_(own_rows(whole, tensor))
            else:
                tensor.copy_(whole)


def _retie(module: torch.nn.Module) -> None:
    """`to_empty` allocates a parameter tied between modules once per module; FSDP2 tracks the first owner's:
    point the other owners at it again, as the meta model had them."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        state = sub._get_fsdp_state() if isinstance(sub, FSDPModule) else None
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            for param in group.fsdp_params:
                info = param._module_info
                for other, name in zip(info.shared_modules, info.shared_param_names):
                    other._parameters[name] = param.sharded_param


def own_rows(whole: torch.Tensor, like) -> torch.Tensor:
    """This rank's slice of `whole`, cut as the DTensor `like` is (a view: nothing else of `whole` is read)."""
    shape, offset = local_region(like)
    index = tuple(slice(start, start + length) for start, length in zip(offset, shape))
    return whole[index]


def _children_first(module: torch.nn.Module, prefix: str = ""):
    """(qualified name, module), every submodule after its own children: the order their constructors finish."""
    for name, child in module._modules.items():
        if child is not None:
            yield from _children_first(child, f"{prefix}{name}.")
    yield prefix, module


@contextmanager
def _swapped(module: torch.nn.Module, own: list, stand_ins: dict):
    """The module holds whole plain tensors (parameters stay Parameters) while its init runs on them."""
    for name, tensor, table in own:
        stand_in = stand_ins[name]
        if table == "_parameters":
            stand_in = torch.nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
            stand_ins[name] = stand_in
        getattr(module, table)[name] = stand_in
    try:
        yield
    finally:
        for name, tensor, table in own:
            getattr(module, table)[name] = tensor
            stand_ins[name] = stand_ins[name].detach()


class StateDictSource:
    """Whole tensors by name (a state dict, e.g. `phalanx.load_weights(path, mmap=True)`): a rank copies its
    slice of each, and from a memory-mapped file reads only those pages."""

    def __init__(self, state: Mapping, rank: int):
        self.state, self.rank = state, rank

    def tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        value = self.state.get(name)
        if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
            seen = "no such tensor" if value is None else \
                f"{getattr(value, 'dtype', type(value).__name__)} {list(getattr(value, 'shape', []))}"
            raise ShardingError(explain(f"init= does not hold {name!r} as the model does", rank=self.rank,
                                        seen=seen, expected=f"{like.dtype} {list(like.shape)}",
                                        fix="Pass the weights of this model (phalanx.export_weights writes them)."))
        return value

    def fill(self, prefix: str, own: list, done: set) -> None:
        for name, tensor, _ in own:
            if id(tensor) in done:
                continue
            done.add(id(tensor))
            source = self.tensor(prefix + name, tensor)
            if is_dtensor(tensor):
                tensor.to_local().copy_(own_rows(source, tensor))
            else:
                tensor.copy_(source)
