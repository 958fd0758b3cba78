"""A small multi-process test harness, public so users can test their own distributed code.

`run_ranks(fn, world_size)` runs `fn(rank, *args)` on that many new Gloo processes, each with
one CPU thread and `phalanx.init()` done, and returns the per-rank results. A rank that raises
fails the call with its traceback; ranks that have not finished within `timeout` are named.
"""

from __future__ import annotations

import socket

from .launch.spawn import spawn

DEFAULT_TIMEOUT = 120.0


def run_ranks(fn, world_size: int, args: tuple = (), *, timeout: float = DEFAULT_TIMEOUT,
              env: dict | None = None, min_world_size: int | None = None) -> list:
    """Run `fn(rank, *args)` on `world_size` CPU ranks over Gloo and return the results in rank order.

    >>> from phalanx.testing import run_ranks          # doctest: +SKIP
    >>> def total(rank):
    ...     t = torch.tensor([rank]); torch.distributed.all_reduce(t); return int(t)
    >>> run_ranks(total, 3)
    [3, 3, 3]
    """
    # One thread per rank: ranks share the cores, and oversubscription turns timings into noise.
    settings = {"OMP_NUM_THREADS": "1", "PHALANX_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    # Forked from a server that imported torch once: a test of many small runs starts ranks in ~0.1 s, not ~3 s.
    return spawn(fn, world_size, args, timeout=timeout, env=settings, start_method="forkserver",
                 min_world_size=min_world_size)


def free_port() -> int:
    """A TCP port that was free a moment ago (for tests that need a port number up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
