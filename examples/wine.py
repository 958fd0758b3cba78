"""Train a wine classifier with phalanx DDP: the job `phalanx demo` runs, as a plain script.

    phalanx run --nproc-per-node 2 examples/wine.py            # 2 processes (CPU), or one per GPU
    python examples/wine.py                                    # one process, same code
    phalanx run --nproc-per-node 2 examples/wine.py --epochs 40   # run again: resumes, then goes on

The training loop itself is `train()` in phalanx/tools/demo/wine.py, shared with `phalanx demo`: a DDP model,
a DistributedSampler, a Checkpointer that saves each epoch, metrics averaged over all samples.
"""

import argparse

import phalanx as px
from phalanx.tools.demo.wine import WineConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=WineConfig.epochs)
    parser.add_argument("--batch-size", type=int, default=WineConfig.batch_size, help="per process")
    parser.add_argument("--lr", type=float, default=WineConfig.lr)
    parser.add_argument("--out", default="runs/wine", help="checkpoints go to OUT/checkpoints")
    parser.add_argument("--fresh", action="store_true", help="ignore and delete earlier checkpoints")
    args = parser.parse_args()

    px.init()  # reads the world from `phalanx run`, torchrun or srun; alone it is a world of one
    summary = train(WineConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                               out=args.out, fresh=args.fresh))
    px.print0(f"held-out accuracy: {summary['heldout_accuracy']:.2f}")
    px.print0(f"checkpoint: {summary['checkpoint'] or summary['checkpoint_dir']}")
    px.shutdown()


if __name__ == "__main__":
    main()
