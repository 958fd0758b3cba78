"""Data that splits correctly across ranks: the sampler, the resumable loader, and metrics over ranks."""

from . import metrics
from .loader import DataLoader
from .sampler import DistributedSampler
