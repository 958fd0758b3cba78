"""Layers that need the world: `SyncBatchNorm` and `convert_sync_batchnorm`."""

from .sync_batchnorm import SyncBatchNorm, SyncBatchNormError, convert_sync_batchnorm

__all__ = ["SyncBatchNorm", "SyncBatchNormError", "convert_sync_batchnorm"]
