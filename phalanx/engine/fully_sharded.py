"""`shard="parameters"`: torch's FSDP2 (`fully_shard`) behind phalanx's DistributedDataParallel surface.

For models whose parameters alone crowd a device, each rank keeps one dim-0 shard of every
parameter, gradient and optimizer state tensor (16 bytes per parameter / N with AdamW in fp32);
FSDP2 all-gathers a block's parameters before its forward and backward and reduce-scatters its
gradients after. phalanx does not reimplement that engine: it applies `fully_shard` per block (the
class the user names, or the repeated submodules it finds), then to the root, and gives the result
the same training loop as the other levels: `shard_optimizer`, `clip_grad_norm_`, `no_sync`, and
checkpoints in the unsharded formats (full_state.py), so they restore at any world size and level.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import allocator
from ..bucket.shard_levels import unsupported_with_sharding
from ..errors import ShardingError, explain
from ..sharding.cpu_collectives import hold_less
from ..sharding.full_state import full_model_state, load_full_model_state, whole
from ..sharding.meta_init import check_all_meta, has_meta_tensors, initializer, materialize
from ..sharding.optimizer_view import OptimizerView
from ..sharding.param_retarget import retarget
from ..sharding.stray_optimizers import forbid
from ..world import generation
from .ddp import DistributedDataParallel
from .replicas.audit import check_settings
from .torch_surface import check_device_ids, check_ready_to_wrap, move_to

PARAMETERS = "parameters"


def choose_blocks(module: torch.nn.Module, blocks=None) -> list[torch.nn.Module]:
    """The submodules to shard one by one: instances of `blocks` (a class or a tuple of them), else the
    coarsest class of submodules that repeats and holds at least half the parameters the repeating
    classes hold (a transformer's blocks rather than their Linear layers). Outermost instances only."""
    children = [m for name, m in module.named_modules() if name]
    if blocks is None:
        sizes: Counter = Counter()
        counts: Counter = Counter()
        for sub in children:
            owned = sum(p.numel() for p in sub.parameters())
            if owned:
                sizes[type(sub)] += owned
                counts[type(sub)] += 1
        repeated = {kind: size for kind, size in sizes.items() if counts[kind] >= 2}
        if not repeated:
            return []
        best = max(repeated.values())
        blocks = min((kind for kind, size in repeated.items() if size >= best / 2), key=lambda kind: counts[kind])
    chosen = []
    for sub in children:
        if isinstance(sub, blocks) and not any(sub in set(outer.modules()) for outer in chosen):
            chosen.append(sub)
    return chosen


class ParameterShardedDDP(DistributedDataParallel, level=PARAMETERS):
    """What `DistributedDataParallel(module, shard="parameters")` returns (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, shard: str = PARAMETERS, shard_blocks=None,
                 reshard_after_forward: bool = True, init=None, audit_every: int | None = None, audit: str = "heal",
                 on_nonfinite: str = "raise", across_hosts=None, **unsupported):
        torch.nn.Module.__init__(self)
        Joinable.__init__(self)
        check_ready_to_wrap(unsupported)
        # No replica to audit: each rank holds its own shard of everything (docs/audit.md); FSDP2's backward
        # is torch's, so the non-finite check has no bucket to read either.
        check_settings(audit_every, audit, on_nonfinite, dist.get_rank())
        self._audit = None
        if gradient_as_bucket_view:
            raise unsupported_with_sharding("gradient_as_bucket_view", shard, "FSDP2 keeps gradient shards of its "
                                            "own: drop gradient_as_bucket_view.")
        if across_hosts is not None:
            raise unsupported_with_sharding(f"across_hosts={across_hosts!r}", shard,
                                            "Use shard='none' with DiLoCo (sharded levels inside a host come later).")
        self.shard = shard
        self.outer_step = None
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank()
        allocator.warn_if_glibc(shard, rank)  # FSDP2's transients fragment glibc's heap (allocator/)
        meta = has_meta_tensors(module)
        if meta:
            check_all_meta(module, rank)
            fill = initializer(init, rank)
        elif init is not None:
            raise ShardingError(explain(
                "init= initializes a model built on the meta device; this one holds its values already", rank=rank,
                seen=f"init={init!r} with parameters on {next(module.parameters()).device}",
                expected="a model built under `with torch.device('meta'):`",
                fix="Drop init=, or build the model on the meta device so that no rank holds it whole."))
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1:
            raise ShardingError(explain(
                "shard='parameters' needs the whole model on one device", rank=rank,
                seen=sorted(str(d) for d in devices), expected="one device",
                fix="Move the model to this rank's device first, or use shard='gradients'."))
        self.device = _meta_target(device_ids) if meta else next(iter(devices))
        self.device_ids = check_device_ids(device_ids, {self.device})
        self.output_device, self.dim = output_device, dim
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        if init_sync and not meta:  # every rank starts from rank 0's weights, as with the other levels
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor.data, dist.get_global_rank(self.process_group, 0), group=self.process_group)
        originals = dict(module.named_parameters())  # what an optimizer built before wrapping holds
        self.mesh = DeviceMesh.from_group(self.process_group, self.device.type)
        self.blocks = choose_blocks(module, shard_blocks)
        for block in self.blocks:
            fully_shard(block, mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        self.module = fully_shard(module, mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        hold_less(self.blocks + [self.module], self.device, self.process_group)
        if meta:  # one module's whole tensors at a time, never the model's
            materialize(self.module, self.device, fill, self.process_group, sync=init_sync)
        trained = dict(self.module.named_parameters())
        self._replaced = WeakIdKeyDictionary({p: trained[name] for name, p in originals.items()})
        forbid(originals, "shard='parameters' replaced it with this rank's shard, a DTensor in model.parameters()",
               "Pass the optimizer through model.shard_optimizer(optimizer), which re-targets it, or build it "
               "over model.parameters() after wrapping.")
        self._reducer = None
        if generation.live_recovery():  # said before the loader says the loop could recover: this level cannot
            generation.say_mode(False, "shard='parameters' keeps no copy of a rank's shards (shard='optimizer' and "
                                       "'gradients' do)")

    def forward(self, *inputs, **kwargs):
        if self.device_ids:
            inputs, kwargs = move_to(inputs, self.device), move_to(kwargs, self.device)
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, unsharded (FSDP2 reduce-scatters them at the next synchronized backward)."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, **_ignored) -> FullStateOptimizer:
        """`optimizer` re-targeted at the parameters this model trains (FSDP2's DTensor shards), with state dicts
        in the unsharded format: checkpoints that restore at any world size and shard level. An optimizer built
        over the module's parameters before wrapping (torch DDP's order) is re-targeted in place: its param
        groups, their options and any state it holds follow the parameters."""
        FullStateOptimizer._check_wrappable(optimizer, dist.get_rank(self.process_group))
        retarget(optimizer, self._replaced, self.module, dist.get_rank(self.process_group))
        return FullStateOptimizer(optimizer, self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """torch's clip_grad_norm_ over the sharded gradients; returns the whole model's norm (a plain tensor)."""
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type, error_if_nonfinite,
                                              foreach)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        torch.nn.Module.zero_grad(self, set_to_none)

    def state_dict(self, *args, **kwargs):
        """Collective: whole tensors under torch DDP's keys ('module.x'), as an unsharded model gives them; every
        rank receives them all. To save, phalanx.Checkpointer (no gathering) or export_weights (one at a time)."""
        whole_state = full_model_state(self.module, to=None, rank=dist.get_rank(self.process_group))
        return type(whole_state)(("module." + key, value) for key, value in whole_state.items())

    def _load_plain(self, target: torch.nn.Module, plain: dict, strict: bool, assign: bool):
        """Whole tensors (a checkpoint of any level) are cut into this rank's shards; DTensors load as they are."""
        if any(isinstance(value, DTensor) for value in plain.values()):
            return target.load_state_dict(plain, strict=strict, assign=assign)
        own = target.state_dict()
        missing = [key for key in own if key not in plain]
        unexpected = [key for key in plain if key not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(target).__name__}: missing keys "
                               f"{missing}, unexpected keys {unexpected}")
        load_full_model_state(target, {key: value for key, value in plain.items() if key in own})
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def register_comm_hook(self, state, hook) -> None:
        raise unsupported_with_sharding("register_comm_hook", self.shard, "FSDP2 does the exchange; use "
                                        "shard='none' for comm hooks.")

    def join(self, *args, **kwargs):
        raise unsupported_with_sharding("join()", self.shard, "Give every rank the same number of batches "
                                        "(phalanx.DistributedSampler does), or use shard='none'.")

    def __getstate__(self):
        raise ShardingError(explain("a shard='parameters' model cannot be pickled or copied: its parameters are "
                                    "shards tied to this process group", rank=dist.get_rank(),
                                    fix="Save model.state_dict() (or use phalanx.Checkpointer / export_full)."))


def _meta_target(device_ids) -> torch.device:
    """Where a meta model's shards go: the GPU in device_ids, else this rank's device (phalanx.device(), or
    the current GPU under NCCL when torch.distributed was set up without phalanx), else the CPU."""
    if device_ids:
        chosen = device_ids[0]
        return torch.device("cuda", chosen) if isinstance(chosen, int) else torch.device(chosen)
    from ..world import group as world

    if world.is_initialized():
        return world.device()
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class FullStateOptimizer(OptimizerView):
    """A torch optimizer over FSDP2's DTensor parameters whose state dicts hold whole tensors, in torch's
    format: they load into an unsharded optimizer, and come back from one, at any world size."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: ParameterShardedDDP):
        rank = dist.get_rank(model.process_group)
        self._check_wrappable(optimizer, rank)
        self._wrap(optimizer, rank)
        self.group, self.device = model.process_group, model.device

    def _overflowed(self, scaler) -> bool:
        return self._overflowed_anywhere(scaler, self.group, self.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self, to: int | None = None) -> dict | None:
        """Collective: torch's optimizer state dict with whole tensors, for rank `to` (None: every rank)."""
        inner = self.optimizer.state_dict()
        keep = to is None or to == self.rank
        state = {}
        for index in sorted(inner["state"]):  # the same order on every rank: each whole() is collective
            entry = {key: whole(value, keep) for key, value in inner["state"][index].items()}
            if keep:
                state[index] = entry
        return {"state": state, "param_groups": inner["param_groups"]} if keep else None

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's optimizer state dict with whole tensors (from any run): each rank keeps its shards."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {}
        for index, entry in state_dict["state"].items():
            param = params[index] if index < len(params) else None
            state[index] = {key: _shard_like(value, param) for key, value in entry.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        self._rebind()


def _shard_like(value, param):
    """A saved state value for a DTensor parameter: its shard of a whole per-element tensor."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
            and value.shape == param.shape:
        return distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return value
