"""The training loop of benchmarks/live_recovery/live_recovery_chaos.py: the loop of docs/data.md, resumable, for as
long as asked.

    phalanx run ... benchmarks/live_recovery/live_recovery_chaos_job.py RUN_DIR --host I [--pause S] [--shard LEVEL]

tests/helpers/global_batch_cases.py's run (80 samples, a global batch of 26 in micro-batches of 4, SGD with
momentum) for as many epochs as RUN_DIR/last-epoch says once it exists (the harness writes it when the chaos is
over; until then the run goes on). A Checkpointer every 4 steps; the state has the loader and the epoch, so a
restart resumes exactly. With `--shard optimizer|gradients` the model is sharded (a hidden width of 64, so that every
rank owns parameter elements) and its optimizer comes from model.shard_optimizer; a step rolled back after a loss
(`step.undone`) is not logged. Each rank appends `[epoch, step, ids, time, incarnation, generation]` per applied step
to RUN_DIR/ids-<pid>.jsonl (ids: the samples its part of the step averaged; incarnation: which launch and which
rendezvous round applied it, so that a step redone after a restart replaces the first one; generation: how many
times its ranks regrouped in-process), and writes its pid
and host to RUN_DIR/workers/<pid> at the start. The main rank writes the final parameters to RUN_DIR/final.pt.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

import phalanx as px
from phalanx.world.group import live_generation
from tests.helpers.global_batch_cases import (
    GLOBAL_BATCH,
    MICRO_BATCH,
    SEED,
    Indexed,
    make_model,
    make_optimizer,
    micro_batches_ids,
)


def hidden_width(shard: str) -> int:
    return 8 if shard == "none" else 64


def last_epoch(run_dir: Path) -> int:
    path = run_dir / "last-epoch"
    return int(path.read_text()) if path.exists() else 1 << 30


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--host", type=int, required=True)
    parser.add_argument("--pause", type=float, default=0.1, help="seconds of sleep per step")
    parser.add_argument("--shard", default="none", help="the model's shard level")
    args = parser.parse_args()
    px.init()
    (args.run_dir / "workers").mkdir(parents=True, exist_ok=True)
    (args.run_dir / "workers" / str(os.getpid())).write_text(str(args.host))
    incarnation = [int(os.environ.get("CHAOS_LAUNCH", "0")),
                   int(os.environ.get("PHALANX_STORE_ATTEMPT", "round-0").rsplit("-", 1)[-1])]
    dataset = Indexed()
    loader = px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                           sampler=px.DistributedSampler(dataset, seed=SEED))
    model = px.DistributedDataParallel(make_model(hidden_width(args.shard)), shard=args.shard)
    optimizer = model.shard_optimizer(make_optimizer(model))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0}
    checkpointer = px.Checkpointer(args.run_dir / "checkpoints", every=4, keep=2)
    checkpointer.restore(state)
    with open(args.run_dir / f"ids-{os.getpid()}.jsonl", "a") as log:
        while state["epoch"] < last_epoch(args.run_dir):
            loader.set_epoch(state["epoch"])
            for step in loader:
                time.sleep(args.pause)
                optimizer.zero_grad()
                ids = micro_batches_ids(step, model)
                optimizer.step()
                if not step.undone:
                    log.write(json.dumps([state["epoch"], step.index, ids, time.time(), incarnation,
                                          live_generation()]) + "\n")
                    log.flush()
                checkpointer.step(state)
            state["epoch"] += 1
    if px.is_main():
        torch.save({"epochs": state["epoch"], "params": [p.detach().clone() for p in model.module.parameters()]},
                   args.run_dir / "final.pt")
    px.shutdown()


if __name__ == "__main__":
    main()
