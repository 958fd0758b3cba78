"""examples/slurm/: each GPU script runs exactly what its CPU variant runs (the CPU variants are the ones
tests/e2e/test_slurm.py submits to a real cluster), and docs/launching.md shows the lines they run."""

import re

import pytest

from tests.conftest import ROOT

SLURM = ROOT / "examples" / "slurm"


def commands(text: str) -> list[str]:
    """The lines bash runs: no comments, no #SBATCH directives, no blank lines."""
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def directives(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


@pytest.mark.parametrize("gpu, cpu", [("train.sbatch", "train_cpu.sbatch"),
                                      ("phalanx_run.sbatch", "phalanx_run_cpu.sbatch")])
def test_the_gpu_script_runs_what_its_tested_cpu_variant_runs(gpu, cpu):
    gpu_text, cpu_text = (SLURM / gpu).read_text(), (SLURM / cpu).read_text()
    assert commands(gpu_text) == commands(cpu_text)
    assert "gpus-per-node" in directives(gpu_text) and "gpus-per-node" not in directives(cpu_text)
    for text in (gpu_text, cpu_text):
        wanted = {"requeue": None, "signal": "B:USR1@60", "open-mode": "append"}
        assert {name: directives(text).get(name) for name in wanted} == wanted


def test_launching_md_shows_the_requeue_lines_the_examples_run():
    doc = (ROOT / "docs" / "launching.md").read_text()
    for name in ("train_cpu.sbatch", "phalanx_run_cpu.sbatch"):
        example = commands((SLURM / name).read_text())
        start = next(i for i, line in enumerate(example) if line.startswith("tasks=$!"))
        for line in example[start:]:
            assert line in doc, f"docs/launching.md lacks {name}'s line {line!r}"
