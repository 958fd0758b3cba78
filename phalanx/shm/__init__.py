"""The shared-memory transport between the ranks of one host. It knows nothing of DDP.

`communicator.py` is the public face (`ShmCommunicator`, `shm_communicator`); `posted.py` the posted
and split exchanges on its allocations; `segment.py`, `barrier.py` and `reduce.py` the segments, the
cross-process barrier and the arithmetic.

May import: errors, log.
"""

from .communicator import ShmCommunicator, shm_communicator, shm_enabled
from .segment import sweep_stale_segments
