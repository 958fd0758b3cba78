"""Rank-aware output: the `phalanx` logger (rank 0 at INFO, the others at WARNING) and `print0`.

Every module logs through `logger`; `init()` calls `configure(rank)` once the rank is known.
Under `phalanx run` each output line already starts with the rank, so no second prefix is added.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

logger = logging.getLogger("phalanx")


class _RankFilter(logging.Filter):
    """Rank 0 logs INFO and above; the other ranks only WARNING and above."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.rank == 0 or record.levelno >= logging.WARNING


def configure(rank: int) -> None:
    """Route the `phalanx` logger to stderr with this rank's filter (replacing an earlier setup)."""
    for handler in list(logger.handlers):
        if getattr(handler, "_phalanx", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._phalanx = True
    handler.addFilter(_RankFilter(rank))
    prefix = "" if os.environ.get("PHALANX_RANK_PREFIXED") == "1" else "[rank %(rank)s] "
    handler.setFormatter(logging.Formatter(prefix + "%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only (and in a process that has not joined a world)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
