"""`phalanx bench`: the harness runs end to end, and its JSON, table and chart say what it measured.

Single-process checks (argument errors, the all-reduce import rule, the report) come first; the
multi-process runs use --quick on one small model at world size 2. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from phalanx.testing import run_ranks
from phalanx.tools import bench
from phalanx.tools.bench_report import format_table, paired_ratios, ratios, summarize
from tests.conftest import ROOT as REPO

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


# -- single process ----------------------------------------------------------------------------

def test_cuda_without_a_gpu_fails_with_a_clear_message(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-GPU message cannot be provoked")
    assert bench.main(["--device", "cuda", "--models", "gpt"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err


def test_unknown_model_names_it_and_the_choices(capsys):
    assert bench.main(["--models", "wide,resnet"]) == 2
    err = capsys.readouterr().err
    assert "resnet" in err and "wide,deep,gpt,gpt-large" in err


def test_allreduce_is_not_installed_only_when_its_module_is_missing(monkeypatch):
    real_import = bench.importlib.import_module

    def missing(name, missing_name):
        def fake(requested, *args):
            if requested == name:
                raise ModuleNotFoundError(f"No module named {missing_name!r}", name=missing_name)
            return real_import(requested, *args)
        return fake

    monkeypatch.setattr(bench.importlib, "import_module", missing("phalanx.tools.bench_allreduce",
                                                                  "phalanx.tools.bench_allreduce"))
    assert bench.load_allreduce_bandwidth() is None
    # The module exists but one of its own imports fails: that is a bug to show, not "not installed".
    monkeypatch.setattr(bench.importlib, "import_module", missing("phalanx.tools.bench_allreduce", "some_dependency"))
    with pytest.raises(ModuleNotFoundError, match="some_dependency"):
        bench.load_allreduce_bandwidth()
    monkeypatch.setattr(bench.importlib, "import_module", real_import)
    present = types.ModuleType("phalanx.tools.bench_allreduce")
    present.allreduce_bandwidth = lambda sizes_mb: [{"size_mb": s} for s in sizes_mb]
    monkeypatch.setitem(sys.modules, "phalanx.tools.bench_allreduce", present)
    assert bench.load_allreduce_bandwidth() is present.allreduce_bandwidth


def test_report_ratios_are_medians_over_all_blocks():
    variants = {"torch": summarize([[4.0, 9.0, 5.0], [6.0, 1.0, 7.0]]), "compute": summarize([[2.0, 3.0], [2.5, 9.0]])}
    assert variants["torch"]["median_ms"] == 5.5 and variants["torch"]["block_medians_ms"] == [5.0, 6.0]
    assert ratios(variants) == {"torch/compute": pytest.approx(5.5 / 2.75)}
    # per round: 5.0 / 2.5 and 6.0 / 5.75, then their median
    assert paired_ratios(variants) == {"torch/compute": pytest.approx((2.0 + 6.0 / 5.75) / 2)}
    results = {"config": {"variants": ["torch", "compute"], "nproc": 2, "threads": 1, "backend": "gloo",
                          "device": "cpu", "blocks": 2, "steps": 3, "warmup": 1},
               "models": [{"name": "deep", "params": 998_400, "tensors": 180, "batch_per_rank": 64,
                           "variants": variants, "ratios": ratios(variants)}],
               "allreduce": {"status": "not installed"}}
    table = format_table(results)
    assert "torch DDP ms" in table and "compute-only ms" in table and "phalanx DDP" not in table
    assert "deep" in table and "5.50" in table and "2.000" in table
    assert "shared-memory transport is not installed" in table


# -- world size 2 --------------------------------------------------------------------------------

def test_bench_command_times_torch_ddp_and_compute_only(tmp_path):
    """World size 2, launched by the command itself: runs without the phalanx engine too."""
    out = tmp_path / "results" / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
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
