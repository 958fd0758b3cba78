"""A training script stand-in that tests/e2e/test_launch.py starts under `phalanx run`, torchrun and python.

Every rank all-reduces its rank and prints the sum. `--fail-rank R` makes rank R raise on the first
attempt only (TORCHELASTIC_RESTART_COUNT == 0); `--pid-dir D` keeps a DataLoader worker running on
every rank, writes the pids of the rank and of that worker to D, and makes the ranks that do not
fail wait until the launcher stops them.
"""

import argparse
import functools
import os
import sys
import time

import torch
import torch.distributed as dist

import phalanx


class SlowDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 1_000_000

    def __getitem__(self, index):
        time.sleep(0.05)
        return index


def write_pid(pid_dir: str, name: str, *_):
    with open(os.path.join(pid_dir, f"{name}.pid.tmp"), "w") as handle:
        handle.write(str(os.getpid()))
    os.replace(os.path.join(pid_dir, f"{name}.pid.tmp"), os.path.join(pid_dir, f"{name}.pid"))


def start_loader_worker(pid_dir: str, rank: int):
    loader = torch.utils.data.DataLoader(SlowDataset(), num_workers=1,
                                         worker_init_fn=functools.partial(write_pid, pid_dir, f"rank{rank}-loader"))
    batches = iter(loader)
    next(batches)  # the worker process is up and serving
    write_pid(pid_dir, f"rank{rank}-main")
    return batches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--pid-dir", default=None)
    args = parser.parse_args()

    phalanx.init()
    rank, attempt = phalanx.rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    # One write per line: under torchrun the ranks share one unbuffered stdout.
    sys.stdout.write(f"rank={rank} world_size={phalanx.world_size()} sum={int(total.item())} attempt={attempt} "
                     f"omp={omp}\n")
    sys.stdout.flush()

    batches = start_loader_worker(args.pid_dir, rank) if args.pid_dir else None
    if args.pid_dir:
        phalanx.barrier(timeout=120)  # every rank's loader runs before anyone fails
    if args.fail_rank == rank and attempt == 0:
        raise ValueError(f"rank {rank} fails on purpose")
    if batches is not None:
        time.sleep(600)  # stopped by the launcher long before this ends
    phalanx.shutdown()


if __name__ == "__main__":
    main()
