"""`phalanx bench --overhead` in this process: its flags, its estimator, its profile and report (world of one,
in-process). benchmarks/gpu/gpu_bench.py's --smoke run is in tests/e2e/test_bench.py."""

from __future__ import annotations

import torch

from phalanx.tools import bench
from phalanx.tools.bench_overhead import (
    OverheadConfig,
    _build,
    added_host_time,
    format_report,
    parse_config,
    profile_added,
)


def test_added_time_is_paired_by_round_and_robust_to_one_bad_round():
    blocks = {"plain": [[5.0, 5.0], [6.0, 6.0], [5.0, 5.0]],
              "torch": [[7.0, 7.0], [8.0, 8.0], [7.0, 7.0]],
              # the third round was disturbed: a median over rounds does not move
              "phalanx": [[6.0, 6.0], [7.0, 7.0], [50.0, 50.0]]}
    summary = added_host_time(blocks)
    assert summary["torch_added_ms"] == 2.0 and summary["phalanx_added_ms"] == 1.0
    assert summary["ratio"] == 0.5 and summary["plain_ms"] == 5.0 and summary["rounds"] == 3


def test_flags_are_checked_and_the_command_routes_here(capsys):
    assert parse_config(["--overhead", "--quick"]).rounds == 3
    assert parse_config(["--overhead"]).rounds == 600
    assert bench.main(["--overhead", "--rounds", "0"]) == 2
    assert "--rounds must be positive" in capsys.readouterr().err


def test_the_benchmark_runs_on_one_cpu_by_default(capsys):
    """Two vCPUs of one VM differed by a third in step time: a launch must not measure whichever it landed on."""
    import os
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_config(["--overhead"]).cpu == allowed[0]
    assert parse_config(["--overhead", "--cpu", "any"]).cpu is None
    assert parse_config(["--overhead", "--cpu", str(allowed[-1])]).cpu == allowed[-1]
    assert bench.main(["--overhead", "--cpu", "4096"]) == 2
    assert "--cpu names a CPU this process may not run on: seen 4096" in capsys.readouterr().err


def test_profile_and_report_name_the_engine_parts(world_of_one):
    config = OverheadConfig(layers=4, width=4, batch=2)
    built = {name: _build(name, config, torch.device("cpu")) for name in ("plain", "phalanx")}
    batch = (torch.randn(2, 4), torch.randn(2, 4))
    profile = profile_added(built, batch, steps=3, sync=lambda: None)
    assert profile["parts_ms"]["gradient hooks (the launches included)"] > 0
    assert profile["parts_ms"]["end of backward: wait, copy out, used map"] > 0
    assert any("reducer.py" in row["function"] for row in profile["top_own_time_ms"])
    results = {"tensors": 8, "config": {"width": 4, "layers": 4, "batch": 2, "device": "cpu", "steps": 2, "cpu": 0},
               "environment": {"torch": "x", "cpu": "cpu", "load_average_1min_at_end": 1.0},
               "summary": added_host_time({"plain": [[1.0]], "torch": [[2.0]], "phalanx": [[1.5]]}),
               "profile": profile}
    report = format_report(results)
    assert "phalanx/torch added    0.500" in report and "step guard (bucket/step_guard.py)" in report
    assert "on CPU 0" in report
