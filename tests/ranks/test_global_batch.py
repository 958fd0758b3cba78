"""DataLoader(global_batch_size=B) on real ranks (Gloo CPU processes via phalanx.testing.run_ranks): the same
script with the same B at 1, 2, 3 and 4 ranks (simulated ranks: tests/unit/test_global_batch.py) ends at
the parameters of one process that takes each step's B samples at once, with phalanx's DDP at every
shard level and with torch's DDP; and a run stopped at 4 ranks (an agreed stop), resumed at 2 and again at 3
from Checkpointer files, applies each step once, with each step's samples, each sample once per epoch.

Data and loop: tests/helpers/global_batch_cases.py (80 samples, B = 26, micro-batches of at most 4: uneven
splits at 3 and 4 ranks, padding micro-batches in each epoch's last step of 2 samples).
"""

import pytest
import torch

import phalanx as px
from phalanx.testing import run_ranks
from phalanx.world import stop
from tests.helpers.global_batch_cases import (
    EPOCHS,
    GLOBAL_BATCH,
    MICRO_BATCH,
    SEED,
    SIZE,
    Indexed,
    make_model,
    make_optimizer,
    reference_run,
    train_epochs,
)
from tests.helpers.shard_cases import whole_parameters

STEPS = EPOCHS * -(-SIZE // GLOBAL_BATCH)


def make_loader():
    dataset = Indexed()
    sampler = px.DistributedSampler(dataset, shuffle=True, seed=SEED)
    return px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, sampler=sampler)


def wrap(engine):
    model = make_model()
    if engine == "torch":
        model = torch.nn.parallel.DistributedDataParallel(model)
        return model, make_optimizer(model)
    if engine == "bucket_view":
        model = px.DistributedDataParallel(model, gradient_as_bucket_view=True)
        return model, make_optimizer(model)
    model = px.DistributedDataParallel(model, shard=engine)
    optimizer = make_optimizer(model)
    return model, (model.shard_optimizer(optimizer) if engine != "none" else optimizer)


def _mismatch(rank):
    """A sampler told of 1 rank under a model averaging over the world: a typed error, before any collective."""
    model, _ = wrap("none")
    dataset = Indexed()
    sampler = px.DistributedSampler(dataset, num_replicas=1, rank=0, seed=SEED)
    step = next(iter(px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, sampler=sampler)))
    try:
        next(step.micro_batches(model))
    except px.DataConfigError as error:
        return str(error)
    return None


def _train_with(rank, engines):
    out = {"mismatch": _mismatch(rank)}
    for engine in engines:
        model, optimizer = wrap(engine)
        loader = make_loader()
        log = {}
        train_epochs(loader, model, optimizer, log)
        out[engine] = {"params": whole_parameters(model), "log": log, "plan": loader.plan}
    return out


def _check(per_rank, world, engines):
    expected_params, expected_steps = reference_run()
    for engine in engines:
        for rank, results in enumerate(per_rank):
            where = f"{engine} on rank {rank} of {world}"
            for ours, theirs in zip(results[engine]["params"], expected_params):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, msg=lambda m, where=where: f"{where}: {m}")
        applied = {key: sorted(i for results in per_rank for i in results[engine]["log"][key])
                   for key in per_rank[0][engine]["log"]}
        assert applied == expected_steps, f"{engine} at {world} ranks: another sample set in some step"
        plan = per_rank[0][engine]["plan"]
        assert (plan.world_size, plan.micro_batch_size, plan.global_batch_size) == (world, MICRO_BATCH, GLOBAL_BATCH)


def test_same_global_batch_at_1_rank():
    """World size 1 (26 samples in 7 micro-batches per step), DDP-wrapped as at the other sizes."""
    engines = ["none", "torch"]
    _check(run_ranks(_train_with, 1, (engines,), timeout=240), 1, engines)


def test_same_global_batch_at_2_ranks_every_shard_level_and_torch_ddp():
    """World size 2 (13 samples per rank and step): phalanx's DDP at each shard level and with
    gradient_as_bucket_view (micro-batches accumulate into the buckets), torch's DDP."""
    engines = ["none", "optimizer", "gradients", "parameters", "bucket_view", "torch"]
    per_rank = run_ranks(_train_with, 2, (engines,), timeout=240)
    _check(per_rank, 2, engines)
    for rank, results in enumerate(per_rank):
        assert results["mismatch"].startswith(f"[rank {rank}] the model averages its gradients over another number")
        assert "seen a model over 2 ranks, DistributedSampler(num_replicas=1)" in results["mismatch"]


@pytest.mark.smoke
def test_same_global_batch_at_3_ranks_with_a_count_weighted_split_and_padding():
    """World size 3 (8 or 9 samples per rank and step; in each epoch's last step one rank has only padding)."""
    engines = ["none", "parameters", "torch"]
    _check(run_ranks(_train_with, 3, (engines,), timeout=240), 3, engines)


def test_same_global_batch_at_4_ranks():
    """World size 4 (6 or 7 samples per rank and step; two ranks pad in each epoch's last step)."""
    engines = ["none", "torch"]
    _check(run_ranks(_train_with, 4, (engines,), timeout=240), 4, engines)


# -- a resume across world sizes ---------------------------------------------------------------------

def _leg(rank, directory, leg):
    """One leg of a run: restore (if there is a checkpoint), train, and leave as the leg says.

    leg "stop": rank 1 is asked to stop after the first step; every rank saves at the agreed step, RunStopped.
    leg "save": Checkpointer(every=2); leave after the first save two or more steps past the restored one.
    leg "end": train to the end.
    """
    model, optimizer = wrap("none")
    loader = make_loader()
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    checkpointer = px.Checkpointer(directory, every=2 if leg == "save" else 1000)
    restored = checkpointer.restore(state)
    first = checkpointer.steps
    start_epoch = loader.state_dict()["epoch"] if restored else 0
    log = {}

    def after_step():
        if leg == "stop" and rank == 1 and checkpointer.steps == 1:
            stop.request("SIGUSR1")  # what the signal handler does
        path = checkpointer.step(state)
        return leg == "save" and path is not None and checkpointer.steps >= first + 2

    try:
        finished = train_epochs(loader, model, optimizer, log, start_epoch=start_epoch, after_step=after_step)
    except px.RunStopped as stopped:
        return {"log": log, "first": first, "last": stopped.step, "params": None}
    return {"log": log, "first": first, "last": checkpointer.steps, "finished": finished,
            "params": whole_parameters(model) if finished else None}


def test_stopped_at_4_ranks_resumed_at_2_then_3_applies_each_step_once_with_its_samples(tmp_path):
    """World sizes 4 (agreed stop), then 2 (Checkpointer every=2, left after a save), then 3 (to the end)."""
    directory = str(tmp_path)
    env = {"PHALANX_STOP_INTERVAL": "0"}
    legs = [run_ranks(_leg, world, (directory, leg), env=env, timeout=240)
            for world, leg in ((4, "stop"), (2, "save"), (3, "end"))]
    # Each leg starts at the step the previous one saved: no step lost, none redone.
    assert [legs[0][0]["first"], legs[1][0]["first"], legs[2][0]["first"]] == \
        [0, legs[0][0]["last"], legs[1][0]["last"]]
    assert 0 < legs[0][0]["last"] < legs[1][0]["last"] < STEPS, "both resumes start mid-run"
    assert legs[2][0]["finished"] and legs[2][0]["last"] == STEPS
    expected_params, expected_steps = reference_run()
    applied = {}
    for per_rank in legs:
        keys = set(per_rank[0]["log"])
        assert not keys & set(applied), f"steps applied twice: {sorted(keys & set(applied))}"
        applied.update({key: sorted(i for results in per_rank for i in results["log"][key]) for key in keys})
    assert applied == expected_steps  # each step averaged the uninterrupted run's samples
    for epoch in range(EPOCHS):
        used = sorted(i for (e, _), ids in applied.items() if e == epoch for i in ids)
        assert used == list(range(SIZE)), f"epoch {epoch}: not every sample exactly once"
    for results in legs[2]:
        for ours, theirs in zip(results["params"], expected_params):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


# -- DataLoader workers ------------------------------------------------------------------------------

def test_steps_and_resume_with_persistent_dataloader_workers():
    """World size 1 (2, then 3 ranks simulated), 2 forked persistent DataLoader workers per loader."""
    _, expected = reference_run()

    def loaders(world):
        dataset = Indexed()
        return [px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, num_workers=2,
                              persistent_workers=True, multiprocessing_context="fork",
                              sampler=px.DistributedSampler(dataset, num_replicas=world, rank=r, seed=SEED))
                for r in range(world)]

    def ids(steps):
        return sorted(i for step in steps for index, _, _ in step.micro_batches() if step.weight
                      for i in index.tolist())

    interrupted = loaders(2)
    for loader in interrupted:
        loader.set_epoch(0)
    iterators = [iter(loader) for loader in interrupted]
    seen = {(0, s): ids([next(it) for it in iterators]) for s in range(2)}
    state = interrupted[0].state_dict()
    resumed = loaders(3)
    for loader in resumed:
        loader.load_state_dict(state)
    for epoch in range(EPOCHS):
        for loader in resumed:
            loader.set_epoch(epoch)
        for steps in zip(*resumed):
            seen[(epoch, steps[0].index)] = ids(steps)
    assert seen == expected
