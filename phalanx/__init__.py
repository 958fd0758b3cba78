"""phalanx: synchronous data-parallel training for PyTorch.

    import phalanx as px
    px.init()                                  # reads phalanx run / torchrun / srun, or runs alone
    model = px.DistributedDataParallel(net)    # one changed import from torch DDP

`import phalanx` imports torch only when a name that needs it is first used (PEP 562), and then all of
them at once: the `phalanx` command decides the launcher's allocator, and forks the workers' server,
before torch is loaded, and `phalanx --help` answers at once. Every name below is importable as before.
"""

from __future__ import annotations

import importlib
import importlib.util

from .errors import (
    AcrossHostsError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointValueError,
    CheckpointWriteError,
    CollectiveMismatchError,
    DataConfigError,
    DuplicateNodeRankError,
    MasterUnreachableError,
    MembershipError,
    NonFiniteGradientError,
    NoTrainableParametersError,
    ParameterMismatchError,
    PeerDiedError,
    PeerFailedError,
    PhalanxError,
    PortInUseError,
    RankFailedError,
    RanksTimedOutError,
    ReplicaMismatchError,
    ResumeStateError,
    ShardingError,
    ShmUnavailableError,
    StepLogError,
    StrayOptimizerError,
    SyncBatchNormError,
    TensorBoardUnavailableError,
    TorchInternalError,
    UnevenInputsError,
    UnsafeCheckpointError,
    UnusedParameterError,
    WorldConfigError,
)

__version__ = "0.1.0"

# name -> the module that defines it (a module itself where the name is the module's own).
_LAZY = {
    "hooks": ".hooks", "nn": ".nn", "metrics": ".data.metrics",
    **dict.fromkeys(("Checkpointer", "export_weights", "load_weights"), ".checkpoint"),
    **dict.fromkeys(("DataLoader", "DistributedSampler"), ".data"),
    **dict.fromkeys(("RankSkew", "straggler_report"), ".diagnose"),
    **dict.fromkeys(("DDP", "DistributedDataParallel"), ".engine.ddp"),
    "DiLoCo": ".engine.diloco",
    "shm_allreduce_hook": ".hooks",
    **dict.fromkeys(("patch_torch_ddp", "torch_ddp_is_patched"), ".integrations.patch"),
    "spawn": ".launch.spawn",
    **dict.fromkeys(("logger", "print0"), ".log"),
    "StepLog": ".observe",
    **dict.fromkeys(("ShmCommunicator", "shm_communicator", "shm_enabled", "sweep_stale_segments"), ".shm"),
    **dict.fromkeys(("barrier", "device", "init", "is_initialized", "is_main", "local_rank", "local_world_size",
                     "rank", "shutdown", "world_size"), ".world"),
    **dict.fromkeys(("STOP_EXIT_CODE", "RunStopped", "stop_requested"), ".world.stop"),
}
_MODULES = {"hooks", "nn", "metrics"}

__all__ = sorted({*_LAZY, *(name for name in dir() if name.endswith("Error"))})


def __getattr__(name: str):
    if name in _LAZY:
        _load_all()
        return globals()[name]
    # A subpackage by its attribute (`phalanx.checkpoint.unwrap`), as when this module imported them all.
    if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    return importlib.import_module(f".{name}", __name__)


def _load_all() -> None:
    """The first public name used loads them all, as an eager import would: a training script pays for its
    imports before `init()` forms the world and the stall watch starts, not inside its first step."""
    for name, where in _LAZY.items():
        module = importlib.import_module(where, __name__)
        globals()[name] = module if name in _MODULES else getattr(module, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
