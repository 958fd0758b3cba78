"""Exact resume end to end (world size 2): `phalanx run --max-restarts 2` restarts a job killed with
SIGKILL, and its final parameters are bitwise equal to an uninterrupted run's, dropout included.

Kill points (tests/e2e/jobs/resume_job.py, checkpoints at steps 7 and 14, 5 steps per epoch): before the
first checkpoint, right after one, mid-epoch, and in the last epoch; two per launch.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phalanx as px
from tests.conftest import ROOT, with_warm_launcher

JOB = Path(__file__).resolve().parent / "jobs" / "resume_job.py"

MISSING = [f"phalanx.{name}" for name in ("DistributedDataParallel", "DataLoader", "DistributedSampler")
           if not hasattr(px, name)]
if importlib.util.find_spec("phalanx.launch.run") is None or importlib.util.find_spec("phalanx.__main__") is None:
    MISSING.append("`python -m phalanx run` (phalanx.launch.run, phalanx.__main__)")
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the exact-resume test needs {', '.join(MISSING)}")

KILLS = {  # ATTEMPT:RANK:STEP:WHEN, one kill per attempt; the attempt after the last kill runs to the end
    "before_first_checkpoint_then_right_after_it": (["0:1:4:start", "1:0:7:saved"], [["ckpt-00000001.pt"]]),
    "mid_epoch_then_last_epoch": (["0:0:12:start", "1:1:18:start"], [["ckpt-00000001.pt", "ckpt-00000002.pt"]]),
    # Killed while its background writer writes the step-14 checkpoint: the restart resumes from that one if
    # the writer had committed it, else from the one before; never from a partial one.
    "while_a_write_is_in_flight": (["0:0:14:writing"], [["ckpt-00000001.pt"], ["ckpt-00000002.pt"]]),
}


def launch(run_dir: Path, kills=()):
    command = [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", "--max-restarts", "2",
               str(JOB), str(run_dir), *(f"--kill={k}" for k in kills)]
    env = with_warm_launcher({**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                              "CUDA_VISIBLE_DEVICES": ""})
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    attempts = [int(line) for line in (run_dir / "attempts.log").read_text().split()]
    return torch.load(run_dir / "final.pt", weights_only=True), attempts, output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    final, attempts, _ = launch(tmp_path_factory.mktemp("uninterrupted"))
    assert attempts == [0]
    return final


@pytest.mark.parametrize("kills, resumed_from", KILLS.values(), ids=KILLS.keys())
def test_killed_run_ends_bitwise_equal_to_uninterrupted(tmp_path, uninterrupted, kills, resumed_from):
    """World size 2 under `phalanx run --max-restarts 2`: one or two kills, an attempt after each."""
    final, attempts, output = launch(tmp_path / "run", kills)
    assert attempts == list(range(len(kills) + 1)), "the workers were not killed and restarted as planned"
    assert re.findall(r"resumed from \S*/(ckpt-\d+\.pt)", output) in resumed_from
    assert final["step"] == uninterrupted["step"] == 20
    assert all(torch.equal(a, b) for a, b in zip(final["params"], uninterrupted["params"]))
