"""The values, shard layouts and stand-in model shared by tests/unit/test_metrics.py and
tests/ranks/test_metrics.py."""

import torch

SIZE = 29  # uneven over 3 ranks (10, 10, 9 without padding) and over batches of 4
VALUES = torch.randn(SIZE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
SHARD_LAYOUTS = {"padded": {"pad": True}, "unpadded": {"pad": False}, "drop-last": {"drop_last": True}}


def model(values):
    """A stand-in for predictions: one row (2 * value, value ** 2) per sample."""
    return torch.stack([2 * values, values ** 2], dim=1)
