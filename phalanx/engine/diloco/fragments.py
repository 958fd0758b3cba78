"""Streaming DiLoCo's fragments: which parameters sync together, and at which steps (pure).

The parameters, in the model's order, are cut into F runs of about equal size (a parameter is never split, so
the hosts need no agreement beyond the model's shapes). Fragment k syncs at the steps s with s = k*H/F (mod H),
s >= 1: one fragment every H/F steps, each every H steps, and with F = 1 the plain DiLoCo schedule.
"""

from __future__ import annotations


def split(sizes: list[int], count: int) -> list[list[int]] | None:
    """The parameter indices of each of `count` fragments, consecutive and of about equal total size; None when
    there are fewer parameters than fragments.

    >>> split([6, 2, 2, 2], 2)
    [[0], [1, 2, 3]]
    >>> split([1, 1, 10], 3)
    [[0], [1], [2]]
    """
    if len(sizes) < count:
        return None
    total, done, parts = sum(sizes), 0, [[]]
    for i, size in enumerate(sizes):
        k = len(parts) - 1
        # A new fragment once this one holds its share, or when just enough parameters are left for the rest.
        if parts[k] and k < count - 1 and (done >= (k + 1) * total / count or len(sizes) - i == count - 1 - k):
            parts.append([])
        parts[-1].append(i)
        done += size
    return parts


def due(step: int, every: int, count: int) -> list[int]:
    """The fragments that sync after optimizer step `step` (counted from 1).

    >>> [due(s, 4, 2) for s in range(1, 9)]
    [[], [1], [], [0], [], [1], [], [0]]
    """
    offset = step % every
    return [offset * count // every] if offset % (every // count) == 0 else []
