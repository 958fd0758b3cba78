"""One rank of benchmarks/hosts/diloco_quality.py: examples/gpt trained with exact DDP or with DiLoCo, its curve.

Started by `phalanx run --nnodes N` once per emulated host (the launcher's node rank tells the hosts apart). The
loop is examples/gpt/train.py's (its data, model, AdamW with warmup and cosine, the whole model's norm clipped),
with `across_hosts=` the only difference between the two modes; every --val-every steps (a multiple of H, right
after the outer step, when every host holds the synced model) it measures the validation loss over every window
of the held-out 10 %, shared out over all ranks. Rank 0 writes the curve as JSON.

Under live recovery (`phalanx run --min-world-size`) the loop is docs/data.md's global batch (what lets the ranks left
re-split a step: --batch-size x the first world's ranks sequences a step), and `--kill-at-step S` on the host whose
node rank is `--kill-host` writes `--out`.kill before step S and waits: benchmarks/hosts/diloco_quality.py then
SIGKILLs that host's launcher and worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import phalanx as px
from phalanx.world import generation

GPT_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt"
sys.path.insert(0, str(GPT_DIR))

from model import GPT, GPTConfig  # noqa: E402  examples/gpt/model.py
from train import CharChunks, validation_loss, warmup_then_cosine  # noqa: E402  examples/gpt/train.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("exact", "diloco"), required=True)
    parser.add_argument("--every", type=int, default=50, help="DiLoCo's H")
    parser.add_argument("--compress", default="int8", help="DiLoCo's compress ('none' for None)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer_lr")
    parser.add_argument("--momentum", type=float, default=0.9, help="DiLoCo's outer momentum")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-host", type=int, default=-1, help="the node rank of the host to kill")
    parser.add_argument("--kill-at-step", type=int, default=-1, help="before this step (counted from 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    px.init()
    text = (GPT_DIR / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text])
    split = int(0.9 * len(data))
    train_set, val_set = CharChunks(data[:split], args.block_size), CharChunks(data[split:], args.block_size)

    torch.manual_seed(args.seed)
    net = GPT(GPTConfig(len(vocab), args.block_size, args.n_layer, 4, args.d_model))
    across = None
    if args.mode == "diloco":
        across = px.DiLoCo(every=args.every, compress=None if args.compress == "none" else args.compress,
                           outer_lr=args.outer_lr, momentum=args.momentum)
    model = px.DistributedDataParallel(net, across_hosts=across)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_then_cosine(step, args.warmup_steps, args.steps))
    live = generation.live_recovery()
    samples_per_step = args.batch_size * px.world_size()
    loader = px.DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                           global_batch_size=samples_per_step if live else None,
                           sampler=px.DistributedSampler(train_set, shuffle=True, seed=args.seed))
    doomed = live and int(os.environ.get("GROUP_RANK", "-1")) == args.kill_host
    curve, step, epoch = [], 0, 0
    while step < args.steps:
        loader.set_epoch(epoch)
        for batch in loader:
            if doomed and step + 1 == args.kill_at_step:  # mid-period: the driver SIGKILLs this host whole
                Path(args.out + ".kill").write_text(str(step + 1))
                time.sleep(3600)
            optimizer.zero_grad(set_to_none=True)
            if live:  # a GlobalStep: its micro-batches, re-split over the ranks left after a loss
                for x, y in batch.micro_batches(model):
                    _, loss = model(x, y)
                    batch.backward(loss)
            else:
                _, loss = model(*batch)
                loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % args.val_every == 0 or step == args.steps:
                val = validation_loss(model.module, val_set, 64, nullcontext(), torch.device("cpu"), pad=False)
                curve.append({"step": step, "samples": step * samples_per_step, "val_loss": val})
                px.print0(f"{args.mode} seed {args.seed} step {step}: validation loss {val:.4f}")
            if step >= args.steps:
                break
        epoch += 1
    outer = getattr(model, "outer_step", None)
    if px.is_main():
        Path(args.out).write_text(json.dumps({
            "mode": args.mode, "seed": args.seed, "args": vars(args), "world": px.world_size(), "live": live,
            "curve": curve, "outer_steps": getattr(outer, "outer_steps", 0),
            "bytes_across_hosts": getattr(outer, "bytes_across_hosts", 0)}))
    px.shutdown()


if __name__ == "__main__":
    main()
