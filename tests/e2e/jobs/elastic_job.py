"""The training loop of the elastic tests: a small regression whose nodes come and go, at a fixed global batch.

    phalanx run --nnodes 1:2 --nproc-per-node 1 ... tests/e2e/jobs/elastic_job.py RUN_DIR [--step-seconds S]

96 samples, a global batch of 8 in micro-batches of at most 2 (4 per rank at world size 1, 2 at 2, 1 at 4),
so 12 optimizer steps per epoch at any world size; 3 epochs (--epochs), a checkpoint every 2 steps. Rank 0
appends one line per applied optimizer step to RUN_DIR/samples.log: `epoch step world_size time id id ...`
(the ids of every sample that step averaged, from every rank; padding left out); a step lost with a crash
and redone appears twice, the later line is the lineage's. With `--wait-alone K`, a world of one rank,
after K steps, waits (up to 60 s) for the request to save that a node joining brings, so the node that
comes back finds the run unfinished. With `--fail-once-at K` the last rank raises before step K+1, once in
the whole run. Rank 0 writes the final parameters to RUN_DIR/final.pt.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import phalanx as px

SAMPLES, EPOCHS, EVERY, GLOBAL_BATCH, MICRO_BATCH = 96, 3, 2, 8, 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="a pause per step: steps take time")
    parser.add_argument("--wait-alone", type=int, default=0, metavar="K")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--fail-once-at", type=int, default=0, metavar="K",
                        help="the last rank raises before step K+1, once in the whole run (RUN_DIR/failed-once)")
    args = parser.parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    px.init()
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 8, generator=generator),
                                          torch.randn(SAMPLES, 1, generator=generator))
    torch.manual_seed(0)
    model = px.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                                           torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = px.DataLoader(data, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                           sampler=px.DistributedSampler(data, shuffle=True, seed=5))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0, "step": 0}
    checkpointer = px.Checkpointer(args.run_dir / "checkpoints", keep=2, every=EVERY)
    checkpointer.restore(state)
    world = px.world_size()
    alone = 0
    while state["epoch"] < args.epochs:
        loader.set_epoch(state["epoch"])
        for step in loader:
            if world == 1 and args.wait_alone and alone >= args.wait_alone:
                deadline = time.monotonic() + 60
                while not px.stop_requested() and time.monotonic() < deadline:
                    time.sleep(0.05)
            alone += world == 1
            failed_once = args.run_dir / "failed-once"
            if args.fail_once_at and args.fail_once_at == state["step"] and px.rank() == world - 1 \
                    and not failed_once.exists():
                failed_once.touch()
                raise RuntimeError(f"a planned failure before step {state['step'] + 1}")
            time.sleep(args.step_seconds)
            optimizer.zero_grad()
            ids = []
            for j, (batch_ids, x, y) in enumerate(step.micro_batches(model)):
                if step.sizes[j]:  # a micro-batch of size 0 is padding: one sample, weighed 0
                    ids += batch_ids.tolist()
                step.backward(F.mse_loss(model(x), y))
            optimizer.step()
            state["step"] += 1
            everyone = [None] * world
            dist.all_gather_object(everyone, ids)
            if px.is_main():
                line = " ".join(str(i) for part in everyone for i in part)
                with open(args.run_dir / "samples.log", "a") as log:
                    log.write(f"{state['epoch']} {state['step']} {world} {time.time():.3f} {line}\n")
            checkpointer.step(state)
        state["epoch"] += 1
    params = [p.detach().clone() for p in model.module.parameters()]
    if px.is_main():
        torch.save({"step": state["step"], "params": params}, args.run_dir / "final.pt")
    px.shutdown()


if __name__ == "__main__":
    main()
