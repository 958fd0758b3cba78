"""Ranks that join a run in progress are taken in at a step boundary, with the state of the ranks that train handed
over the network: no restart of those, no checkpoint read.

Two ranks train the loop of docs/data.md (tests/e2e/jobs/join_job.py) under live recovery; once they made a step,
one or two more processes start with PHALANX_JOIN=1 and ranks drawn from the run's store, as `phalanx run` starts a
joining node's workers (tests/e2e/test_live_recovery.py covers that across hosts). The ranks that train keep their
processes; every rank ends in the generation that took the joiners in; the joiners read no file, start from the step
after the one they were taken in at, and end with the same parameters as the others and as one process on whole
global batches (the run that never changed its world); every sample weighs in once per epoch.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.testing import free_port
from phalanx.world import joining
from tests.conftest import ROOT
from tests.helpers.forked_python import start_python
from tests.helpers.global_batch_cases import reference_run
from tests.helpers.live_recovery_cases import applied_ids, steplog_records

JOB = str(Path(__file__).resolve().parent / "jobs" / "join_job.py")
ATTEMPT = "join-test"


def _start(env: dict, rank: int, world_size: int, directory: Path, extra: list, **more):
    """The job as one rank, in a fork of this process's fork server (which imported torch once), as a
    launcher's forked worker runs (tests/helpers/forked_python.py); its output in log-RANK.txt."""
    env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world_size), **more}
    return start_python([JOB, str(directory), *extra], cwd=ROOT, env=env, log=directory / f"log-{rank}.txt")


def _two_ranks_and_joiners(tmp_path: Path, joiners: int, extra: list) -> tuple[list, list]:
    """Two ranks train (the job with `extra`); once they made a step, `joiners` more start as joiners, their ranks
    drawn from the run's store as a launcher draws them. Returns (every process's exit code, the joiners' ranks)."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PHALANX_MIN_WORLD_SIZE": "1",
           "PHALANX_STORE_ATTEMPT": ATTEMPT, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    processes = [_start(env, rank, 2, tmp_path, extra) for rank in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ids-0.jsonl").exists() or not (tmp_path / "ids-0.jsonl").read_text():
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), _logs(tmp_path)
            time.sleep(0.1)
        store = dist.PrefixStore(f"phalanx/{ATTEMPT}", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                                      timeout=timedelta(seconds=30)))
        drawn = joining.draw_ranks(store, joiners)
        processes += [_start(env, rank, rank + 1, tmp_path, extra, PHALANX_JOIN="1") for rank in drawn]
        return [p.wait(timeout=180) for p in processes], drawn
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("joiners, adam, shard", [(1, False, "none"), (2, True, "none"), (1, True, "gradients"),
                                                 (2, False, "optimizer")],
                         ids=["one-joiner-sgd", "two-joiners-adamw", "one-joiner-adamw-shard-gradients",
                              "two-joiners-sgd-shard-optimizer"])
def test_joiners_are_taken_in_and_the_run_ends_as_if_the_world_had_not_changed(tmp_path, joiners, adam, shard):
    hidden = 8 if shard == "none" else 64  # sharded: every rank owns elements of the model
    extra = ["--wait-for-joiners-at", "0:2", "--joiners", str(joiners), "--pause", "0.3", *(["--adam"] if adam else []),
             "--shard", shard, "--hidden", str(hidden)]
    codes, drawn = _two_ranks_and_joiners(tmp_path, joiners, extra)
    assert drawn == list(range(2, 2 + joiners))  # after the first world's ranks
    assert codes == [0] * (2 + joiners), _logs(tmp_path)
    world = list(range(2 + joiners))
    results = {rank: torch.load(tmp_path / f"result-{rank}.pt", weights_only=True) for rank in world}
    expected_params, expected_steps = reference_run(adam=adam, hidden=hidden)
    # The joiners are taken in together, or one at a step as each becomes ready: a generation per admission.
    assert results[0]["generation"] in ([1, world], [2, world]), results[0]["generation"]
    for rank, result in results.items():
        assert result["pid"][0] == result["pid"][1], f"rank {rank} changed process"
        assert result["generation"] == results[0]["generation"], f"rank {rank}: {result['generation']}"
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    for rank, result in results.items():  # a generation replaced by a larger one leaves no group behind
        final = result["generation"][0]
        older = [name for name in result["groups"] if f"/join{rank}/" in name or any(
            f"/generation{number}/" in name for number in range(final))]
        assert older == [], f"rank {rank} holds groups of generations before {final}: {older}"
    for rank in drawn:
        assert results[rank]["files_read"] == [], f"joiner {rank} read {results[rank]['files_read']}"
        joined_at = results[rank]["joined_at"]
        assert joined_at >= 3 and results[rank]["first_step"] == [joined_at // 4, joined_at % 4], results[rank]
    assert applied_ids(str(tmp_path), len(world)) == expected_steps, "a sample was lost or used twice"
    assert "joined: " in (tmp_path / "log-0.txt").read_text()
    # The StepLog logged every step, over 2 ranks then over all of them (the joiners took the step count over).
    records = steplog_records(str(tmp_path))
    assert [record["step"] for record in records] == list(range(1, len(expected_steps) + 1)), records
    sizes = [record["world_size"] for record in records]
    assert sizes == sorted(sizes) and sizes[0] == 2 and sizes[-1] == len(world), sizes


def _logs(directory: Path) -> str:
    return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(directory.glob("log-*.txt")))


def test_a_joiner_lost_while_it_is_taken_in_leaves_the_others_training(tmp_path):
    """The joiner SIGKILLs itself once the handover's first message reached it: the two ranks that train notice it
    gone (its connection closed, or its process watched), regroup without it and finish the run in-process, equal
    to one process on whole global batches."""
    extra = ["--wait-for-joiners-at", "0:2", "--pause", "0.3", "--die-in-handover", "--ballast-mb", "50"]
    codes, _ = _two_ranks_and_joiners(tmp_path, 1, extra)
    assert codes[:2] == [0, 0] and codes[2] == -9, _logs(tmp_path)
    expected_params, expected_steps = reference_run()
    for rank in (0, 1):
        result = torch.load(tmp_path / f"result-{rank}.pt", weights_only=True)
        assert result["pid"][0] == result["pid"][1], f"rank {rank} changed process"
        assert result["generation"] == [2, [0, 1]], f"rank {rank}: {result['generation']}"
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    assert not (tmp_path / "ids-2.jsonl").exists() or not (tmp_path / "ids-2.jsonl").read_text()
    assert applied_ids(str(tmp_path), 2) == expected_steps, "a sample was lost or used twice"
    assert "lost ranks [2]" in (tmp_path / "log-0.txt").read_text(), _logs(tmp_path)
