"""Lightning on phalanx's DDP: `strategy="phalanx_ddp"` in the Trainer (or in Fabric), after one import.

    python examples/trainers/lightning_train.py                          # Lightning starts the 2 processes
    torchrun --nproc-per-node 2 examples/trainers/lightning_train.py     # or a launcher does

`import phalanx.integrations.lightning` registers the strategy; the rest is a plain LightningModule and
Trainer: gradient accumulation over 2 micro-batches (no_sync on the first), a checkpoint every epoch.
"""

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx.integrations.lightning  # noqa: F401 -- registers strategy="phalanx_ddp"


def regression(samples: int, seed: int) -> TensorDataset:
    """y = sin(sum of x) plus a little noise: a target the small network below can learn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin() + 0.05 * torch.randn(samples, 1, generator=g))


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)  # averaged over ranks, per epoch
        return loss

    def on_train_start(self):
        wrapper = type(self.trainer.strategy.model)
        self.print(f"model class: {wrapper.__module__}.{wrapper.__name__} on {self.trainer.world_size} process(es)")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="lightning_checkpoints")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Regression()
    trainer = L.Trainer(strategy="phalanx_ddp", accelerator="cpu", devices=2, max_epochs=args.epochs,
                        accumulate_grad_batches=2, default_root_dir=args.out, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(regression(1024, seed=1), batch_size=16, shuffle=True))
    if trainer.is_global_zero:
        held_out = regression(512, seed=2)
        with torch.no_grad():
            error = nn.functional.mse_loss(model.net(held_out.tensors[0]), held_out.tensors[1])
        print(f"held-out mse: {error.item():.4f} (predicting the mean: {held_out.tensors[1].var().item():.4f})")
        print(f"checkpoint: {trainer.checkpoint_callback.best_model_path}")


if __name__ == "__main__":
    main()
