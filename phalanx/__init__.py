"""phalanx: synchronous data-parallel training for PyTorch.

    import phalanx as px
    px.init()                                  # reads phalanx run / torchrun / srun, or runs alone
    model = px.DistributedDataParallel(net)    # one changed import from torch DDP
"""

from . import hooks, metrics
from .checkpoint import Checkpointer
from .ddp import DDP, DistributedDataParallel
from .errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointValueError,
                     CheckpointWriteError, DataConfigError, MasterUnreachableError, NoTrainableParametersError,
                     ParameterMismatchError, PhalanxError, PortInUseError, RankFailedError, RanksTimedOutError,
                     ResumeStateError, UnevenInputsError, UnsafeCheckpointError, UnusedParameterError,
                     WorldConfigError)
from .loader import DataLoader
from .sampler import DistributedSampler
from .spawn import spawn
from .world import (barrier, device, init, is_initialized, is_main, local_rank, local_world_size, logger, print0,
                    rank, shutdown, world_size)

__version__ = "0.1.0"
