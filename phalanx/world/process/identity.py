"""Who this process was launched as: its launch rank and world, its host-local rank, its device, and phalanx's
namespace in the rendezvous store; set by init(), fixed for the process's life until shutdown(). A loss or a join does
not change them: the ranks that train now are live.py's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import WorldConfigError, explain
from ..discovery import WorldSpec

_spec: WorldSpec | None = None
_device: torch.device | None = None
_store = None  # phalanx's own namespace in the rendezvous store (barriers, host identity)
_attempt = "0"  # the worker group's keys in the store: its restart count, or the elastic round


def settle(spec: WorldSpec, device: torch.device, store, attempt: str) -> None:
    """init()'s: this process joined the world `spec` on `device`; `store`, phalanx's namespace in the rendezvous
    store (None when a user-made group left us none); `attempt`, the worker group's name in it."""
    global _spec, _device, _store, _attempt
    _store = store
    _spec, _device, _attempt = spec, device, attempt


def forget() -> None:
    """shutdown()'s: no world any more (the attempt's name stays)."""
    global _spec, _device, _store
    _spec = _device = _store = None


def launch_spec() -> WorldSpec | None:
    """The world this process was launched into, as init() read it (None before init() and after shutdown())."""
    return _spec


def is_initialized() -> bool:
    return _spec is not None


def require() -> WorldSpec:
    if _spec is None:
        raise WorldConfigError(explain("phalanx.init() has not been called", seen="no world",
                                       fix="Call phalanx.init() at the start of the script."))
    return _spec


def launch_rank() -> int:
    """The rank this process was launched with (a joiner: the rank drawn for it), fixed for the process's life.
    Log lines, errors and the launcher name processes by it; torch's `dist.get_rank()` answers it too."""
    return dist.get_rank() if dist.is_initialized() else require().rank


def launch_world_size() -> int:
    """The size of the world this process was launched into: torch's default group, which a loss or a join does
    not change (`dist.get_world_size()`). The ranks that train now: world_size()."""
    return dist.get_world_size() if dist.is_initialized() else require().world_size


def local_rank() -> int:
    return require().local_rank


def local_world_size() -> int:
    return require().local_world_size


def device() -> torch.device:
    require()
    return _device


def attempt() -> str:
    """The worker group's name in the store: its restart count, or under `--nnodes MIN:MAX` the rendezvous round
    (a joiner is given the round of the group it joins)."""
    return _attempt


def store():
    """phalanx's namespace in the rendezvous store (None when a user-made group left us none)."""
    require()
    return _store
