"""Layers that need the world: `SyncBatchNorm` and `convert_sync_batchnorm`.

May import: errors.
"""

from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
