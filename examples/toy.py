"""The basic DDP example: a toy model trained on every rank, then saved on rank 0 and loaded everywhere.

    phalanx run --nproc-per-node 2 examples/toy.py
    python examples/toy.py                        # one process: the same code, a world of one

With GPUs each process drives its own (cuda:LOCAL_RANK); without, the processes share the CPU.
Compared with the torch tutorial, the only changes are `px.init()` and `px.DistributedDataParallel`.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import phalanx as px


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def identical_on_all_ranks(model: nn.Module) -> bool:
    """True when every rank holds bitwise the same parameters (elementwise min == max over ranks)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return torch.equal(low, high)


def train_basic(steps: int) -> nn.Module:
    device = px.device()
    torch.manual_seed(px.rank())  # different weights per rank on purpose: DDP broadcasts rank 0's
    model = ToyModel().to(device)
    ddp_model = px.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)

    for _ in range(steps):
        # Each rank draws its own batch: that is data parallelism.
        inputs, labels = torch.randn(20, 10, device=device), torch.randn(20, 5, device=device)
        optimizer.zero_grad()
        loss = loss_fn(ddp_model(inputs), labels)
        loss.backward()  # gradients are averaged over the ranks here
        optimizer.step()
    print(f"rank {px.rank()}: {steps} steps on {device}, last loss {loss.item():.4f}", flush=True)
    same = identical_on_all_ranks(ddp_model.module)
    px.print0(f"replicas identical on all {px.world_size()} ranks: {same}")
    return ddp_model


def checkpoint_round_trip(ddp_model: nn.Module, path: Path) -> None:
    """Save on rank 0, wait for it, load on every rank onto its own device."""
    if px.is_main():
        # All replicas are equal, so one writer is enough; the unwrapped module's keys have no
        # `module.` prefix and load into a plain model as well.
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ddp_model.module.state_dict(), path)
    px.barrier()  # nobody reads before rank 0 has finished writing

    # map_location: tensors saved from rank 0's device land on this rank's device, not on rank 0's.
    # weights_only: loading never runs code from the file.
    state = torch.load(path, map_location=px.device(), weights_only=True)
    ddp_model.module.load_state_dict(state)
    print(f"rank {px.rank()}: loaded {path.name} onto {px.device()}", flush=True)

    restored = ToyModel().to(px.device())
    restored.load_state_dict(state)  # the same file into a plain, unwrapped model
    matches = all(torch.equal(a, b) for a, b in zip(restored.parameters(), ddp_model.module.parameters(), strict=True))
    px.print0(f"checkpoint round trip exact: {matches and identical_on_all_ranks(restored)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/toy/model.pt"))
    args = parser.parse_args()

    px.init()
    ddp_model = train_basic(args.steps)
    checkpoint_round_trip(ddp_model, args.checkpoint)
    px.shutdown()


if __name__ == "__main__":
    main()
