"""Rank-aware output: the `phalanx` logger (the main rank at INFO, the others at WARNING) and `print0`.

Every module logs through `logger`; `init()` calls `configure(rank, is_main)` once the rank is known.
Under `phalanx run` each output line already starts with the rank, so no second prefix is added.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

logger = logging.getLogger("phalanx")


class _RankFilter(logging.Filter):
    """The main rank logs INFO and above; the other ranks only WARNING and above. Lines name the launch rank."""

    def __init__(self, rank: int, is_main):
        super().__init__()
        self.rank, self.is_main = rank, is_main

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return record.levelno >= logging.WARNING or self.is_main()


def configure(rank: int, is_main=None) -> None:
    """Route the `phalanx` logger to stderr with this rank's filter (replacing an earlier setup). `rank`: the rank
    the process was launched with, which its lines carry; `is_main`: whether it is the main rank now (which can
    change when ranks are lost: world.is_main), default rank == 0."""
    global _is_main
    _is_main = is_main
    for handler in list(logger.handlers):
        if getattr(handler, "_phalanx", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._phalanx = True
    handler.addFilter(_RankFilter(rank, is_main or (lambda: rank == 0)))
    prefix = "" if os.environ.get("PHALANX_RANK_PREFIXED") == "1" else "[rank %(rank)s] "
    handler.setFormatter(logging.Formatter(prefix + "%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_is_main = None  # configure()'s: whether this process is the main rank now


def print0(*args, **kwargs) -> None:
    """print() on the main rank only (px.is_main(): rank 0 of the ranks that train now), and in a process that has
    not joined a world."""
    if _is_main is not None:
        main = _is_main()
    else:  # a world phalanx did not make: torch's rank 0
        main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if main:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
