"""A global batch size: each optimizer step averages the same 64 samples at any world size.

    phalanx run --nproc-per-node 2 examples/global_batch.py      # 2 ranks x 2 micro-batches x 16
    phalanx run --nproc-per-node 3 examples/global_batch.py      # 3 ranks, 21 or 22 samples each
    python examples/global_batch.py                              # one process: 4 micro-batches x 16

Stopped (`--max-steps`, Ctrl-C, a lost node) and run again with another --nproc-per-node, it resumes
from its checkpoint at the next step, with that step's samples: the weights it ends with are those of
the uninterrupted run, whatever the world sizes on the way (docs/data.md, "A global batch").
"""

import argparse

import torch
import torch.nn.functional as F

import phalanx as px


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoints", default="global-batch-checkpoints")
    parser.add_argument("--every", type=int, default=5, help="save every N optimizer steps")
    parser.add_argument("--max-steps", type=int, default=None, help="leave after this many steps (and a save)")
    parser.add_argument("--out", default=None, help="write the final weights here (rank 0)")
    args = parser.parse_args()

    px.init()
    torch.manual_seed(0)  # the same data and model on every rank
    inputs = torch.randn(1000, 10)
    dataset = torch.utils.data.TensorDataset(inputs, inputs @ torch.randn(10, 1) + 0.1 * torch.randn(1000, 1))
    model = px.DistributedDataParallel(torch.nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = px.DistributedSampler(dataset, shuffle=True)
    loader = px.DataLoader(dataset, batch_size=16, global_batch_size=64, sampler=sampler)  # batch_size: a micro-batch
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    checkpointer = px.Checkpointer(args.checkpoints, every=args.every)
    checkpointer.restore(state)  # saved at any world size
    px.print0(f"{loader.plan}; {len(loader)} steps per epoch, from step {loader.state_dict()['steps']} "
              f"of epoch {loader.state_dict()['epoch']}")

    for epoch in range(loader.state_dict()["epoch"], args.epochs):
        loader.set_epoch(epoch)
        total, count = torch.zeros(()), 0
        for step in loader:  # one item per optimizer step
            optimizer.zero_grad()
            for x, y in step.micro_batches(model):  # model.no_sync() around all but the last
                loss = F.mse_loss(model(x), y)  # the usual mean over the micro-batch
                step.backward(loss)  # weighed: the gradient is the mean over the step's samples
            optimizer.step()
            total, count = total + step.loss * step.samples, count + sum(step.sizes)
            saved = checkpointer.step(state)  # the loader's position is at a step boundary
            if args.max_steps is not None and checkpointer.steps >= args.max_steps:
                if saved is None:
                    checkpointer.save(state)
                px.print0(f"left after step {checkpointer.steps}; run again to resume")
                px.shutdown()
                return
        px.print0(f"epoch {epoch + 1}/{args.epochs}: loss {px.metrics.weighted_mean(total, count):.5f}")
    if args.out and px.is_main():
        torch.save(model.module.state_dict(), args.out)
    px.shutdown()


if __name__ == "__main__":
    main()
