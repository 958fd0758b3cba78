"""`phalanx bench` end to end: the harness runs, and its JSON, table and chart say what it measured.

The runs use --quick on one small model at world size 2. No timing is asserted. The single-process
checks (argument errors, the all-reduce import rule, the report) are in tests/unit/test_bench.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from phalanx.testing import run_ranks
from phalanx.tools import bench
from tests.conftest import ROOT, checkout_on_pythonpath, with_warm_launcher
from tests.helpers.forked_python import run_python

QUICK = ["--quick", "--models", "deep"]


def _check_results(results: dict, variants: list[str]) -> None:
    """The JSON schema the docs describe, with one entry per requested variant and consistent ratios."""
    assert results["schema"] == "phalanx-bench/1"
    assert {"date", "torch", "cpu", "threads_per_process"} <= set(results["environment"])
    config = results["config"]
    assert config["variants"] == variants and config["nproc"] == 2 and config["backend"] == "gloo"
    assert results["environment"]["threads_per_process"] == 1
    [model] = results["models"]
    assert model["name"] == "deep" and model["tensors"] == 180 and model["batch_per_rank"] == 64
    assert set(model["variants"]) == set(variants)
    for summary in model["variants"].values():
        assert len(summary["steps_ms"]) == config["blocks"]
        assert all(len(block) == config["steps"] for block in summary["steps_ms"])
        assert summary["min_ms"] <= summary["median_ms"] <= summary["p90_ms"]
    for name, value in model["ratios"].items():
        top, bottom = name.split("/")
        assert value == pytest.approx(model["variants"][top]["median_ms"] / model["variants"][bottom]["median_ms"])
    assert set(model["paired_ratios"]) == set(model["ratios"])


# -- world size 2 --------------------------------------------------------------------------------

def test_bench_command_times_torch_ddp_and_compute_only(tmp_path):
    """World size 2, launched by the command itself: runs without the phalanx engine too."""
    out = tmp_path / "results" / "bench.json"
    env = {**os.environ, "PYTHONPATH": checkout_on_pythonpath()}
    done = subprocess.run([sys.executable, "-m", "phalanx.tools.bench", *QUICK, "--variants", "torch,compute",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    _check_results(results, ["torch", "compute"])
    assert results["allreduce"]["status"] in {"ok", "not installed"}
    for expected in ("[bench] deep block 2/2 torch DDP", "torch DDP ms", "compute-only ms", "torch/compute"):
        assert expected in done.stdout
    if results["allreduce"]["status"] == "not installed":
        assert "shared-memory transport is not installed" in done.stdout
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bench_inside_world(rank: int, out: str) -> int:
    return bench.main([*QUICK, "--no-allreduce", "--out", out])


def test_bench_inside_a_world_compares_every_variant(tmp_path, capfd):
    """World size 2, already initialized (as under `phalanx run`): rank 0 reports every variant."""
    out = tmp_path / "bench.json"
    assert run_ranks(_bench_inside_world, 2, args=(str(out),), timeout=120) == [0, 0]
    results = json.loads(out.read_text())
    _check_results(results, ["torch", "phalanx", "phalanx-gloo", "compute"])
    assert set(results["models"][0]["ratios"]) == {"phalanx/torch", "phalanx-gloo/torch", "phalanx/compute",
                                                   "torch/compute"}
    assert results["allreduce"]["status"] == "skipped"
    assert "phalanx/torch" in capfd.readouterr().out


def _bench_profile_inside_world(rank: int, out: str) -> int:
    return bench.main([*QUICK, "--no-allreduce", "--variants", "phalanx,compute", "--profile", "--out", out])


def test_bench_profile_splits_a_phalanx_step_into_its_phases(tmp_path, capfd):
    """World size 2: --profile adds, per model and rank, the time of each exchange phase and the rest."""
    out = tmp_path / "bench.json"
    assert run_ranks(_bench_profile_inside_world, 2, args=(str(out),), timeout=120) == [0, 0]
    assert "where a phalanx DDP step goes" in capfd.readouterr().out
    for model in json.loads(out.read_text())["models"]:
        profile = model["profile"]
        assert profile["exchange"] == "ShmExchange" and len(profile["ranks"]) == 2
        for row in profile["ranks"]:
            phases = [row[p] for p in ("copy_in", "reduce", "wait", "copy_out")]
            assert all(value >= 0 for value in phases) and row["copy_in"] > 0 and row["reduce"] > 0
            assert row["rest"] == pytest.approx(row["step_ms"] - sum(phases))
            assert row["buckets"] and {b["mode"] for b in row["buckets"]} <= {"posted", "split", "all-reduce"}


# The peak RSS of 3 variants, each in 2 fresh processes (~15 s of CPU a variant: torch and torch._dynamo imported
# again): the ratios' base shard="none", torch's FSDP2 (a builder only this part runs) and the meta build; torch
# DDP, the other levels and ZeRO use builders the step times run, and all 8 are measured in docs/benchmarks.md.
RSS_SMOKE = ("torch-fsdp2", "phalanx-none", "phalanx-parameters+meta")


@pytest.mark.timeout(600)
def test_bench_memory_counts_bytes_rss_and_step_times(tmp_path):
    """World sizes 2 and 4 (byte count), 2 (peak RSS, step times; the FSDP2 level built normally and on
    meta), on a small MLP with a bucket per layer: the report's three parts; sharded modes hold fewer
    model-state bytes than shard='none'. No timing is asserted."""
    out = tmp_path / "memory.json"
    env = with_warm_launcher({**os.environ, "PYTHONPATH": checkout_on_pythonpath()})
    command = [sys.executable, "-m", "phalanx", "bench", "--memory", "--width", "256", "--bucket-cap-mb", "0.3",
               "--time-models", "deep", "--steps", "2", "--blocks", "1", "--rss-worlds", "2",
               "--rss-variants", ",".join(RSS_SMOKE), "--out", str(out)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    for world_size in ("2", "4"):
        per_rank = results["count"][world_size]
        assert len(per_rank) == int(world_size)
        for rank in per_rank:
            assert rank["parameters"]["total"] < rank["gradients"]["total"] < rank["optimizer"]["total"] \
                < rank["none"]["total"]
            assert rank["gradients"]["optimizer"] * int(world_size) == pytest.approx(rank["none"]["optimizer"],
                                                                                      rel=0.05)
    levels = {"phalanx-none", "phalanx-optimizer", "phalanx-gradients", "phalanx-parameters"}
    assert set(results["rss"]["2"]) == set(RSS_SMOKE)
    assert set(results["time"]["deep"]) == levels | {"torch-zero"}
    for expected in ("model-state bytes per rank, 4 ranks", "peak RSS per rank, 2 ranks", "step time, deep"):
        assert expected in done.stdout


def test_gpu_bench_smoke_runs_every_section_on_the_cpu(tmp_path):
    """World size 1: benchmarks/gpu/gpu_bench.py --smoke, the GPU benchmark's logic at toy sizes on the CPU: every
    section gives its figures, the goals are evaluated, the JSON and the markdown table are written."""
    script = ROOT / "benchmarks" / "gpu" / "gpu_bench.py"
    done = run_python([script, "--smoke", "--out", tmp_path], cwd=ROOT, timeout=600,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_on_pythonpath()})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert results["smoke"] is True and results["errors"] == {}
    assert set(results["steps"]) == {"large", "small", "peak_mib"}
    spread = results["steps"]["small"]["phalanx/torch spread"]
    assert spread["q1"] <= results["steps"]["small"]["phalanx/torch"] <= spread["q3"]
    assert len(results["steps"]["small"]["variants"]["phalanx"]["block_medians_ms"]) == results["sizes"]["small_blocks"]
    assert not (tmp_path / "gpu_bench.partial.json").exists()  # written after each section, gone at the end
    assert set(results["overlap"]["exposed_ms"]) == {"torch", "phalanx"}
    assert set(results["shard"]["variants"]) == {"torch", "torch-fsdp2", "phalanx-none", "phalanx-optimizer",
                                                 "phalanx-gradients", "phalanx-parameters"}
    assert results["shard"]["errors"] == {}
    assert [goal["goal"] for goal in results["goals"]] == ["phalanx/torch large", "phalanx/torch small",
                                                           "phalanx/plain large", "exposed ms phalanx - torch"]
    assert "| phalanx-parameters |" in (tmp_path / "gpu_bench.md").read_text()


def test_gpu_small_profile_smoke_gives_every_reading_on_the_cpu(tmp_path):
    """World size 1: benchmarks/gpu/gpu_small_profile.py --smoke (the small-batch diagnosis of issue 36 at toy sizes
    on the CPU): per variant the thread CPU, process CPU and wall time per step, and the profiler's counts."""
    script = ROOT / "benchmarks" / "gpu" / "gpu_small_profile.py"
    done = run_python([script, "--smoke", "--rounds", "2", "--steps", "1", "--out", tmp_path], cwd=ROOT, timeout=300,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_on_pythonpath()})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "small_profile.json").read_text())
    assert set(results["summary"]) == {"plain", "torch", "phalanx", "phalanx-view"}
    for readings in results["per"].values():
        assert all(len(readings[clock]) == 2 and min(readings[clock]) > 0
                   for clock in ("thread_cpu_ms", "process_cpu_ms", "wall_ms"))
    assert set(results["profiles"]) == set(results["summary"])
    # The cProfile of phalanx's steps lists the engine's own functions apart (torch's may fill the top 30)
    # and names its gradient hook there.
    assert "on_grad_accumulated" in done.stdout.partition("phalanx's own functions, by their own time:")[2]
