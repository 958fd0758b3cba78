"""The all-reduce bandwidth benchmark runs in a 2-rank world and reports every variant (no timing asserted)."""

import math

from phalanx.testing import run_ranks
from phalanx.tools.bench_allreduce import VARIANTS, allreduce_bandwidth, format_rows


def _tiny_benchmark(rank: int):
    return allreduce_bandwidth(sizes_mb=(0.01, 0.1), repeats=2, warmup=1)


def test_benchmark_reports_every_variant_and_size_identically_on_all_ranks():
    """World size 2."""
    per_rank = run_ranks(_tiny_benchmark, 2)
    rows = per_rank[0]
    assert per_rank[1] == rows  # the times are MAX-reduced over ranks: one answer
    assert [row["size_mb"] for row in rows] == [0.01, 0.1]
    for row in rows:
        for name in VARIANTS:
            assert row[f"{name}_ms"] > 0 and math.isfinite(row[f"{name}_gbps"])
    assert "alloc/gloo" in format_rows(rows)
