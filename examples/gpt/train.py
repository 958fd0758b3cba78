"""Train a character-level GPT on Shakespeare with phalanx DDP, then sample from it.

    phalanx run --nproc-per-node 2 examples/gpt/train.py        # CPU: a few minutes, loss ~1.9 nats/char
    python examples/gpt/train.py --max-steps 100                 # one process
    phalanx run --nproc-per-node 8 examples/gpt/train.py --n-layer 6 --n-head 6 --d-model 384 \\
        --block-size 256 --batch-size 64 --max-steps 5000       # GPUs: a model that writes verse

Shows: mixed precision on GPU (autocast + GradScaler), gradient accumulation that exchanges gradients
once per step (`no_sync` on the other micro-batches), checkpoints and resume (run the same command
again: it continues from the last checkpoint; `--fresh` starts over), a stop that loses nothing
(SIGTERM or Ctrl-C to `phalanx run`: every rank saves at the same step and exits with code 75; the
same command resumes there), sharding (`--shard optimizer`, `gradients` or `parameters`; a checkpoint
resumes at any other level), a StepLog (a line every --log-every steps with the loss over every rank's
tokens, tokens/s, each rank's busy time and the slowest rank; OUT/log/steps.jsonl and TensorBoard;
`phalanx report OUT` draws it), and sampling at the end.
It prints the character unigram entropy of the text: what a model that ignores context scores.
"""

import argparse
import itertools
import math
import shutil
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
from model import GPT, GPTConfig  # model.py, beside this file
from torch.utils.data import Dataset

import phalanx as px

DEFAULT_TEXT = Path(__file__).parent / "data" / "shakespeare.txt"


class CharChunks(Dataset):
    """Consecutive windows of `block_size + 1` characters: the input, and the same shifted by one."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data, self.block_size = data, block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i):
        chunk = self.data[i * self.block_size: (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def unigram_entropy(text: str) -> float:
    """Entropy of the character frequencies in nats: the loss of the best context-free model."""
    counts, total = Counter(text), len(text)
    return -sum(n / total * math.log(n / total) for n in counts.values())


def warmup_then_cosine(step: int, warmup: int, total: int) -> float:
    """Learning-rate factor: a linear ramp over `warmup` steps, then a cosine down to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def micro_batch_groups(loader, size: int):
    """Lists of `size` consecutive batches (the last one of an epoch may be shorter): one step each."""
    batches = iter(loader)
    while group := list(itertools.islice(batches, size)):
        yield group


def train_step(model, group, optimizer, scheduler, scaler, autocast, device) -> torch.Tensor:
    """One optimizer step over a group of micro-batches; returns the mean loss (a tensor)."""
    optimizer.zero_grad(set_to_none=True)
    mean_loss = torch.zeros((), device=device)
    for i, (x, y) in enumerate(group):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # Accumulate locally under no_sync; the last micro-batch's backward exchanges the sum once.
        with nullcontext() if i == len(group) - 1 else model.no_sync():
            with autocast:
                _, loss = model(x, y)
            scaler.scale(loss / len(group)).backward()
        mean_loss += loss.detach() / len(group)
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    model.clip_grad_norm_(1.0)  # the whole model's norm, at every --shard level
    scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
    scaler.update()
    scheduler.step()
    return mean_loss


@torch.no_grad()
def validation_loss(model, dataset, batch_size, autocast, device, pad: bool) -> float:
    """Mean loss per character over `dataset`, every window counted once across the ranks (with `pad`, a
    few windows twice: FSDP2's forward is collective, so every rank must run as many batches)."""
    sampler = px.DistributedSampler(dataset, shuffle=False, pad=pad)  # disjoint shards
    mean = px.metrics.Mean()
    model.eval()
    for x, y in px.DataLoader(dataset, batch_size=batch_size, sampler=sampler):
        if px.stop_requested(agree=pad):  # asked to stop: training is saved; leave early (together under FSDP2)
            break
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        mean.update(loss, weight=y.numel())
    model.train()
    return mean.compute()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = parser.add_argument_group("model")
    model.add_argument("--n-layer", type=int, default=4)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--block-size", type=int, default=64, help="context length in characters")
    model.add_argument("--dropout", type=float, default=0.0)
    run = parser.add_argument_group("training")
    run.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per process")
    run.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    run.add_argument("--lr", type=float, default=3e-3)
    run.add_argument("--max-steps", type=int, default=400, help="optimizer steps in the whole run")
    run.add_argument("--warmup-steps", type=int, default=20)
    run.add_argument("--log-every", type=int, default=25, help="steps per StepLog record (a line, steps.jsonl)")
    run.add_argument("--peak-flops", type=float, default=None,
                     help="one device's peak FLOP/s at the training precision (e.g. 989e12: an H100 SXM's dense "
                          "bf16/fp16), for the logged MFU; not guessed, so no MFU without it")
    run.add_argument("--checkpoint-every", type=int, default=100)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    run.add_argument("--out", type=Path, default=Path("runs/gpt"))
    run.add_argument("--fresh", action="store_true", help="delete earlier checkpoints and start over")
    run.add_argument("--sample-chars", type=int, default=300)
    run.add_argument("--shard", choices=("none", "optimizer", "gradients", "parameters"), default="none",
                     help="what each rank keeps only its part of: nothing (plain DDP), the optimizer state, also "
                          "the gradients, also the parameters (torch's FSDP2); docs/sharding.md")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    px.init()
    device = px.device()

    text = args.text.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text])
    split = int(0.9 * len(data))  # the last 10% is never trained on
    train_set, val_set = CharChunks(data[:split], args.block_size), CharChunks(data[split:], args.block_size)
    entropy = unigram_entropy(text)
    px.print0(f"text: {args.text.name}, {len(text):,} characters, {len(vocab)} distinct")
    px.print0(f"unigram entropy of the text: {entropy:.3f} nats/char")

    torch.manual_seed(args.seed)
    config = GPTConfig(len(vocab), args.block_size, args.n_layer, args.n_head, args.d_model, args.dropout)
    device_ids = [device] if device.type == "cuda" else None
    if args.shard == "parameters":  # built on meta and sharded one module at a time: never whole on a rank
        with torch.device("meta"):
            net = GPT(config)
        model = px.DistributedDataParallel(net, device_ids=device_ids, shard="parameters", init=GPT._init_weights)
    else:
        model = px.DistributedDataParallel(GPT(config).to(device), device_ids=device_ids, shard=args.shard)
    optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_then_cosine(step, args.warmup_steps, args.max_steps))
    # fp16 autocast + loss scaling on GPUs; full precision on the CPU (both objects are no-ops there).
    use_amp = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.float16, enabled=use_amp)
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp)
    loader = px.DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                           sampler=px.DistributedSampler(train_set, shuffle=True, seed=args.seed))
    if len(loader) == 0:  # else the training loop below would wait forever for a batch
        raise SystemExit(f"{args.text} is too short for one batch of {args.batch_size} x {args.block_size} "
                         f"characters on each of {px.world_size()} process(es): lower --batch-size or --block-size")
    parameters = sum(p.numel() for p in model.parameters())
    px.print0(f"model: {parameters / 1e6:.2f}M parameters (n_layer {args.n_layer}, n_head {args.n_head}, "
              f"d_model {args.d_model}, block {args.block_size}); {px.world_size()} process(es) on {device}"
              f"{', fp16 autocast' if use_amp else ''}{f', shard={args.shard}' if args.shard != 'none' else ''}")
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum * px.world_size()
    px.print0(f"each step: {args.grad_accum} micro-batches x {args.batch_size} x {args.block_size} chars "
              f"x {px.world_size()} process(es) = {tokens_per_step:,} characters")

    checkpoint_dir = args.out / "checkpoints"
    if args.fresh:
        if px.is_main():
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
        px.barrier()
    # Saves every --checkpoint-every steps, at the last step, and at the step all ranks agree on when asked to stop.
    checkpointer = px.Checkpointer(checkpoint_dir, keep=2, every=args.checkpoint_every)
    # A record every --log-every steps; in the checkpoint's state, so that a resumed run trims what it redoes.
    # FLOPs per token: 6 per parameter (forward and backward) plus attention's 12 * layers * d_model * context.
    flops_per_token = 6 * parameters + 12 * args.n_layer * args.d_model * args.block_size
    log = px.StepLog(args.out / "log", every=args.log_every, optimizer=optimizer, flops_per_token=flops_per_token,
                     peak_flops=args.peak_flops, total_steps=args.max_steps)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "loader": loader,
             "step": 0, "epoch": 0, "log": log}
    if checkpointer.restore(state):
        px.print0(f"resuming at step {state['step']} of {args.max_steps} (checkpoints in {checkpoint_dir})")

    while state["step"] < args.max_steps:
        loader.set_epoch(state["epoch"])
        for group in micro_batch_groups(loader, args.grad_accum):
            loss = train_step(model, group, optimizer, scheduler, scaler, autocast, device)
            # This rank's loss and what it trained on: the record's loss is over every rank's tokens.
            log.step(loss=loss, samples=sum(len(y) for _, y in group), tokens=sum(y.numel() for _, y in group))
            state["step"] += 1
            step = state["step"]
            checkpointer.step(state, last=step == args.max_steps)  # last in the step: saves what the step did
            if step >= args.max_steps:
                break
        else:
            state["epoch"] += 1  # the loader ran dry: the next pass reshuffles

    log.close()  # every rank: the steps since the last record, then the files closed
    val = validation_loss(model.module, val_set, args.batch_size, autocast, device, pad=args.shard == "parameters")
    px.print0(f"validation loss: {val:.3f} nats/char (unigram entropy {entropy:.3f}; lower means it learned context)")

    sampler_model = model.module
    if args.shard == "parameters":  # each rank holds shards: export the whole weights, sample from a plain copy
        path = px.export_weights(model, args.out / "weights.safetensors")  # every rank takes part
        if px.is_main():
            sampler_model = GPT(config).to(device)
            sampler_model.load_state_dict(px.load_weights(path, device))
            px.print0(f"exported the whole weights to {path}")
    if px.is_main():
        generator = torch.Generator(device=device).manual_seed(args.seed)
        prompt = torch.tensor([[index["\n"]]], device=device)
        with autocast:
            sample = sampler_model.generate(prompt, args.sample_chars, generator=generator)[0].tolist()
        print("sample:\n" + "".join(vocab[i] for i in sample).strip(), flush=True)
    px.shutdown()


if __name__ == "__main__":
    main()
