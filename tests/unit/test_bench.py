"""`phalanx bench` in this process: argument errors, the all-reduce import rule, the report.

The runs of the harness (world size 2: the command, and inside a world) are in tests/e2e/test_bench.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from phalanx.tools import bench
from phalanx.tools.bench_report import format_table, paired_ratios, ratios, summarize


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
