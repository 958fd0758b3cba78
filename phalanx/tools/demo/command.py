"""`phalanx demo`: train the wine classifier (wine.py, beside it) on 2 processes and show the result.

The parent starts one process per GPU (two CPU processes without GPUs) with `phalanx.spawn`; each
runs `wine.train`. Back in the parent: the held-out accuracy, where the checkpoints are, and a
loss-curve PNG. Run it twice: the second run resumes from the checkpoint unless `--fresh`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ...launch.spawn import spawn
from .wine import WineConfig, train_on_rank


def default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="phalanx demo", description=(
        "Train a small classifier on scikit-learn's wine data with phalanx DDP, DistributedSampler "
        "and Checkpointer, on several processes. A second run resumes from the checkpoint."))
    parser.add_argument("--epochs", type=int, default=WineConfig.epochs,
                        help="total epochs of the run, counting those of a resumed run (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes to start (default: one per GPU, else 2 on the CPU)")
    parser.add_argument("--fresh", action="store_true", help="start over: delete the checkpoints of an earlier run")
    parser.add_argument("--out", default=WineConfig.out,
                        help="folder for the checkpoints and the plot (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def plot_history(history: dict, path: Path, title: str, resumed_at: int | None = None) -> Path:
    """Write the loss curve (and accuracy beside it) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    epochs = range(1, len(history["loss"]) + 1)
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axis.plot(epochs, history["loss"], marker=".", color="tab:red")
    loss_axis.set(xlabel="epoch", ylabel="training loss (cross-entropy)", title="loss")
    accuracy_axis.plot(epochs, history["accuracy"], marker=".", label="training")
    accuracy_axis.plot(epochs, history["heldout"], marker=".", label="held-out")
    accuracy_axis.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1.02))
    accuracy_axis.legend(loc="lower right")
    if resumed_at:
        for axis in (loss_axis, accuracy_axis):
            axis.axvline(resumed_at + 0.5, color="gray", linestyle="--", linewidth=1)
        loss_axis.annotate("resumed", (resumed_at + 0.5, max(history["loss"])), color="gray",
                           xytext=(3, 0), textcoords="offset points", va="top")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def missing_packages() -> list[str]:
    """The demo's extra packages (phalanx[examples]) that are not installed."""
    import importlib.util

    return [name for module, name in (("sklearn", "scikit-learn"), ("matplotlib", "matplotlib"), ("tqdm", "tqdm"))
            if importlib.util.find_spec(module) is None]


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = missing_packages()
    if missing:
        print(f"phalanx demo needs {', '.join(missing)}: pip install 'phalanx[examples]' "
              f"(or pip install {' '.join(missing)})", file=sys.stderr)
        return 2
    nproc = args.nproc or default_nproc()
    config = WineConfig(epochs=args.epochs, out=args.out, fresh=args.fresh, progress=not args.no_progress)
    # The ranks fork from one server that imported torch and phalanx once, instead of each importing them.
    summary = spawn(train_on_rank, nprocs=nproc, args=(config,), start_method="forkserver")[0]

    print(f"held-out accuracy: {summary['heldout_accuracy']:.2f}")
    print(f"checkpoint: {summary['checkpoint'] or summary['checkpoint_dir']} "
          "(run again to resume, or pass --fresh to start over)")
    if summary["history"]["loss"]:
        title = f"phalanx demo: wine classifier, {summary['world_size']} processes on {summary['device'].split(':')[0]}"
        # Mark where this run took over from the checkpoint (nothing to mark if it trained no epoch).
        trained_now = summary["start_epoch"] < len(summary["history"]["loss"])
        resumed_at = summary["start_epoch"] if summary["resumed"] and trained_now else None
        print(f"loss curve: {plot_history(summary['history'], Path(args.out) / 'loss.png', title, resumed_at)}")
    print(f"step log: {Path(args.out) / 'log' / 'steps.jsonl'} and TensorBoard files beside it "
          f"(phalanx report {args.out} draws it)")
    return 0
