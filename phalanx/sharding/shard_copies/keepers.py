"""Whether sharded models keep copies of their optimizer shards (`PHALANX_SHARD_COPIES`), and which rank keeps whose.

A rank's keeper is on another host where there is one, so that a host lost takes no chunk along with its only
copy; each rank keeps the chunks of its *wards*, the ranks whose keeper it is.
"""

from __future__ import annotations

import os

COPIES_ENV = "PHALANX_SHARD_COPIES"


def copies_on() -> bool:
    """Whether sharded models keep copies of their optimizer shards under live recovery (`PHALANX_SHARD_COPIES=0`
    turns them off: a loss then restarts the run from its newest checkpoint, and a healthy step costs nothing)."""
    return os.environ.get(COPIES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def keepers(hosts: list[list[int]]) -> dict[int, int]:
    """Each rank's keeper, from the ranks of each host: the rank with its local index (modulo that host's ranks)
    on the next host; on one host, the next rank. A rank alone in its world keeps its own (no copy).

    >>> keepers([[0, 1], [2, 3], [4, 5]])
    {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    >>> keepers([[0, 1, 2]])
    {0: 1, 1: 2, 2: 0}
    >>> keepers([[0], [1, 2]])
    {0: 1, 1: 0, 2: 0}
    """
    if len(hosts) == 1:
        ranks = hosts[0]
        return {rank: ranks[(i + 1) % len(ranks)] for i, rank in enumerate(ranks)}
    kept = {}
    for h, ranks in enumerate(hosts):
        following = hosts[(h + 1) % len(hosts)]
        for i, rank in enumerate(ranks):
            kept[rank] = following[i % len(following)]
    return kept
