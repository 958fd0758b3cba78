"""Checkpoints: what is saved and when (`checkpointer.py`, `entries.py`), what a save does on each rank,
written now by rank 0 or handed to a writer (`saving/`), how a save is written in the background
(`background/`: a snapshot into a staging buffer, a writer process; the replicated state's write
`spreading.py` over the ranks), how it reaches the disk atomically and loads without running code
(`atomic_files.py`), how it is loaded back (`restoring.py`), every rank's random states
(`random_state.py`), shards of `shard="parameters"` models (`shard_files.py`), the ranks' agreement on
the step to stop at (`agreement.py`), the state handed to ranks that join a run in progress
(`handover.py`), and whole weights exported for inference (`export.py`).

May import: engine, sharding, world, diagnose, errors, log.
"""

from .checkpointer import Checkpointer
from .entries import unwrap
from .export import export_weights, load_weights
