"""Keep an exponential moving average (EMA) of a DDP model's weights and evaluate both.

    phalanx run --nproc-per-node 2 examples/ema.py
    python examples/ema.py                         # one process: the same code, a world of one

torch's `AveragedModel` deep-copies the model it is given: with phalanx DDP the copy is a working
DDP on the default process group, so the usual recipe needs no change. The EMA is updated from the
live model after every optimizer step, on every rank alike (the replicas, and so the averages, stay
identical), then evaluated without gradients: no collective runs for it.
"""

import argparse

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import phalanx as px


def make_data(generator: torch.Generator, samples: int):
    """A noisy linear regression: the EMA's smoothing shows in its lower held-out loss."""
    x = torch.randn(samples, 16, generator=generator)
    w = torch.linspace(-1.0, 1.0, 16).unsqueeze(1)
    return x, x @ w + 0.5 * torch.randn(samples, 1, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--decay", type=float, default=0.99)
    args = parser.parse_args()

    px.init()
    torch.manual_seed(0)
    model = px.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.decay))  # deep-copies the DDP model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + px.rank())  # each rank draws its own batches
    for _ in range(args.steps):
        x, y = make_data(data, 32)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        ema.update_parameters(model)

    x, y = make_data(torch.Generator().manual_seed(7), 4096)  # the same held-out data on every rank
    with torch.no_grad():
        live, averaged = nn.functional.mse_loss(model(x), y).item(), nn.functional.mse_loss(ema(x), y).item()
    px.print0(f"held-out loss: live model {live:.4f}, EMA {averaged:.4f}")
    px.shutdown()


if __name__ == "__main__":
    main()
