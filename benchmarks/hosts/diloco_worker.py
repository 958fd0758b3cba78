"""One rank of benchmarks/hosts/diloco_bench.py, started by `phalanx run` inside a host's network namespace.

Trains examples/gpt's model with each variant asked for, one after the other on the same batches: torch DDP,
exact phalanx DDP (`across_hosts=None`, the two-level exchange), DiLoCo (`across_hosts=px.DiLoCo(...)`) and
compute-only (no DDP). Each variant warms up, then runs a timed window: --steps steps, or for DiLoCo exactly one
period of H steps, placed so that every fragment is sent and merged inside it once (the warm-up is H - 1 steps,
and delay < H/F). Local rank 0 of every host reads its interface's byte counters around the window. Rank 0
writes one JSON file: per variant the window's wall time (slowest rank), steps and each host's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx as px
from phalanx.world.topology import host_topology

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))

from model import GPT, GPTConfig  # examples/gpt/model.py

VOCAB = 65  # examples/gpt's Shakespeare has 65 distinct characters


def counters(dev: str) -> dict:
    base = f"/sys/class/net/{dev}/statistics"
    return {name: int(open(f"{base}/{name}").read()) for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}


def build(variant: str, config: GPTConfig, args, local_size: int):
    torch.manual_seed(0)
    module = GPT(config)
    if variant == "torch":
        model = TorchDDP(module)
    elif variant == "exact":
        if local_size > 1:  # every bucket through the two-level exchange (read when built); one rank a host: flat
            os.environ["PHALANX_XHOST"] = "hier"
        model = px.DistributedDataParallel(module)
        os.environ.pop("PHALANX_XHOST", None)
    elif variant == "diloco":
        model = px.DistributedDataParallel(module, across_hosts=px.DiLoCo(
            every=args.every, compress=None if args.compress == "none" else args.compress,
            fragments=args.fragments, delay=args.delay))
    else:
        model = module
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, optimizer, batch) -> None:
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(*batch)
    loss.backward()
    optimizer.step()


def window(variant: str, config: GPTConfig, args, batches, dev: str, topology) -> dict:
    model, optimizer = build(variant, config, args, topology.local_size)
    reader = topology.local == 0
    if variant == "diloco":
        if args.delay >= args.every // args.fragments:
            raise SystemExit(f"--delay {args.delay} must be below H/F = {args.every // args.fragments}: a window of "
                             "one period then holds each fragment's exchange whole")
        warmup, steps = args.every - 1, args.every
    else:
        warmup, steps = args.warmup, args.steps
    for i in range(warmup):
        step(model, optimizer, batches[i % len(batches)])
    dist.barrier()
    before = counters(dev) if reader else None
    start = time.perf_counter()
    for i in range(steps):
        step(model, optimizer, batches[(warmup + i) % len(batches)])
    wall = time.perf_counter() - start
    after = counters(dev) if reader else None
    slowest = torch.tensor([wall], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # after the window: not counted
    traffic = {k: after[k] - before[k] for k in after} if reader else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, traffic)
    outer = getattr(model, "outer_step", None)
    record = {"wall_s": slowest.item(), "steps": steps, "hosts": [t for t in gathered if t is not None],
              "outer_steps": getattr(outer, "outer_steps", 0),
              "bytes_across_hosts_rank0": getattr(outer, "bytes_across_hosts", 0)}
    del model, optimizer
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="torch,exact,diloco,compute")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--compress", default="int8")
    parser.add_argument("--fragments", type=int, default=5)
    parser.add_argument("--delay", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps of the variants other than DiLoCo")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step per rank")
    parser.add_argument("--dev", required=True, help="this host's interface (its byte counters)")
    parser.add_argument("--out", required=True, help="rank 0 writes the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    px.init()
    rank = dist.get_rank()
    topology = host_topology()
    config = GPTConfig(VOCAB, args.block_size, args.n_layer, 4, args.d_model)
    g = torch.Generator().manual_seed(rank)
    batches = [tuple(torch.randint(0, VOCAB, (args.batch_size, args.block_size), generator=g) for _ in range(2))
               for _ in range(4)]
    result = {"hosts": len(topology.hosts), "local": topology.local_size, "world": dist.get_world_size(),
              "params": sum(p.numel() for p in GPT(config).parameters()),
              "samples_per_step": args.batch_size * dist.get_world_size(), "variants": {}}
    for variant in args.variants.split(","):
        result["variants"][variant] = window(variant, config, args, batches, args.dev, topology)
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    px.shutdown()


if __name__ == "__main__":
    main()
