"""The parts of torch DDP's interface around the gradient engine, which libraries built on torch's class
(Accelerate, Lightning) reach for: the `device_ids` contract, `.reducer` (the few methods of torch's C++
Reducer they call), `_set_static_graph`, `_get_ddp_logging_data`, the parameters to ignore. Each does
what torch's does on phalanx's engine; a torch internal phalanx has no counterpart for raises
TorchInternalError, naming it (docs/ddp.md lists them per library).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from ..diagnose import recorder
from ..errors import TorchInternalError, WorldConfigError, explain
from .dist_autograd import current_context

IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"  # torch's name, set on the module before wrapping


def check_device_ids(device_ids, devices: set) -> list | None:
    if not device_ids:
        return None
    if len(devices) > 1 or next(iter(devices)).type == "cpu" or len(device_ids) != 1:
        raise ValueError(explain(
            "device_ids only applies to a module on a single GPU", seen=f"device_ids={device_ids}, "
            f"parameters on {sorted(str(d) for d in devices)}", expected="device_ids=None or [the GPU index]",
            fix="Leave device_ids=None for CPU and multi-device modules."))
    return [torch.device(d).index if not isinstance(d, int) else d for d in device_ids]


def move_to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(move_to(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    return value


def ignored_names(module: torch.nn.Module) -> frozenset:
    """The parameters and buffers DDP leaves alone: torch's `_ddp_params_and_buffers_to_ignore`."""
    return frozenset(getattr(module, IGNORE_ATTRIBUTE, ()) or ())


def torch_internal(name: str, why: str, fix: str) -> TorchInternalError:
    return TorchInternalError(explain(
        f"{name} is a torch DDP internal that phalanx's DistributedDataParallel does not have: {why}",
        rank=dist.get_rank() if dist.is_initialized() else None, seen=name,
        expected="the public DDP interface (docs/ddp.md lists what phalanx honours)", fix=fix), name)


class ReducerView:
    """`model.reducer` on phalanx's DDP: the methods of torch's C++ Reducer that libraries call.

    Accelerate's `trigger_sync_in_backward` and Lightning's manual optimization call
    `reducer.prepare_for_backward(outputs)` after a forward that ran without synchronization, so that
    the coming backward averages the gradients; that works. Any other Reducer internal raises
    TorchInternalError (an AttributeError too: `hasattr(model.reducer, name)` is False).
    """

    def __init__(self, ddp):
        self._ddp = ddp

    def prepare_for_backward(self, outputs=()) -> None:
        """Average the gradients in the coming backward, as if the last forward had synchronization on.
        torch searches `outputs` for unused parameters; phalanx finds them at the end of backward."""
        self._ddp._arm_backward()

    def _rebuild_buckets(self) -> bool:
        """torch rebuilds its buckets here when due; phalanx's reducer rebuilds them itself, once, after
        the first synchronized backward. Nothing is rebuilt now: False, as torch returns then."""
        return False

    def _delay_all_reduce(self) -> None:
        """torch's static graph defers the first backward's all-reduce for the caller to launch (Lightning,
        manual optimization); phalanx never defers it: the buckets were averaged when backward ended."""

    def _set_static_graph(self) -> None:
        self._ddp._tolerate_unused()

    def _remove_autograd_hooks(self) -> None:
        self._ddp._remove_autograd_hooks()

    def __getattr__(self, name: str):
        raise torch_internal(f"DistributedDataParallel.reducer.{name}", "phalanx's reducer is Python code of its "
                             "own, not torch's C++ Reducer", "Use DDP's public methods (no_sync, join, "
                             "register_comm_hook); report the library that calls it.")


class NoReducer:
    """`model.reducer` of the FSDP2 level (shard="parameters"): every use raises the error it holds."""

    def __init__(self, error: TorchInternalError):
        self._error = error

    def __getattr__(self, name: str):
        raise self._error


class TorchSurfaceMixin:
    """torch DDP's surface beyond forward, no_sync, join and comm hooks (mixed into DistributedDataParallel)."""

    @property
    def reducer(self) -> ReducerView | NoReducer:
        if self.shard == "parameters":  # raised on use: an AttributeError raised here would be nn.Module's own
            return NoReducer(torch_internal("DistributedDataParallel.reducer", "with shard='parameters' torch's "
                                            "FSDP2 synchronizes the gradients, and it has no reducer",
                                            "Use no_sync() for accumulation, or shard='none' / 'optimizer' / "
                                            "'gradients'."))
        return ReducerView(self)

    def _arm_backward(self) -> None:
        """The coming backward synchronizes: what DDP's forward does when sync is on, but the buffers."""
        if self._reducer is None:
            self._ensure_engine()
        self.require_forward_param_sync = True
        if self._reducer.armed:  # the forward armed it already (Lightning's manual optimization)
            return
        recorder.next_step()
        self._reducer.exchange.divisor = self.process_group.size()
        self._reducer.prepare_for_backward(current_context())

    def _tolerate_unused(self) -> None:
        self.static_graph = True
        if self._reducer is not None:
            self._reducer.tolerate_unused = True

    def _set_static_graph(self) -> None:
        """As torch's: static_graph=True after construction (phalanx then tolerates parameters that never get
        a gradient, as with static_graph=True in the constructor)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self._tolerate_unused()

    def _remove_autograd_hooks(self) -> None:
        """As torch's: the parameters' hooks are removed; this DDP no longer averages gradients."""
        if self._reducer is not None:
            self._reducer.remove()

    def will_sync_module_buffers(self) -> bool:
        return bool(self.require_forward_param_sync and self.broadcast_buffers and self._has_buffers)

    @classmethod
    def _get_active_ddp_module(cls):
        """The DDP whose forward is running (torch's, or phalanx's, which names itself there too)."""
        return _TorchDDP._active_ddp_module

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: torch.nn.Module, params_and_buffers_to_ignore) -> None:
        """As torch's: DDP neither broadcasts nor averages these (fully qualified names), nor checks their shapes."""
        setattr(module, IGNORE_ATTRIBUTE, params_and_buffers_to_ignore)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

    def _get_ddp_logging_data(self) -> dict:
        """torch's construction-time keys, from phalanx's own state (torch's runtime timings are not kept)."""
        group, params = self.process_group, [p for _, p in self._named_params]
        plan = self._reducer.plan() if self._reducer is not None else []
        return {
            "backend_name": dist.get_backend(group), "module_name": type(self.module).__name__,
            "device_ids": ",".join(map(str, self.device_ids or [])),
            "dtypes": ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
            "bucket_sizes": ", ".join(str(sum(params[i].numel() * params[i].element_size() for i in bucket))
                                      for bucket in plan),
            "world_size": group.size(), "rank": dist.get_rank(group),
            "output_device": -1 if self.output_device is None else int(torch.device(self.output_device).index
                                                                        if not isinstance(self.output_device, int)
                                                                        else self.output_device),
            "broadcast_buffers": int(self.broadcast_buffers), "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters), "static_graph": int(self.static_graph),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "is_multi_device_module": int(self.device is None), "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) or type(m).__name__ == "SyncBatchNorm"
                                   for m in self.module.modules())),
            # torch sets this after watching the graph stay the same; phalanx does not watch, so never suggests it
            "can_set_static_graph": 0,
        }

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        raise torch_internal("DistributedDataParallel._set_ddp_runtime_logging_sample_rate", "phalanx keeps no "
                             "runtime timings per step", "Time steps with phalanx's collective record "
                             "(phalanx.diagnose) or torch.profiler instead.")

    def _register_fused_optim(self, optim: type, *args, optim_params=None, **kwargs) -> None:
        raise torch_internal("DistributedDataParallel._register_fused_optim", "it steps a functional optimizer "
                             "inside torch's comm hook", "Step a plain torch optimizer after backward, or shard "
                             "its state with DistributedDataParallel(..., shard='optimizer').")

    def _update_process_group(self, new_process_group) -> None:
        raise torch_internal("DistributedDataParallel._update_process_group", "the exchange is built for the "
                             "group it was constructed with", "Wrap the module again on the new group.")


def check_ready_to_wrap(unsupported: dict) -> None:
    """No argument torch's DDP lacks and phalanx does not take, and a process group to wrap for."""
    if unsupported:
        raise TypeError(f"phalanx.DistributedDataParallel does not support {sorted(unsupported)}")
    if not (dist.is_available() and dist.is_initialized()):
        raise WorldConfigError(explain(
            "DistributedDataParallel needs a process group", seen="torch.distributed not initialized",
            fix="Call phalanx.init() (or torch.distributed.init_process_group) before wrapping the model."))
