"""phalanx: synchronous data-parallel training for PyTorch.

    import phalanx as px
    px.init()                                  # reads phalanx run / torchrun / srun, or runs alone
    model = px.DistributedDataParallel(net)    # one changed import from torch DDP
"""

import sys

from . import hooks, nn
from .checkpoint import Checkpointer, export_weights, load_weights
from .data import DataLoader, DistributedSampler, metrics
from .diagnose import RankSkew, straggler_report
from .engine.ddp import DDP, DistributedDataParallel
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointValueError,
    CheckpointWriteError,
    CollectiveMismatchError,
    DataConfigError,
    MasterUnreachableError,
    NoTrainableParametersError,
    ParameterMismatchError,
    PeerDiedError,
    PeerFailedError,
    PhalanxError,
    PortInUseError,
    RankFailedError,
    RanksTimedOutError,
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
from .hooks import shm_allreduce_hook
from .integrations.patch import patch_torch_ddp, torch_ddp_is_patched
from .launch.spawn import spawn
from .log import logger, print0
from .observe import StepLog
from .shm import ShmCommunicator, shm_communicator, shm_enabled, sweep_stale_segments
from .world import (
    barrier,
    device,
    init,
    is_initialized,
    is_main,
    local_rank,
    local_world_size,
    rank,
    shutdown,
    world_size,
)
from .world.stop import STOP_EXIT_CODE, RunStopped, stop_requested

__version__ = "0.1.0"

# `import phalanx.metrics` and `from phalanx.metrics import Mean` keep working: the module lives in data/.
sys.modules[__name__ + ".metrics"] = metrics
