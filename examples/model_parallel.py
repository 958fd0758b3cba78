"""DDP over a model split in two inside each process: data parallel across processes, model parallel within.

    phalanx run --nproc-per-node 2 examples/model_parallel.py   # 2 processes; with >= 4 GPUs, 2 GPUs each
    python examples/model_parallel.py

Each process puts `net1` on one device and `net2` on another and wraps the whole model in DDP with
`device_ids=None` (a module on several devices must not name one). With two GPUs per process the
halves sit on GPUs 2*local_rank and 2*local_rank+1; with fewer GPUs both halves share the process's
GPU; without GPUs both stay on the CPU, and the script says so.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import phalanx as px


class ToyModelParallel(nn.Module):
    """net1 on dev0, net2 on dev1; forward moves the activations between them."""

    def __init__(self, dev0: torch.device, dev1: torch.device):
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.net1 = nn.Linear(10, 10).to(dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5).to(dev1)

    def forward(self, x):
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


def choose_devices() -> tuple[torch.device, torch.device, str]:
    """Two devices for this process's two halves, and a sentence saying where they are."""
    # Known before init(): the launcher (or srun) sets the local rank and the number of local ranks.
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")))
    gpus = torch.cuda.device_count()
    if gpus >= 2 * local_ranks:
        dev0, dev1 = torch.device("cuda", 2 * local_rank), torch.device("cuda", 2 * local_rank + 1)
        return dev0, dev1, f"net1 on {dev0}, net2 on {dev1}"
    if gpus >= local_ranks:
        dev = torch.device("cuda", local_rank)
        return dev, dev, f"{gpus} GPU(s) for {local_ranks} process(es): both halves share {dev}"
    cpu = torch.device("cpu")
    return cpu, cpu, "no GPUs: both halves stay on the CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    dev0, dev1, placement = choose_devices()
    px.init(device=dev0)  # the process group's device is the first half's
    print(f"rank {px.rank()}: {placement}", flush=True)

    torch.manual_seed(px.rank())  # each rank its own data (and weights, until DDP broadcasts rank 0's)
    model = px.DistributedDataParallel(ToyModelParallel(dev0, dev1), device_ids=None)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    for _ in range(args.steps):
        optimizer.zero_grad()
        outputs = model(torch.randn(20, 10))  # the model moves the input to dev0; outputs are on dev1
        labels = torch.randn(20, 5, device=dev1)
        loss_fn(outputs, labels).backward()
        optimizer.step()

    # Every replica must hold the same weights after the averaged steps.
    flat = torch.cat([p.detach().flatten().to("cpu") for p in model.parameters()])
    low, high = flat.clone().to(dev0), flat.clone().to(dev0)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    px.print0(f"model-parallel DDP: {args.steps} steps on {px.world_size()} process(es), "
              f"replicas identical: {torch.equal(low, high)}")
    px.shutdown()


if __name__ == "__main__":
    main()
