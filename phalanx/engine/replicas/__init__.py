"""Keeping replicas identical: the same model on every rank at the start, and proof that they stay so.

`signature.py` checks at construction that every rank holds the same model and copies rank 0's values to
all (coalesced broadcasts, also used by join and heals). While training, the replica audit (`audit.py`)
compares a fingerprint (`fingerprint.py`) of every parameter and piece of optimizer state across the ranks
every N optimizer steps, names a rank that differs and heals it from the majority or stops the run;
`shard_state.py` checks the sharded optimizer state against the copies its keepers hold; `nonfinite.py`
finds a NaN or Inf gradient on the rank that made it, before the exchange spreads it; `optimizer_hooks.py`
is how the optimizer's steps reach all of these.
"""

from .signature import (
    BROADCAST_CAP_BYTES,
    broadcast_coalesced,
    check_same_signature,
    replica_signature,
    shared_states,
    synced_buffers,
    trained,
)

__all__ = ["BROADCAST_CAP_BYTES", "broadcast_coalesced", "check_same_signature", "replica_signature",
           "shared_states", "synced_buffers", "trained"]
