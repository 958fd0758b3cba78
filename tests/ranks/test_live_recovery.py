"""Live recovery on one host: a rank SIGKILLed in the middle of a step, the ranks left go on in-process.

World size 3 (phalanx.spawn with min_world_size=2), the loop of docs/data.md unchanged (tests/helpers/
live_recovery_cases.py: a global batch, a Checkpointer, a metric per step), with the shared-memory exchange and with
Gloo's (PHALANX_SHM=0). Rank 2 kills itself in step 1 of epoch 0: before its forward, in the middle of the gradient
exchange (some buckets in flight), after the exchange and before its optimizer step, or in a background save (its
part never written: the checkpoint is given up, not waited for); over Gloo, rank 0, which speaks for the host in the
per-step commit, dies in it, before it tells the others the outcome or after; or rank 2 dies in the step's metric
once its value reached one rank only (rank 0, or rank 1: the main rank behind), which finishes the metric and goes on
while the other meets the loss in it: the one behind takes the value (world/resume_point.py), and the StepLog and the
Checkpointer line up on the same steps. Ranks 0 and 1 keep their
processes, agree on generation 1 through the store, regroup the model and the loader, and redo at most the step in
flight. Their final parameters equal one process's on whole global batches (the run that never lost a rank: a
global batch averages the same samples at any world size), every sample weighs in exactly once per epoch, the
metric and the checkpoints go on over the two ranks left, and the process groups the loss left are freed (two
losses in a row too).

Sharded (shard="optimizer" and "gradients", SGD with momentum and AdamW): rank 1 is lost instead (rank 2 owns no
parameter's elements on this model), its optimizer shard comes back from the copy rank 2 keeps, and a loss in
the optimizer step rolls that step back and redoes it; the same final parameters. shard="parameters" says at the
start that a loss restarts the run.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.testing import run_ranks
from tests.helpers.global_batch_cases import Indexed, make_model, reference_run
from tests.helpers.live_recovery_cases import (
    applied_ids,
    check_world_views,
    newest_checkpoint,
    next_step_after,
    shm_mapped_after_training,
    steplog_records,
    train,
)

LOST_AT = (0, 1)  # step 1 of epoch 0


# A sharded run loses rank 1: on this model (a bucket per parameter, chunks of 16 elements) rank 2 owns no
# parameter's elements, only padding, while rank 1 owns half of the first layer's weights, kept by rank 2.
@pytest.mark.parametrize("moment, shm, shard, lost", [
    ("exchange", "1", "none", 2), ("exchange", "0", "none", 2), ("forward", "1", "none", 0),
    ("optimizer", "0", "none", 2), ("exchange", "0", "gradients", 1), ("optimizer", "1", "gradients", 1),
    ("forward", "0", "optimizer", 1), ("optimizer", "0", "optimizer", 1), ("save", "1", "none", 2),
    ("commit", "0", "none", 0), ("committed", "0", "none", 0), ("metric", "0", "none", 2),
    ("metric-to-1", "1", "none", 2)],
    ids=["mid-exchange-shm", "mid-exchange-gloo", "rank0-mid-forward-shm", "before-optimizer-gloo",
         "gradients-mid-exchange-gloo", "gradients-before-optimizer-shm", "optimizer-mid-forward-gloo",
         "optimizer-before-optimizer-gloo", "mid-save-shm", "host-leader-mid-commit-gloo",
         "host-leader-after-its-word-gloo", "mid-metric-ended-on-rank0-only-gloo",
         "mid-metric-ended-on-rank1-only-shm"])
def test_the_ranks_left_finish_the_run_as_if_no_rank_was_lost(tmp_path, moment, shm, shard, lost):
    _finish_as_if_no_rank_was_lost(tmp_path, moment, shm, shard, lost)


@pytest.mark.parametrize("moment, outcome", [("decided", "applied"), ("undecided", "redone")],
                         ids=["root-lost-after-its-word-left-its-host", "root-lost-before-its-word-left"])
def test_ranks_in_doubt_after_the_tree_root_is_lost_end_the_step_as_the_ranks_left_say(tmp_path, capfd, moment,
                                                                                       outcome):
    """Two emulated hosts, ranks 0 and 1 on the first, rank 2 on the second, over Gloo: the commit goes along the
    tree, whose root is rank 0. It decides the doomed step and dies before its follower, rank 1, hears the word:
    after the word went to rank 2 ("decided": rank 2 applies the step, and rank 1, in doubt, applies it once rank 2
    says so as it regroups), or before it went anywhere (both in doubt; nobody left applied it: both redo it).
    Either way the run ends as one process on whole global batches, every sample used once."""
    _finish_as_if_no_rank_was_lost(tmp_path, moment, "0", "none", 0, per_host=2)
    doubts = [line for line in capfd.readouterr().err.splitlines() if "was in doubt about step" in line]
    assert doubts and all(f": {outcome}, as the ranks left say" in line for line in doubts), doubts
    assert any("rank 1 was in doubt" in line for line in doubts), doubts


def _finish_as_if_no_rank_was_lost(tmp_path, moment, shm, shard, lost, per_host=None):
    results = run_ranks(train, 3, (str(tmp_path), lost, LOST_AT, moment, 0.0, shard, False, 8, None, per_host),
                        min_world_size=2, timeout=180,
                        env={"PHALANX_SHM": shm, "PHALANX_DDP_STALL_TIMEOUT": "20", "PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    assert results[lost] is None, f"rank {lost} was expected to die"
    survivors = tuple(rank for rank in range(3) if rank != lost)
    expected_params, expected_steps = reference_run()
    for rank in survivors:
        result = results[rank]
        assert result["pid"][0] == result["pid"][1], f"rank {rank} changed process"
        assert result["generation"] == (1, survivors), f"rank {rank}: generation {result['generation']}"
        # Groups are made with a generation (world/generations/current.py's meet), never in a step: a rank lost while a
        # slower one made a group in a step would leave that one connecting to it, in a call nothing can watch or abort.
        assert result["groups_made"] == ["current.py"] * 2, f"rank {rank}: {result['groups_made']}"
        assert result["older_groups_alive"] == [], f"rank {rank} still holds the groups the loss left"
        # generation 0's Gloo loops, left by the loss (a collective pending on them may spin them: gloo_loops.py), run
        # at idle priority (or ended with their group); the current generation's do not
        assert result["first_loops"] and set(result["first_loops"]) <= {os.SCHED_IDLE, None}, result["first_loops"]
        assert result["loops_now"] and os.SCHED_IDLE not in result["loops_now"], result["loops_now"]
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    assert applied_ids(str(tmp_path), 3) == expected_steps, "a sample was lost or used twice"
    # About 0.3 s on this machine (docs/benchmarks.md); a wait that ran into a timeout (20-30 s here) would show
    took = next_step_after(str(tmp_path), survivors, float((tmp_path / "died-at").read_text()))
    assert took is not None and took < 10, f"the ranks left made their next step {took} s after the loss"
    first, second = (results[rank] for rank in survivors)
    assert first["losses"] == second["losses"] and len(first["losses"]) == len(expected_steps)
    assert (first["main"], second["main"]) == (True, False)
    # px.rank() and px.world_size() follow the ranks that train: the two left are ranks 0 and 1 of 2 from the loss on
    assert [view[1:4] for view in first["views"] if view[0] == 1] == [(0, 2, True)], first["views"]
    assert [view[1:4] for view in second["views"] if view[0] == 1] == [(1, 2, False)], second["views"]
    check_world_views(results)
    assert newest_checkpoint(str(tmp_path))["world_size"] == 2  # saved by the two ranks left, and loadable
    _check_the_steplog_went_on(str(tmp_path), len(expected_steps), survivors)


def test_a_loss_over_shared_memory_leaves_none_of_it_mapped_once_the_model_is_gone(tmp_path):
    """Four ranks on shared memory lose rank 3 in an exchange. The communicator of the generation before failed there,
    and its failure's traceback holds it: once the model is gone, the ranks left map no shared memory (it had kept
    the old segment, 4 x 32 MB, to the process's end)."""
    mapped = run_ranks(shm_mapped_after_training, 4, (str(tmp_path), 3), min_world_size=3, timeout=180,
                       env={"PHALANX_SHM": "1", "PHALANX_DDP_STALL_TIMEOUT": "20", "PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    assert mapped[3] is None, "rank 3 was expected to die"
    assert all(mapped[rank] < 2**20 for rank in range(3)), f"bytes of /dev/shm still mapped per rank: {mapped}"


@pytest.mark.parametrize("shm", ["0", "1"], ids=["gloo", "shm"])
def test_two_losses_in_a_row_leave_no_process_group_behind(tmp_path, shm):
    """Four ranks lose rank 3, then rank 2: the two left end as one process on whole global batches, in generation
    2, and hold none of the process groups of generations 0 and 1 (each used Gloo group keeps ~3 MB and its sockets
    until freed: a long run losing ranks would grow by that much per loss)."""
    results = run_ranks(train, 4, (str(tmp_path), 3, LOST_AT, "exchange", 0.0, "none", False, 8, (2, (1, 0))),
                        min_world_size=2, timeout=240, env={"PHALANX_SHM": shm, "PHALANX_DDP_STALL_TIMEOUT": "20",
                                                            "PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    assert results[2] is None and results[3] is None, "ranks 2 and 3 were expected to die"
    expected_params, expected_steps = reference_run()
    for rank in (0, 1):
        assert results[rank]["generation"] == (2, (0, 1)), f"rank {rank}: {results[rank]['generation']}"
        assert results[rank]["older_groups_alive"] == [], f"rank {rank} still holds the groups the losses left"
        for ours, theirs in zip(results[rank]["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    assert applied_ids(str(tmp_path), 4) == expected_steps, "a sample was lost or used twice"
    check_world_views(results)
    assert {view[:3] for rank in (0, 1) for view in results[rank]["views"] if view[0] == 2} == {(2, 0, 2), (2, 1, 2)}


def test_a_rank_lost_as_the_ranks_left_make_their_groups_is_left_out_and_they_go_on(tmp_path, capfd):
    """Four ranks lose rank 3 in a step; rank 2, counted in by the survivors' agreement, dies as it starts making the
    new generation's groups. Ranks 0 and 1 agree again without it and go on in-process (before: their groups failed
    on it, and the run restarted from its checkpoint): generation 1 of (0, 1), equal to one process on whole global
    batches, every sample used once."""
    results = run_ranks(train, 4, (str(tmp_path), 3, LOST_AT, "exchange", 0.0, "none", False, 8, (2, "groups")),
                        min_world_size=2, timeout=240, env={"PHALANX_SHM": "0", "PHALANX_DDP_STALL_TIMEOUT": "20",
                                                            "PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    assert results[2] is None and results[3] is None, "ranks 2 and 3 were expected to die"
    assert "the ranks left agree again" in capfd.readouterr().err
    expected_params, expected_steps = reference_run()
    for rank in (0, 1):
        assert results[rank]["pid"][0] == results[rank]["pid"][1], f"rank {rank} changed process"
        assert results[rank]["generation"] == (1, (0, 1)), f"rank {rank}: {results[rank]['generation']}"
        for ours, theirs in zip(results[rank]["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    assert applied_ids(str(tmp_path), 4) == expected_steps, "a sample was lost or used twice"
    check_world_views(results)


def _check_the_steplog_went_on(directory: str, steps: int, survivors: tuple) -> None:
    """The StepLog kept logging on the ranks left: every step of the run is in exactly one record, under its number
    (the windows being gathered when the world changed are gathered again among the ranks left), those after the
    loss over the survivors, naming them by their launch ranks."""
    records = steplog_records(directory)
    numbers = [record["step"] for record in records]
    assert numbers == list(range(1, steps + 1)), numbers
    after = [record for record in records if record["world_size"] == len(survivors)]
    assert after and after[-1] is records[-1], [record["world_size"] for record in records]
    assert {record["slowest_rank"] for record in after} <= set(survivors)
    assert {record["peak_memory_rank"] for record in after} <= set(survivors)
    assert all(record["samples"] > 0 for record in records)


@pytest.mark.parametrize("moment", ["optimizer", "exchange", "clip"])
def test_a_sharded_adam_state_is_put_back_together_from_the_copies(tmp_path, moment):
    """AdamW at shard="gradients": its per-element moments and its step count of the lost rank's chunk come back
    from the copy its keeper holds (rolled back to before the step when the loss came in the optimizer step; the
    step redone when it came in clip_grad_norm_'s all-reduce), so the run ends as one process's on whole global
    batches."""
    results = run_ranks(train, 3, (str(tmp_path), 1, LOST_AT, moment, 0.0, "gradients", True), min_world_size=2,
                        timeout=180, env={"PHALANX_SHM": "0", "PHALANX_DDP_STALL_TIMEOUT": "20",
                                          "PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    expected_params, expected_steps = reference_run(adam=True)
    for rank in (0, 2):
        assert results[rank]["generation"] == (1, (0, 2))
        for ours, theirs in zip(results[rank]["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    assert applied_ids(str(tmp_path), 3) == expected_steps, "a sample was lost or used twice"


def _what_the_run_says(rank: int, shard: str = "parameters") -> list[str]:
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("phalanx").addHandler(handler)
    model = px.DistributedDataParallel(make_model(), shard=shard)
    model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    dataset = Indexed()
    loader = px.DataLoader(dataset, batch_size=4, global_batch_size=8, sampler=px.DistributedSampler(dataset))
    for step in loader:
        for _, x, y in step.micro_batches(model):
            step.backward(F.mse_loss(model(x), y))
        break
    return said


def test_shard_parameters_says_at_the_start_that_a_loss_restarts_the_run():
    """FSDP2's level keeps no copy of a rank's shards: its run says so, and that a loss falls back to the restart
    (the launcher then does not keep the others), although its loop is a global batch's."""
    said = run_ranks(_what_the_run_says, 2, (), min_world_size=1, timeout=120)[0]
    assert any("live recovery off for this loop: shard='parameters' keeps no copy" in line for line in said), said
    assert not any(line.startswith("live recovery on") for line in said), said


def test_with_the_shard_copies_off_a_sharded_run_says_a_loss_restarts_it():
    """PHALANX_SHARD_COPIES=0: no copy of a shard, so a loss falls back to the restart, and the run says so at the
    start (its launcher keeps no survivors)."""
    said = run_ranks(_what_the_run_says, 2, ("gradients",), min_world_size=1, timeout=120,
                     env={"PHALANX_SHARD_COPIES": "0"})[0]
    assert any("live recovery off for this loop: PHALANX_SHARD_COPIES=0" in line for line in said), said
    assert not any(line.startswith("live recovery on") for line in said), said
