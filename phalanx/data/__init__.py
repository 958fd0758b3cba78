"""Data that splits correctly across ranks: the sampler, the resumable loader, and metrics over ranks.

May import: world, diagnose, errors, log.
"""

from . import metrics
from .loader import DataLoader
from .sampler import DistributedSampler
