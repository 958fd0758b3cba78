"""What a process brings to the world: the device it trains on, the backend that reaches it, the CPU threads it may
use (its share of the host's cores), and the timeouts it is given (PHALANX_TIMEOUT, PHALANX_CONNECT_TIMEOUT)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ...errors import WorldConfigError, explain
from ..discovery import WorldSpec

DEFAULT_TIMEOUT = timedelta(minutes=10)  # collectives: long enough for a slow first step
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=120)  # rendezvous: a missing master is reported after this


def seconds(value) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def env_seconds(name: str, default: timedelta) -> timedelta:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return timedelta(seconds=float(raw))
    except ValueError:
        raise WorldConfigError(explain(f"{name} is not a number of seconds", seen=repr(raw),
                                       expected="e.g. 60", fix=f"Fix or unset {name}.")) from None


def choose_device(spec: WorldSpec, device) -> torch.device:
    if device is not None:
        chosen = torch.device(device)
    elif torch.cuda.is_available():
        count = torch.cuda.device_count()
        if spec.local_rank >= count:
            raise WorldConfigError(explain(
                "more local ranks than GPUs on this host", rank=spec.rank,
                seen=f"LOCAL_RANK={spec.local_rank} with {count} visible GPU(s)",
                expected=f"LOCAL_RANK < {count}",
                fix="Start at most one process per GPU (`phalanx run --nproc-per-node auto`)."))
        chosen = torch.device("cuda", spec.local_rank)
    else:
        chosen = torch.device("cpu")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    return chosen


def _default_threads_untouched() -> bool:
    # torch's default intra-op pool has one thread per usable core; a user who changed it (or set
    # OMP_NUM_THREADS / MKL_NUM_THREADS) made a choice that we keep.
    if any(name in os.environ for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return False
    return torch.get_num_threads() == usable_cores()


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def share_cores(spec: WorldSpec, device: torch.device) -> None:
    if spec.local_world_size > 1 and device.type == "cpu" and _default_threads_untouched():
        torch.set_num_threads(max(1, usable_cores() // spec.local_world_size))


def collective_device(group=None, preferred: torch.device | None = None) -> torch.device:
    """Where a backend wants the small tensors of a collective: CUDA for NCCL (`preferred` if it is a
    CUDA device, else the current one), the CPU for every other backend and outside a world."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        if preferred is not None and preferred.type == "cuda":
            return preferred
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_backend(device: torch.device, backend: str | None) -> str:
    backend = backend or os.environ.get("PHALANX_BACKEND")
    if backend:
        return backend
    return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
