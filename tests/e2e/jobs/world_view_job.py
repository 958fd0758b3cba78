"""The loop of docs/data.md with everything on, as a new user would write it: a global batch, a background
Checkpointer saving every few steps, a StepLog that is not in the checkpoint's state, shard="optimizer", and live
recovery (its launcher's). tests/e2e/test_world_view.py loses a host, brings it back, stops the run and resumes it.

    phalanx run --nnodes 2:3 ... tests/e2e/jobs/world_view_job.py RUN_DIR --host I [--pause S] [--epochs E]

Each process writes, in RUN_DIR, files named by its pid (a resumed run's ranks reuse the launch ranks):
- views-<pid>.jsonl: per applied step, [step, px.rank(), px.world_size(), px.is_main(), launch rank, host];
- ids-<pid>.jsonl: per applied step, [epoch, step index, the sample ids its part averaged];
- saved-<pid>.jsonl: per step, [step, px.rank(), the fingerprint of its state as a save at that step takes it];
- restored-<pid>.json: [step, px.rank(), the fingerprint of its state right after checkpointer.restore()];
- result-<pid>.pt (weights_only): its final parameters, when it finishes.
Once RUN_DIR/expect-joiner exists, the ranks of a world smaller than the first wait for a joiner before each step.
"""

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

import phalanx as px
from phalanx.world import group, joining
from tests.helpers.global_batch_cases import (
    GLOBAL_BATCH,
    MICRO_BATCH,
    SEED,
    Indexed,
    make_model,
    make_optimizer,
    micro_batches_ids,
)

HIDDEN = 64  # wide enough that every rank owns elements of the model at shard="optimizer"


def fingerprint(value, digest=None) -> str:
    """A hash of every tensor's bytes and every other value's repr, in order: equal only for bitwise equal states."""
    top = digest is None
    digest = digest or hashlib.sha256()
    if isinstance(value, torch.Tensor):
        digest.update(repr((value.dtype, tuple(value.shape))).encode())
        digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            fingerprint(value[key], digest)
    elif isinstance(value, (list, tuple)):
        for item in value:
            fingerprint(item, digest)
    else:
        digest.update(repr(value).encode())
    return digest.hexdigest() if top else ""


def state_fingerprint(model, optimizer, loader) -> dict:
    """What a checkpoint holds of this rank, each part's fingerprint: the model, this rank's optimizer shard, the
    loader's position, its random stream."""
    return {"model": fingerprint(model.state_dict()), "optimizer shard": fingerprint(optimizer.optimizer.state_dict()),
            "loader": fingerprint(loader.state_dict()), "random stream": fingerprint(torch.get_rng_state())}


def wait_for_a_joiner(world_size: int) -> None:
    """Until a rank is ready to join or in (up to 120 s; a joiner's rank is one the first world of `world_size` never
    used): the test brings a lost host back, and the run must not end before its worker is taken in, however slow
    this machine is today."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if joining.waiting(px.world.store()) or any(rank >= world_size for rank in group.live_members()):
            return
        time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--host", type=int, required=True)
    parser.add_argument("--pause", type=float, default=0.2, help="seconds of sleep per step")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--hosts", type=int, default=3, help="the run's world: the hosts it starts with, one rank each")
    args = parser.parse_args()
    px.init()
    pid, launched = os.getpid(), px.world.launch_rank()
    dataset = Indexed()
    loader = px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                           sampler=px.DistributedSampler(dataset, seed=SEED))
    model = px.DistributedDataParallel(make_model(HIDDEN), shard="optimizer")
    optimizer = model.shard_optimizer(make_optimizer(model))
    checkpointer = px.Checkpointer(args.run_dir / "checkpoints", every=4)  # in the background
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    log = px.StepLog(args.run_dir / "steplog", every=3, print_every=0, tensorboard=False)  # not in `state`
    if checkpointer.restore(state) and not joining.requested():  # a joiner is handed the state, it reads none
        (args.run_dir / f"restored-{pid}.json").write_text(json.dumps(
            [checkpointer.steps, px.rank(), state_fingerprint(model, optimizer, loader)]))
    files = {name: open(args.run_dir / f"{name}-{pid}.jsonl", "a") for name in ("views", "ids", "saved")}

    def write(name: str, row: list) -> None:
        files[name].write(json.dumps(row) + "\n")
        files[name].flush()

    for epoch in range(loader.state_dict()["epoch"], args.epochs):
        loader.set_epoch(epoch)
        for step in loader:
            if px.world_size() < args.hosts and (args.run_dir / "expect-joiner").exists():
                wait_for_a_joiner(args.hosts)
            time.sleep(args.pause)
            optimizer.zero_grad()
            ids = micro_batches_ids(step, model)
            optimizer.step()
            if step.undone:  # rolled back after a loss: the loader hands this step out again
                continue
            number = checkpointer.steps + 1  # the step checkpointer.step() below counts, and saves at
            write("views", [number, px.rank(), px.world_size(), px.is_main(), launched, args.host])
            write("ids", [epoch, step.index, ids])
            write("saved", [number, px.rank(), state_fingerprint(model, optimizer, loader)])
            log.step(step.loss * step.samples / max(len(ids), 1), samples=len(ids))  # this rank's mean loss
            checkpointer.step(state)
    log.close()
    torch.save({"params": [p.detach().clone() for p in model.module.parameters()]}, args.run_dir / f"result-{pid}.pt")
    px.shutdown()


if __name__ == "__main__":
    main()
