"""`phalanx run --min-world-size`: a worker SIGKILLed in the middle of a step costs the step in flight, not a restart.

Three workers on one node, the loop of docs/data.md (tests/e2e/jobs/live_recovery_job.py): a rank kills itself in
step 1 of epoch 0. The launcher keeps the other workers (the same processes to the end), says the rank was lost and
when the ranks left made their next step, and the run summary keeps the change; the run exits 0. The final
parameters equal one process's on whole global batches (tests/helpers/global_batch_cases.py), and every sample
weighs in once per epoch. Losing rank 0 works the same: the store is the launcher's, and the first rank left
becomes the main one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_command
from tests.helpers.global_batch_cases import reference_run
from tests.helpers.live_recovery_cases import applied_ids

JOB = str(Path(__file__).resolve().parent / "jobs" / "live_recovery_job.py")


@pytest.mark.parametrize("doomed, moment", [(2, "exchange"), (0, "forward")], ids=["rank2-mid-exchange",
                                                                                 "rank0-mid-forward"])
def test_a_lost_worker_costs_the_step_in_flight_and_the_run_ends_as_if_it_had_not_been_lost(tmp_path, doomed,
                                                                                             moment):
    output = run_command([sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "3", "--min-world-size", "2",
                          "--log-dir", str(tmp_path / "logs"), JOB, str(tmp_path), "--doomed", str(doomed),
                          "--at", "0:1", "--moment", moment], ROOT, timeout=180)
    assert f"rank {doomed} was lost (SIGKILL): the 2 ranks left go on in-process" in output, output
    timed = re.search(r"the 2 ranks left made step \d+ ([\d.]+) s after the loss", output)
    assert timed, output
    assert re.search(rf"rank {doomed} lost \(SIGKILL\), kept in-process: world size 3 -> 2", output), output
    survivors = [rank for rank in range(3) if rank != doomed]
    results = {rank: torch.load(tmp_path / f"result-{rank}.pt", weights_only=True) for rank in survivors}
    assert not (tmp_path / f"result-{doomed}.pt").exists()
    expected_params, expected_steps = reference_run()
    for rank, result in results.items():
        assert result["pid"][0] == result["pid"][1], f"rank {rank} changed process"
        assert result["generation"] == [1, survivors], f"rank {rank}: {result['generation']}"
        assert result["main"] == (rank == survivors[0]), f"rank {rank}: main={result['main']}"
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    assert applied_ids(str(tmp_path), 3) == expected_steps, "a sample was lost or used twice"
