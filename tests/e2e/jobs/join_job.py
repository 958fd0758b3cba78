"""The loop of docs/data.md ("A global batch") with `checkpointer.restore(state)` first: a rank that joins the run in
progress (PHALANX_JOIN=1, started by `phalanx run` on a node that joins, or by a test) gets its state there.

    python tests/e2e/jobs/join_job.py RUN_DIR [--pause S] [--wait-for-joiners-at EPOCH:STEP] [--adam] [--hidden N]
        [--joiners N] [--epochs N] [--host NAME] [--ballast-mb MB] [--die-in-handover]
        [--shard optimizer|gradients]

The run of tests/helpers/global_batch_cases.py (a global batch of 26 in micro-batches of 4, two epochs), with a
StepLog of every step in RUN_DIR/steplog (not in the state: a joiner takes the step count from the others). Every
rank appends `[epoch, step, ids, time]` per applied step to RUN_DIR/ids-<rank>.jsonl (the ids its part of the step
averaged); each rank that finishes writes RUN_DIR/result-<rank>.pt (weights_only): its process ids at the start and
the end, its generation (number, members), its final parameters, the checkpoint files its restore() read, the step
count it joined at, the step it first trained, when its restore() began and ended, its state's bytes, and the names
of the process groups it holds at the end.
`--wait-for-joiners-at`: at that step the
ranks that train wait (up to 120 s) until `--joiners` joiners are ready or in, so that a test need not race the
joiners' start-up.
`--host`: written to RUN_DIR/host-<rank> (which host a rank ran on). `--die-in-handover`: a joiner SIGKILLs itself
once the first message of the state's handover reached it. `--shard`: the model's shard level (its optimizer from
model.shard_optimizer; a hidden width of 64 lets every rank own elements).
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import distributed_c10d as c10d

import phalanx as px
from phalanx.checkpoint import atomic_files, handover
from phalanx.world import generation, joining
from phalanx.world import group as world
from tests.helpers.global_batch_cases import (
    EPOCHS,
    GLOBAL_BATCH,
    MICRO_BATCH,
    SEED,
    Indexed,
    make_model,
    make_optimizer,
)


def _wait_for_joiners(count: int, world_size: int) -> None:
    """Until `count` joiners are ready or in (up to 120 s): joiners have ranks from the first world's size on."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        joined = sum(1 for rank in world.live_members() if rank >= world_size)
        if joining.waiting(world.store()) + joined >= count:
            return
        time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--wait-for-joiners-at", default="", help="EPOCH:STEP")
    parser.add_argument("--joiners", type=int, default=1, help="how many joiners --wait-for-joiners-at waits for")
    parser.add_argument("--adam", action="store_true")
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--host", default="")
    parser.add_argument("--die-in-handover", action="store_true", help="a joiner SIGKILLs itself while taken in")
    parser.add_argument("--shard", default="none", choices=("none", "optimizer", "gradients"))
    parser.add_argument("--ballast-mb", type=float, default=0.0, help="a frozen parameter of that many MB")
    args = parser.parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    started_as = os.getpid()
    px.init()
    rank, world_size = px.rank(), px.world_size()
    (args.run_dir / f"host-{rank}").write_text(args.host)
    wait_at = tuple(int(part) for part in args.wait_for_joiners_at.split(":")) if args.wait_for_joiners_at else None
    dataset = Indexed()
    loader = px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                           sampler=px.DistributedSampler(dataset, seed=SEED))
    module = make_model(args.hidden)
    if args.ballast_mb:  # state that is handed over but not trained (frozen): a state of a given size, stable training
        count = int(args.ballast_mb * 1e6) // 4
        module.ballast = torch.nn.Parameter(torch.randn(count, generator=torch.Generator().manual_seed(rank)),
                                            requires_grad=False)  # each rank its own: a joiner must get rank 0's
    model = px.DistributedDataParallel(module, bucket_cap_mb=1e-6, shard=args.shard)
    optimizer = model.shard_optimizer(make_optimizer(model, args.adam))
    checkpointer = px.Checkpointer(args.run_dir / "checkpoints", every=1000)  # never saves: a join reads no file
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    loads = []
    load_safely = atomic_files.load_safely
    atomic_files.load_safely = lambda *a, **k: loads.append(a[0]) or load_safely(*a, **k)
    if args.die_in_handover and joining.requested():  # lost while it is taken in: the others go on without it
        received = handover._received

        def die_after_the_first_message(work):
            received(work)
            os.kill(os.getpid(), signal.SIGKILL)

        handover._received = die_after_the_first_message
    steplog = px.StepLog(args.run_dir / "steplog", every=1, print_every=0, tensorboard=False)  # not in `state`
    restore_began = time.time()
    checkpointer.restore(state)
    restore_ended = time.time()
    joined_at, first_step = checkpointer.steps, None
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        t.numel() * t.element_size() for per in optimizer.state.values() for t in per.values()
        if isinstance(t, torch.Tensor))
    with open(args.run_dir / f"ids-{rank}.jsonl", "a") as log:
        for epoch in range(loader.state_dict()["epoch"], args.epochs):
            loader.set_epoch(epoch)
            for step in loader:
                first_step = first_step if first_step is not None else (epoch, step.index)
                if (epoch, step.index) == wait_at and not joining.requested():
                    _wait_for_joiners(args.joiners, world_size)
                time.sleep(args.pause)
                optimizer.zero_grad()
                ids, attempt = [], 0
                for index, x, y in step.micro_batches(model):
                    if step.attempt != attempt:  # the loop started over after a loss: so do the ids
                        ids, attempt = [], step.attempt
                    loss = F.mse_loss(model(x), y)
                    step.backward(loss)
                    if step.weight:
                        ids += index.tolist()
                optimizer.step()
                log.write(json.dumps([epoch, step.index, ids, time.time()]) + "\n")
                log.flush()
                steplog.step(loss, samples=len(ids))
                checkpointer.step(state)
    steplog.close()
    current = generation.current()
    torch.save({"pid": [started_as, os.getpid()], "generation": [current.number, list(current.members)],
                "params": [p.detach().clone() for name, p in model.module.named_parameters() if name != "ballast"],
                "ballast_sum": float(module.ballast.double().sum()) if args.ballast_mb else None,
                "files_read": [str(path) for path in loads], "joined_at": joined_at,
                "first_step": list(first_step), "restore": [restore_began, restore_ended],
                "state_bytes": state_bytes, "groups": sorted(c10d._world.pg_names.values())},
               args.run_dir / f"result-{rank}.pt")
    px.shutdown()


if __name__ == "__main__":
    main()
