"""The DDP engine: the front (`ddp.py`), the reducer that decides when a bucket is ready, the buckets,
the exchanges that decide how a bucket becomes its average, the step guard and join."""

from . import fully_sharded  # registers shard="parameters" (torch's FSDP2) with the DDP front
