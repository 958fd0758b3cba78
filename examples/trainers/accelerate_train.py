"""Hugging Face Accelerate on phalanx's DDP: one call, before `accelerator.prepare`, and nothing else changes.

    ACCELERATE_USE_CPU=1 phalanx run --nproc-per-node 2 examples/trainers/accelerate_train.py   # CPUs
    ACCELERATE_USE_CPU=1 torchrun --nproc-per-node 2 examples/trainers/accelerate_train.py      # the same
    accelerate launch --multi_gpu --num_processes 2 examples/trainers/accelerate_train.py      # GPUs

(On one host, `accelerate launch --cpu` starts a single process; ACCELERATE_USE_CPU=1, which it sets, is
what makes Accelerate train on the CPUs of the ranks another launcher starts.)

`phalanx.patch_torch_ddp()` makes `torch.nn.parallel.DistributedDataParallel` phalanx's class, so the model
Accelerate builds is phalanx's (the Transformers Trainer goes through Accelerate the same way). The loop is
Accelerate's own: a global batch of 64, gradient accumulation over 2 micro-batches (no_sync inside
`accelerator.accumulate`), a checkpoint saved with `accelerator.save_state`.
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

phalanx.patch_torch_ddp()  # from here on, torch's DDP name builds phalanx.DistributedDataParallel


def regression(samples: int, seed: int) -> TensorDataset:
    """y = sin(sum of x) plus a little noise: a target the small network below can learn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin() + 0.05 * torch.randn(samples, 1, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="accelerate_checkpoint")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = DataLoader(regression(1024, seed=1), batch_size=16, shuffle=True)  # 16 x 2 ranks x 2 micro-batches
    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    accelerator.print(f"model class: {type(model).__module__}.{type(model).__name__} "
                      f"on {accelerator.num_processes} process(es)")

    for epoch in range(args.epochs):
        for x, y in train:
            with accelerator.accumulate(model):  # no_sync on the first micro-batch, averaged on the second
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        if (epoch + 1) % 5 == 0:
            accelerator.print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {loss.item():.4f}")

    held_out = regression(512, seed=2)
    with torch.no_grad():
        error = nn.functional.mse_loss(accelerator.unwrap_model(model)(held_out.tensors[0]), held_out.tensors[1])
    accelerator.print(f"held-out mse: {error.item():.4f} (predicting the mean: {held_out.tensors[1].var().item():.4f})")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = accelerator.gather(flat.unsqueeze(0))
    accelerator.print(f"replicas identical: {bool((replicas == replicas[0]).all())}")
    accelerator.save_state(args.out)
    accelerator.print(f"saved the state to {args.out}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
