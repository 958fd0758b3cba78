"""How phalanx's benchmarks time, compare and report: one way, for `phalanx bench` and benchmarks/ alike.

Variants of one measurement run in interleaved blocks, the order rotating each round (A B C, B C A, ...),
so that a shared machine's drift hits every variant alike; a comparison is a ratio taken in the same run,
of medians or paired round by round. What a block is stays the caller's: bench_block.run_block times DDP
steps on every rank (the slowest rank's per step); a script may time CPU time or CUDA events instead. A
script reports its headline figures with `write_figures`, which the suite runner (`phalanx bench --suite
cpu`, bench_suite.py) reads back into its summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def rotated(variants: Sequence[str], round_: int) -> list[str]:
    """The order of round `round_`: rotated by one each round, so that no variant always follows the same one.

    >>> rotated(["a", "b", "c"], 1)
    ['b', 'c', 'a']
    """
    shift = round_ % len(variants)
    return list(variants[shift:]) + list(variants[:shift])


def interleave(variants: Sequence[str], rounds: int, block: Callable[[str], T],
               after: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """`rounds` rounds of one `block(variant)` per variant, the order rotating; each variant's blocks in order.

    `after(round, variant, result)` is called after each block (progress lines, bookkeeping).

    >>> interleave(["on", "off"], 2, lambda v: v.upper())
    {'on': ['ON', 'ON'], 'off': ['OFF', 'OFF']}
    """
    blocks: dict[str, list[T]] = {variant: [] for variant in variants}
    for round_ in range(rounds):
        for variant in rotated(variants, round_):
            result = block(variant)
            blocks[variant].append(result)
            if after is not None:
                after(round_, variant, result)
    return blocks


def median_of_steps(blocks: Sequence[Sequence[float]]) -> float:
    """The median over every step of every block."""
    return statistics.median(t for block in blocks for t in block)


def summarize(blocks_ms: Sequence[Sequence[float]]) -> dict:
    """Median (the headline), spread and per-block medians of per-step times grouped by block."""
    steps = sorted(t for block in blocks_ms for t in block)
    return {
        "median_ms": statistics.median(steps),
        "min_ms": steps[0],
        "p90_ms": steps[min(len(steps) - 1, int(0.9 * len(steps)))],
        "block_medians_ms": block_medians(blocks_ms),
        "steps": len(steps),
        "steps_ms": [list(block) for block in blocks_ms],
    }


def paired_ratio(top: Sequence[float], bottom: Sequence[float]) -> float:
    """The median over rounds of top/bottom, each a per-round figure (a block's median or mean).

    Blocks of one round ran back to back, so this pairs like with like when the host's speed drifts.

    >>> paired_ratio([2.0, 3.0, 4.0], [1.0, 2.0, 2.0])
    2.0
    """
    return statistics.median(a / b for a, b in zip(top, bottom))


def block_medians(blocks: Sequence[Sequence[float]]) -> list[float]:
    return [statistics.median(block) for block in blocks]


# -- reporting through the suite ---------------------------------------------------------------------

def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """`--json PATH`: where the script writes its headline figures (the suite runner passes one)."""
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="also write the headline figures (and raw results) to this JSON file")


def write_figures(path: str | Path | None, figures: dict, **raw) -> None:
    """Write {"figures": {label: number or text}, **raw} to `path` (nothing when `path` is None).

    `figures` are the few numbers a reader compares (ratios first); `raw` is whatever else the script measured.
    """
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"figures": figures, **raw}, indent=1, default=str) + "\n")
