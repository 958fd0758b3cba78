"""A training job for tests/e2e/test_xhost.py: phalanx DDP beside torch DDP across hosts (namespaces).

For each case of `--cases` in turn, every rank trains the same model with phalanx DDP and with torch
DDP on the same batches, then prints one JSON line: the case, the exchange phalanx chose, the sizes of
the buckets the hierarchical exchange sends flat and in two levels, its parameters' digest (bitwise
equality across ranks), the largest difference to torch DDP's, and the shared-memory segments this
process maps once the case's models are built (from /proc/self/maps). One launch serves every case:
  auto        the exchange phalanx chooses          flat, hier   PHALANX_XHOST=flat / hier
  optimizer, gradients   phalanx DDP sharded at that level
  uneven      the last rank has one batch fewer, under join() in both DDPs
`--kill-rank R` makes rank R kill itself (SIGKILL) at step 2 of the first case.
"""

import argparse
import contextlib
import gc
import hashlib
import json
import os
import re
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx


def mapped_segments() -> list[str]:
    with open("/proc/self/maps") as handle:
        return sorted({m.group(1) for m in re.finditer(r"/dev/shm/(phalanx-shm\.[^\s]+)", handle.read())})


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 8))


CASES = {"auto": ("auto", "none", False), "flat": ("flat", "none", False), "hier": ("hier", "none", False),
         "optimizer": ("auto", "optimizer", False), "gradients": ("auto", "gradients", False),
         "uneven": ("auto", "none", True)}  # case: (PHALANX_XHOST, shard level, uneven)


def run_case(case: str, steps: int, kill_rank: int | None) -> dict:
    xhost, shard, uneven = CASES[case]
    os.environ["PHALANX_XHOST"] = xhost  # read as each DDP is built (world/topology.py)
    rank = dist.get_rank()
    ours = phalanx.DistributedDataParallel(build(0), bucket_cap_mb=0.05, shard=shard)  # several buckets
    theirs = TorchDDP(build(0), bucket_cap_mb=0.05)
    opts = [ours.shard_optimizer(torch.optim.SGD(ours.parameters(), lr=0.1)),
            torch.optim.SGD(theirs.parameters(), lr=0.1)]
    segments = mapped_segments()
    steps -= 1 if uneven and rank == dist.get_world_size() - 1 else 0
    for model, opt in zip((ours, theirs), opts):
        with model.join() if uneven else contextlib.nullcontext():
            for step in range(steps):
                if step == 2 and rank == kill_rank:
                    print(json.dumps({"rank": rank, "killing": os.getpid()}), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                generator = torch.Generator().manual_seed(1000 * step + rank)
                x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    reference = torch.cat([p.detach().reshape(-1) for p in theirs.parameters()])
    exchange = ours._reducer.exchange
    paths = {"flat": [], "two_level": []}
    if hasattr(exchange, "_plans"):  # HierarchicalExchange: bytes of each dense bucket, by path
        for bucket in ours._reducer.buckets:
            nbytes = bucket.numel * bucket.storage.element_size()
            paths["flat" if exchange._flat(bucket) else "two_level"].append(nbytes)
    return {"case": case, "rank": rank, "exchange": type(exchange).__name__, "paths": paths,
            "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "max_diff": (flat - reference).abs().max().item(), "segments": segments,
            "host": os.environ.get("GROUP_RANK")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="auto", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    phalanx.init()
    for case in args.cases.split(","):
        print(json.dumps(run_case(case, args.steps, args.kill_rank)), flush=True)
        gc.collect()  # the case's models and their shared memory go before the next case's are built
    phalanx.shutdown()


if __name__ == "__main__":
    main()
