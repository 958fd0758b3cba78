"""Live recovery on one host: a rank SIGKILLed in the middle of a step, the ranks left go on in-process.

World size 3 (phalanx.spawn with min_world_size=2), the loop of docs/data.md unchanged (a global batch of 26,
micro-batches of 4, two epochs), with the shared-memory exchange and with Gloo's (PHALANX_SHM=0). Rank 2 kills
itself in step 1 of epoch 0: before its forward, in the middle of the gradient exchange (from a gradient hook,
with a bucket per parameter: some buckets are in flight), or after the exchange and before its optimizer step.
Ranks 0 and 1 keep their processes, agree on generation 1 through the store, regroup the model and the loader,
and redo at most the step in flight. Their final parameters equal one process's on whole global batches (the
run that never lost a rank: a global batch averages the same samples at any world size), and every sample
weighs in exactly once per epoch.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch.nn.functional as F

import phalanx as px
from phalanx.checkpoint.atomic_files import checkpoint_files, load_safely
from phalanx.testing import run_ranks
from phalanx.world import generation
from tests.helpers.global_batch_cases import (
    EPOCHS,
    GLOBAL_BATCH,
    MICRO_BATCH,
    SEED,
    Indexed,
    make_model,
    make_optimizer,
    parameters,
    reference_run,
)

LOST, LOST_AT = 2, (0, 1)  # rank 2, in step 1 of epoch 0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _train(rank: int, directory: str, moment: str) -> dict:
    dataset = Indexed()
    loader = px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                           sampler=px.DistributedSampler(dataset, seed=SEED))
    model = px.DistributedDataParallel(make_model(), bucket_cap_mb=1e-6)  # a bucket per parameter
    optimizer = make_optimizer(model)
    checkpointer = px.Checkpointer(os.path.join(directory, "checkpoints"), every=2)  # saves before and after
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    losses = []
    started_as = os.getpid()
    doomed = rank == LOST
    first_layer = model.module[0].weight  # its gradient comes last in backward: later buckets are in flight
    first_layer.register_hook(lambda grad: _die() if doomed and moment == "exchange" and armed[0] else None)
    armed = [False]
    with open(os.path.join(directory, f"ids-{rank}.jsonl"), "a") as log:
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for step in loader:
                optimizer.zero_grad()
                ids, attempt = [], 0
                for j, (index, x, y) in enumerate(step.micro_batches(model)):
                    if step.attempt != attempt:  # the loop started over on the ranks left: so do the ids
                        ids, attempt = [], step.attempt
                    here = doomed and (epoch, step.index) == LOST_AT
                    if here and moment == "forward":
                        _die()
                    armed[0] = here and j == step.num_micro_batches - 1  # the backward that exchanges
                    step.backward(F.mse_loss(model(x), y))
                    if step.weight:
                        ids += index.tolist()
                if doomed and (epoch, step.index) == LOST_AT and moment == "optimizer":
                    log.write(json.dumps([epoch, step.index, ids]) + "\n")  # the step is applied elsewhere
                    log.flush()
                    _die()
                optimizer.step()
                log.write(json.dumps([epoch, step.index, ids]) + "\n")
                log.flush()
                losses.append(px.metrics.all_reduce_sum(step.loss).item())  # over the ranks that train
                checkpointer.step(state)
    current = generation.current()
    return {"pid": (started_as, os.getpid()), "generation": (current.number, current.members),
            "params": parameters(model), "losses": losses, "main": px.is_main()}


def _applied_ids(directory: str) -> dict:
    applied: dict = {}
    for rank in range(3):
        with open(os.path.join(directory, f"ids-{rank}.jsonl")) as log:
            for line in log:
                epoch, step, ids = json.loads(line)
                applied.setdefault((epoch, step), []).extend(ids)
    return {key: sorted(ids) for key, ids in applied.items()}


@pytest.mark.parametrize("moment, shm", [("exchange", "1"), ("exchange", "0"), ("forward", "1"), ("optimizer", "0")],
                         ids=["mid-exchange-shm", "mid-exchange-gloo", "mid-forward-shm", "before-optimizer-gloo"])
def test_the_ranks_left_finish_the_run_as_if_no_rank_was_lost(tmp_path, moment, shm):
    results = run_ranks(_train, 3, (str(tmp_path), moment), min_world_size=2, timeout=180,
                        env={"PHALANX_SHM": shm, "PHALANX_MEMBERSHIP_TIMEOUT": "30"})
    assert results[LOST] is None, "rank 2 was expected to die"
    expected_params, expected_steps = reference_run()
    for rank in (0, 1):
        result = results[rank]
        assert result["pid"][0] == result["pid"][1], f"rank {rank} changed process"
        assert result["generation"] == (1, (0, 1)), f"rank {rank}: generation {result['generation']}"
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    assert _applied_ids(str(tmp_path)) == expected_steps, "a sample was lost or used twice"
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == len(expected_steps)
    assert (results[0]["main"], results[1]["main"]) == (True, False)
    directory = tmp_path / "checkpoints"
    files = checkpoint_files(directory)
    saved = load_safely(directory / files[max(files)], "cpu")  # the newest, saved by the two ranks left
    assert saved["world_size"] == 2, saved["world_size"]
