"""The wine classifier that `phalanx demo` and examples/wine.py train: a whole DDP job, end to end.

Every rank trains on its own shard of scikit-learn's bundled wine data (DistributedSampler), the
model is wrapped in phalanx DDP, a Checkpointer saves after each epoch so that a second run resumes
(and, asked to stop by Ctrl-C or SIGTERM, at the next step all ranks agree on), loss and accuracy
are averaged over the samples of all ranks (phalanx.metrics), not over ranks, and a StepLog records
each epoch's throughput and step times into OUT/log (steps.jsonl, TensorBoard).
"""

from __future__ import annotations

import logging
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import phalanx as px


@dataclass
class WineConfig:
    epochs: int = 30
    batch_size: int = 16  # per rank: the global batch is batch_size * world size
    lr: float = 0.001
    seed: int = 0
    out: str = "runs/demo"
    fresh: bool = False  # ignore (and delete) the checkpoints of an earlier run
    progress: bool = True  # a tqdm bar on rank 0


def load_wine_splits(heldout_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The wine data (178 samples, 13 features, 3 classes) as standardized train and held-out sets.

    The split is fixed by `seed` and stratified; the scaler is fitted on the training split only,
    so nothing about the held-out samples leaks into training.
    """
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    features, labels = load_wine(return_X_y=True)
    x_train, x_held, y_train, y_held = train_test_split(
        features, labels, test_size=heldout_fraction, random_state=seed, stratify=labels)
    scaler = StandardScaler().fit(x_train)

    def as_dataset(x, y):
        return TensorDataset(torch.tensor(scaler.transform(x), dtype=torch.float32), torch.tensor(y, dtype=torch.long))

    return as_dataset(x_train, y_train), as_dataset(x_held, y_held)


class WineNet(nn.Module):
    """13 features -> 64 hidden units -> 3 classes."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(13, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)


def evaluate(model: nn.Module, dataset, device) -> float:
    """Accuracy over `dataset`, each sample counted exactly once across all ranks.

    `pad=False` gives every rank a disjoint shard (no duplicated samples, possibly uneven), and the
    unwrapped module runs the forward: evaluation exchanges no gradients, so shards of different
    lengths cannot leave a rank waiting.
    """
    loader = px.DataLoader(dataset, batch_size=64, sampler=px.DistributedSampler(dataset, shuffle=False, pad=False))
    accuracy = px.metrics.Mean()
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            accuracy.update((model(x).argmax(dim=1) == y).float().mean(), weight=len(y))
    model.train()
    return accuracy.compute()


def _progress_bar(total: int, done: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (a log file would fill with redraws).
    return tqdm(total=total, initial=done, unit="step", desc="training", file=sys.stderr, dynamic_ncols=True,
                disable=None)


@contextmanager
def _warnings_only_while_drawn(bar):
    """While the bar is drawn, the Checkpointer's INFO line per save would tear it: keep warnings only."""
    level = px.logger.level
    if bar is not None and not bar.disable:
        px.logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        px.logger.setLevel(level)


def _say(bar, text: str) -> None:
    """A line on rank 0 that does not tear the progress bar."""
    if bar is not None:
        bar.write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        px.print0(text)


def train(config: WineConfig) -> dict:
    """Train on every rank (after `phalanx.init()`); return the run's summary (same on every rank).

    Example, in a script started by `phalanx run` (or alone)::

        px.init()
        summary = train(WineConfig(epochs=30, out="runs/wine"))
        px.print0(f"held-out accuracy: {summary['heldout_accuracy']:.2f}")
    """
    device = px.device()
    torch.manual_seed(config.seed)  # DDP broadcasts rank 0's weights anyway; this makes runs repeatable
    train_set, heldout_set = load_wine_splits(seed=config.seed)

    model = px.DistributedDataParallel(WineNet().to(device), device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    loader = px.DataLoader(train_set, batch_size=config.batch_size,
                           sampler=px.DistributedSampler(train_set, shuffle=True, seed=config.seed))

    checkpoint_dir = Path(config.out) / "checkpoints"
    if config.fresh:
        if px.is_main():
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
        px.barrier()  # no rank may look for a checkpoint while rank 0 is deleting them
    checkpointer = px.Checkpointer(checkpoint_dir, keep=2)
    # Everything a resumed run needs: the Checkpointer saves objects with a state_dict and plain values.
    steps_per_epoch = len(loader)
    # A StepLog record at each epoch's last step (throughput, each rank's busy time, the slowest rank), into
    # OUT/log/steps.jsonl and TensorBoard: `phalanx report OUT` draws it. Its line goes above the bar.
    log = px.StepLog(Path(config.out) / "log", every=steps_per_epoch, optimizer=optimizer,
                     total_steps=config.epochs * steps_per_epoch, print_fn=lambda text: _say(bar, text))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0,
             "history": {"loss": [], "accuracy": [], "heldout": []}, "log": log}
    resumed = checkpointer.restore(state)
    start_epoch = state["epoch"]
    if resumed:
        done = "" if start_epoch < config.epochs else \
            f" (nothing left to train: pass --epochs {config.epochs + 10} to go on, or --fresh to start over)"
        px.print0(f"resuming from the checkpoint in {checkpoint_dir}: "
                  f"{start_epoch} of {config.epochs} epochs done{done}")
    else:
        px.print0(("--fresh: " if config.fresh else "") + f"starting a new run in {config.out} "
                  f"on {px.world_size()} process(es), device {device}")

    last_checkpoint = checkpointer.checkpoints()[-1] if resumed else None
    bar = _progress_bar(config.epochs * steps_per_epoch, start_epoch * steps_per_epoch,
                        enabled=config.progress and px.is_main())
    with _warnings_only_while_drawn(bar):
        for epoch in range(start_epoch, config.epochs):
            loader.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            loss_mean, accuracy_mean = px.metrics.Mean(), px.metrics.Mean()
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP averages the gradients over all ranks here
                optimizer.step()
                # Weighted by batch size: a short last batch counts for what it holds, not as a full one.
                loss_mean.update(loss.detach(), weight=len(y))
                accuracy_mean.update((logits.argmax(dim=1) == y).float().mean(), weight=len(y))
                log.step(loss=loss.detach(), samples=len(y))
                if bar is not None:
                    bar.update(1)
                epoch_ends = loader.state_dict()["batches"] == steps_per_epoch
                if epoch_ends:
                    history = state["history"]
                    history["loss"].append(loss_mean.compute())
                    history["accuracy"].append(accuracy_mean.compute())
                    history["heldout"].append(evaluate(model.module, heldout_set, device))
                    _say(bar, f"epoch {epoch + 1:3d}/{config.epochs}  loss {history['loss'][-1]:.4f}  "
                              f"accuracy {history['accuracy'][-1]:.3f}  held-out {history['heldout'][-1]:.3f}")
                    state["epoch"] = epoch + 1
                # Last in the step: saves at each epoch's end, and, when Ctrl-C or SIGTERM asks to stop, at the step
                # all ranks agree on, then ends the process (exit code 75: run the same command to resume there;
                # that epoch's printed means then cover the batches after the resume).
                last_checkpoint = checkpointer.step(state, last=epoch_ends) or last_checkpoint
    log.close()
    if bar is not None:
        bar.close()

    heldout_accuracy = evaluate(model.module, heldout_set, device)
    return {"heldout_accuracy": heldout_accuracy, "history": state["history"], "start_epoch": start_epoch,
            "resumed": resumed, "epochs": config.epochs, "checkpoint_dir": str(checkpoint_dir),
            "checkpoint": str(last_checkpoint) if last_checkpoint else None,
            "world_size": px.world_size(), "device": str(device)}


def train_on_rank(rank: int, config: WineConfig) -> dict:
    """`phalanx.spawn` entry point: the world is already set up."""
    return train(config)
