"""`phalanx.DistributedDataParallel`: torch's DDP interface on phalanx's own gradient engine.

The constructor checks that every rank holds the same model, copies rank 0's parameters and
buffers to all, and builds the reducer (reducer.py) with the exchange that exchange/choose.py picks
(shared memory on one host, else the process group); forward broadcasts buffers and arms the
reducer, which has the exchange average gradients during backward. Four surfaces are mixed in
from modules of their own: pickling and deepcopy (pickling.py), state dicts (state_dict.py),
`join()` for ranks with fewer batches (join.py), what libraries built on torch's class reach for
(`.reducer`, `_set_static_graph`, `_get_ddp_logging_data`, ...: torch_surface.py), and `regroup()` onto
the ranks left after a loss (regroup.py). While the module
runs, torch.compile's Dynamo sees this DDP as torch DDP's, so compiled graphs are split at bucket
boundaries and backward still overlaps communication.
"""

from __future__ import annotations

import importlib
import itertools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from ..bucket.buckets import FIRST_BUCKET_BYTES, sparse_indices
from ..bucket.shard_levels import OPTIMIZER, check_shard, unsupported_with_sharding
from ..bucket.step_guard import StepGuard
from ..diagnose import recorder
from ..errors import NoTrainableParametersError, explain
from ..exchange.choose import choose_exchange
from ..log import logger
from ..nn.sync_batchnorm import replace_torch_sync_batchnorm
from ..sharding.grad_norm import clip_sharded_grad_norm_
from ..sharding.shard_waits import install_gather_waits
from ..sharding.sharded_optimizer import ShardedOptimizer
from ..sharding.stray_optimizers import guard_level
from ..world import generation
from ..world.group import collective_device, live_group
from ..world.topology import HostGroups, host_topology
from .comm_hook_checks import check_comm_hook
from .diloco import split_across_hosts
from .dist_autograd import current_context
from .join import SYNCS_BUFFERS, SYNCS_GRADIENTS, JoinMixin, announce_sync, count_active_ranks, find_common_rank
from .pickling import PicklingMixin
from .reducer import Reducer, unused_parameters_error
from .regroup import RegroupMixin
from .replicas import broadcast_coalesced, check_same_signature, shared_states, synced_buffers, trained
from .replicas.audit import ReplicaAudit, check_settings
from .state_dict import StateDictMixin
from .torch_surface import TorchSurfaceMixin, check_device_ids, check_ready_to_wrap, ignored_names, move_to

DEFAULT_BUCKET_CAP_MB = 25
_instances = itertools.count()  # names each DDP's keys in the store; same order on every rank
# Shard levels that another front implements, registered by that subclass itself (so this module
# imports none of them), and the module of each: imported when a model first asks for its level, since
# FSDP2 and DTensor cost about 1 s of CPU to import in every process (sharding/dtensor.py).
_LEVELS: dict[str, type] = {}
_LEVEL_MODULES = {"parameters": "phalanx.engine.fully_sharded"}


class DistributedDataParallel(PicklingMixin, StateDictMixin, JoinMixin, TorchSurfaceMixin, RegroupMixin,
                              torch.nn.Module, Joinable):
    """Synchronous data parallelism: every rank holds a replica, gradients are averaged in backward.

    Drop-in for `torch.nn.parallel.DistributedDataParallel` (same arguments, same behaviour).

    >>> import phalanx, torch                                   # doctest: +SKIP
    >>> phalanx.init()
    >>> model = phalanx.DistributedDataParallel(torch.nn.Linear(8, 2))
    >>> model(torch.randn(4, 8)).sum().backward()               # grads now averaged over ranks
    """

    def __init_subclass__(cls, level: str | None = None, **kwargs):
        """A subclass declared with `level=` is what `DistributedDataParallel(..., shard=level)` builds."""
        super().__init_subclass__(**kwargs)
        if level is not None:
            _LEVELS[level] = cls

    def __new__(cls, *args, shard: str = "none", **kwargs):
        if cls is DistributedDataParallel and shard in _LEVEL_MODULES:  # a level with a front of its own
            importlib.import_module(_LEVEL_MODULES[shard])  # its class registers itself (__init_subclass__)
            cls = _LEVELS[shard]
        return super().__new__(cls)

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, shard: str = "none", audit_every: int | None = None,
                 audit: str = "heal", on_nonfinite: str = "raise", across_hosts=None, **unsupported):
        super().__init__()
        Joinable.__init__(self)
        check_ready_to_wrap(unsupported)
        audit_every = check_settings(audit_every, audit, on_nonfinite, dist.get_rank())
        self._audit_settings = (audit_every, audit, on_nonfinite)  # the replica audit (replicas/audit.py)
        self._audit = None
        self.module = module
        self._on_the_world = process_group is None or process_group == dist.group.WORLD  # followed: regroup.py
        self.process_group = process_group if process_group is not None else (live_group() or dist.group.WORLD)
        self._ignored = ignored_names(module)  # torch's _ddp_params_and_buffers_to_ignore
        named = trained(module, self._ignored)
        if not named:
            raise NoTrainableParametersError(explain(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that requires "
                "a gradient", rank=dist.get_rank(), seen=f"{type(module).__name__} with no trainable parameter",
                expected="at least one parameter with requires_grad=True",
                fix="Wrap a model with trainable parameters, or run it without DDP."))
        devices = {p.device for _, p in named}
        if all(d.type == "cpu" for d in devices):  # torch's SyncBatchNorm refuses CPU input; ours takes it
            swapped = replace_torch_sync_batchnorm(module)
            if swapped:
                logger.info("torch.nn.SyncBatchNorm at %s replaced by phalanx.nn.SyncBatchNorm (CPU model)",
                            ", ".join(swapped))
        self.device = next(iter(devices)) if len(devices) == 1 else None
        self.device_ids = check_device_ids(device_ids, devices)
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.shard = check_shard(shard, gradient_as_bucket_view, named)
        guard_level(named, self.shard)
        # As torch: 25 MiB buckets, and a 1 MiB first bucket unless the user chose a cap.
        self.bucket_bytes_cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
        first_cap = min(FIRST_BUCKET_BYTES, self.bucket_bytes_cap) if bucket_cap_mb is None else self.bucket_bytes_cap
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._group_rank0 = dist.get_global_rank(self.process_group, 0)
        self._control_device = collective_device(self.process_group, next(iter(devices)))
        check_same_signature(module, self.process_group, self._control_device)
        if init_sync:
            broadcast_coalesced([t for _, t in shared_states(module, self._ignored)], self._group_rank0,
                                self.process_group)
        self.outer_step = None  # across_hosts=DiLoCo(...): diloco.OuterStep, or OneHost on one host
        if across_hosts is not None:  # the exact exchange on this host's ranks only, an outer step across hosts
            buffers = synced_buffers(module, self._ignored) if broadcast_buffers else []
            self.process_group, self.outer_step = split_across_hosts(across_hosts, self.process_group,
                                                                     [p for _, p in named], buffers, self.shard,
                                                                     self._on_the_world)
            self._group_rank0 = dist.get_global_rank(self.process_group, 0)
        self._first_cap_bytes = first_cap
        self._user_cap = bucket_cap_mb is not None  # else the exchange may plan buckets of its own size
        self._comm_hook = None  # (state, hook) once registered: again on an engine rebuilt by regroup()
        # Listing buffers walks every submodule: skip it on each forward of a model that has none.
        self._has_buffers = bool(synced_buffers(module, self._ignored))
        self._divide_by_initial_world_size = True
        self._build_engine()
        if getattr(self.outer_step, "live", None) is not None:  # DiLoCo under live recovery
            self._agree_on_commits(self.samples_group)
        self._follow_generations()

    def _build_engine(self) -> None:
        """The step guard, the exchange and the reducer (collective when the exchange shares memory)."""
        named = trained(self.module, self._ignored)
        self._guard = StepGuard(self.process_group, next(_instances))
        params = [p for _, p in named]
        if getattr(self, "_hosts", None) is None and self.process_group.size() > 1:
            self._hosts = HostGroups(host_topology(self.process_group, generation.all_gather_objects),
                                     self.process_group)  # collective
        exchange = choose_exchange(self.process_group, self._guard, params, owner=self, shard=self.shard,
                                   hosts=getattr(self, "_hosts", None))
        caps = (self.bucket_bytes_cap, self._first_cap_bytes)
        if not getattr(self, "_user_cap", True):
            caps = exchange.bucket_caps(*caps)
        # static_graph: torch then tolerates parameters that never get a gradient; so do we.
        self._reducer = Reducer(params, [name for name, _ in named], self.process_group, exchange,
                                cap_bytes=caps[0], first_cap_bytes=caps[1],
                                tolerate_unused=self.find_unused_parameters or self.static_graph,
                                # "optimizer" sharding reduce-scatters the gradients where they lie
                                as_view=self.gradient_as_bucket_view or self.shard == OPTIMIZER, guard=self._guard,
                                control_device=self._control_device, sparse=sparse_indices(self.module, named))
        self._named_params = named
        if self._audit is None:
            self._audit = ReplicaAudit(self, *self._audit_settings)
            if self.outer_step is not None:
                self._audit.listeners.append(self.outer_step)  # counts the model's optimizer steps
        self._reducer.set_check(self._audit.check)
        if self.shard != "none" and self._reducer.exchange.defers_gathers:
            self._gather_waits = install_gather_waits(self.module, self._reducer.exchange)
        # The parameters' hooks keep the reducer alive; drop them when this wrapper goes away, so
        # re-wrapping the same module (after an error, in a notebook) leaves no stale hooks behind.
        self._reducer.remove_with(self)

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        if self._reducer is None:  # an unpickled copy: no engine until it trains
            if (torch.is_grad_enabled() and self.require_backward_grad_sync) or self._join_config.enable:
                self._ensure_engine()
            else:
                return self._run_module(inputs, kwargs)
        reducer = self._reducer
        if reducer.unready_error:
            names, reducer.unready_error = reducer.unready_error, None
            raise unused_parameters_error(names, self._guard.step)
        will_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if torch.is_grad_enabled():
            self._audit.forward(will_sync)  # counts the steps and the micro-batches
        if will_sync:
            recorder.next_step()  # the heartbeat's step count: synchronized forwards
        else:
            recorder.phase(recorder.FORWARD)
        syncs_buffers = will_sync and self.module.training and self.broadcast_buffers
        joining = self._join_config.enable
        self._guard.enabled = not joining
        if joining:
            join_work = Join.notify_join_context(self)
            announce_sync(self, (SYNCS_GRADIENTS if will_sync else 0) | (SYNCS_BUFFERS if syncs_buffers else 0))
        if will_sync:
            reducer.exchange.divisor = (count_active_ranks(join_work) if joining and join_work is not None
                                        and not self._divide_by_initial_world_size else self.process_group.size())
            if syncs_buffers and self._has_buffers:
                self._sync_buffers(joining)
            reducer.prepare_for_backward(current_context())  # a context: distributed autograd (RPC)
        else:
            reducer.disarm()
        self.require_forward_param_sync = will_sync
        return self._run_module(inputs, kwargs)

    def _run_module(self, inputs: tuple, kwargs: dict):
        if self.device_ids:
            inputs, kwargs = move_to(inputs, self.device), move_to(kwargs, self.device)
        if self.bucket_bytes_cap < FIRST_BUCKET_BYTES:  # Dynamo's DDPOptimizer refuses caps below its first bucket
            return self.module(*inputs, **kwargs)
        # A compiled module's backward is one autograd node: every gradient would arrive at its end, with
        # nothing left to overlap. Dynamo splits the graph at bucket boundaries (its DDPOptimizer) for the
        # DDP that torch's class names active while the module runs, as torch DDP does: name ourselves.
        previous = _TorchDDP._active_ddp_module
        _TorchDDP._active_ddp_module = self
        if torch.compiler.is_compiling():  # torch.compile(DDP(net)) traces this: compile the module in a
            torch._dynamo.graph_break()     # frame of its own, which starts after the line above has run
        try:
            return self.module(*inputs, **kwargs)
        finally:
            _TorchDDP._active_ddp_module = previous

    def _sync_buffers(self, joining: bool, src: int | None = None) -> None:
        buffers = synced_buffers(self.module, self._ignored)
        if not buffers:
            return
        self._guard.begin()
        if src is None:
            src = find_common_rank(self, dist.get_rank(), True) if joining else self._group_rank0
        tagged = not joining and self._guard.reads_back(self._control_device)
        tags = broadcast_coalesced(buffers, src, self.process_group, tag=self._guard.step if tagged else None,
                                   wait=self._guard.wait_work)
        if tags is not None:
            self._guard.check_equal(*tags, "the broadcast of module buffers")

    # -- the usual DDP surface -------------------------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this context.

        >>> with model.no_sync():                          # doctest: +SKIP
        ...     model(micro_batch_1).sum().backward()
        >>> model(micro_batch_2).sum().backward()          # averages the sum of both
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state, hook) -> None:
        """Average gradient buckets with `hook(state, bucket) -> Future[Tensor]` instead of the default.

        >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks   # doctest: +SKIP
        >>> model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        """
        if self.shard != "none":
            raise unsupported_with_sharding(f"register_comm_hook({getattr(hook, '__name__', hook)})", self.shard,
                                            "Leave the exchange to phalanx (it reduce-scatters), or use shard='none'.")
        check_comm_hook(hook, self._comm_hook is not None)
        if self._reducer is None:
            self._ensure_engine()
        if getattr(hook, "__name__", "") == "post_localSGD_hook" and self._audit.every:
            # torch's local SGD: replicas differ between the periodic averagings, by design
            logger.info("post_localSGD_hook: the replica audit is off for this model (replicas differ by design)")
            self._audit.every = 0
        self._comm_hook = (state, hook)
        self._reducer.set_exchange(choose_exchange(self.process_group, self._guard, self._reducer.params, owner=self,
                                                   comm_hook=(state, hook)))

    # -- sharding -------------------------------------------------------------------------------------

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, *, overlap_forward: bool = False):
        """The optimizer to step: with shard="optimizer" or "gradients", `optimizer` re-targeted at this
        rank's chunks (a ShardedOptimizer); with shard="none", `optimizer` itself. With `overlap_forward`
        the parameters' all-gather after a step overlaps the next forward (see ShardedOptimizer).

        >>> model = phalanx.DistributedDataParallel(net, shard="gradients")          # doctest: +SKIP
        >>> optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
        """
        if self.shard == "none":
            return optimizer
        if self._reducer is None:
            self._ensure_engine()
        named = self._named_params
        sharded = ShardedOptimizer(optimizer, self._reducer.exchange, [p for _, p in named], [n for n, _ in named],
                                   overlap_forward, live=self._live_sharding())
        self._audit.sharded(sharded, [n for n, _ in named])
        return sharded

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model, sharded or not: returns the total norm.

        With sharding each rank holds the average of its chunks only; their norms are combined across
        ranks (collective), so every rank clips with the norm of the whole gradient.
        """
        if self.shard == "none" or self._reducer is None:
            return torch.nn.utils.clip_grad_norm_([p for _, p in self._named_params], max_norm, norm_type,
                                                  error_if_nonfinite, foreach)
        return clip_sharded_grad_norm_(self._reducer.exchange, max_norm, norm_type, error_if_nonfinite)

    @property
    def samples_group(self):
        """The ranks a step's samples are dealt over: the model's process group; with across_hosts= every host's
        ranks (the world that trains), each host stepping on its own ranks' part."""
        return (live_group() or dist.group.WORLD) if self.outer_step is not None else self.process_group

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.shard != "none" and self._reducer is not None:
            self._reducer.exchange.zero_owned_grads(set_to_none)  # the averaged chunks the optimizer steps with


DDP = DistributedDataParallel

