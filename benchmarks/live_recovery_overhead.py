"""What live recovery costs a healthy training step: the per-step commit and the watched waits, an A/B.

    PYTHONPATH=. python benchmarks/live_recovery_overhead.py [deep wide gpt ...] [--blocks N] [--steps N]

Two CPU ranks (1 thread each) train phalanx DDP on `phalanx bench`'s models, over the shared-memory exchange
or Gloo's (`--transport`). Blocks of steps alternate between live recovery on (PHALANX_MIN_WORLD_SIZE=1: every
wait on a collective watches for a step given up, and each step commits through the store after its exchange
where a global-batch step does: not over shared memory, whose exchange ends alike on every rank) and off, so the
machine's drift hits both alike. Prints the median step time of the slowest rank per setting and their ratio;
and, since on a shared machine that ratio moves by more than the cost measured, the commit's own cost: its
wall time per step on the main thread (store round trips, which a busy machine stretches too) and its CPU time,
against the step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import phalanx
from phalanx.testing import run_ranks
from phalanx.tools.bench import run_block
from phalanx.tools.bench_models import MODELS, make_batches
from phalanx.world import generation


def _rank(rank: int, names: list[str], blocks: int, steps: int) -> dict:
    return {name: _measure(name, rank, blocks, steps) for name in names}


def _measure(name: str, rank: int, blocks: int, steps: int) -> dict:
    bench_model = MODELS[name]
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(bench_model.build())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))
    generation.announce()
    wall: list[float] = []
    cpu: list[float] = []
    plain_step = optimizer.step

    def commit_then_step(*args, **kwargs):
        started, started_cpu = time.perf_counter(), time.thread_time()
        if not model._steps_settle_alike() and not generation.commit_step():  # as a global-batch step does
            raise RuntimeError("a healthy step did not commit")
        wall.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
        return plain_step(*args, **kwargs)

    times = {"on": [], "off": []}
    for block in range(2 * blocks):
        setting = ("on", "off")[block % 2]
        if setting == "on":
            os.environ[generation.MIN_WORLD_ENV] = "1"
            optimizer.step = commit_then_step
        else:
            os.environ.pop(generation.MIN_WORLD_ENV, None)
            optimizer.step = plain_step
        times[setting] += run_block(model, optimizer, bench_model, batches, 2, steps, torch.device("cpu"))
    os.environ.pop(generation.MIN_WORLD_ENV, None)
    optimizer.step = plain_step
    return {**{s: statistics.median(v) for s, v in times.items()}, "commit_ms": 1e3 * statistics.median(wall),
            "commit_cpu_ms": 1e3 * statistics.median(cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["deep", "wide", "gpt"])
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--transport", choices=("shm", "gloo"), default="shm",
                        help="the exchange: shared memory (phalanx's default on one host: its steps end alike on "
                             "every rank, no commit) or Gloo's all-reduce (PHALANX_SHM=0: a commit per step)")
    args = parser.parse_args()
    env = {"PHALANX_SHM": "1" if args.transport == "shm" else "0"}
    results = run_ranks(_rank, 2, (args.models, args.blocks, args.steps), timeout=3600, env=env)[0]
    for name, r in results.items():
        print(f"{name:<6} {args.transport:<4} step: on {r['on']:8.2f} ms   off {r['off']:8.2f} ms   "
              f"on/off {r['on'] / r['off']:.4f};   commit per step: {r['commit_ms']:.3f} ms wall "
              f"({100 * r['commit_ms'] / r['off']:.2f} % of a step), {r['commit_cpu_ms']:.3f} ms CPU "
              f"({100 * r['commit_cpu_ms'] / r['off']:.2f} %)")


if __name__ == "__main__":
    main()
