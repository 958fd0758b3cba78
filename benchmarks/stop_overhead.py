"""What `checkpointer.step(state)` costs a training step when no save is due: the stop agreement, an A/B.

    PYTHONPATH=. python benchmarks/stop_overhead.py [deep wide ...] [--blocks N] [--steps N] [--interval S]

Two Gloo CPU ranks (1 thread each) train phalanx DDP as `phalanx run` would start them (the progress
record on); blocks of steps alternate between calling `checkpointer.step(state)` after each optimizer
step (no `every`: it only agrees on stops) and not calling it, so the machine's drift hits both
alike. Prints the median step time of the slowest rank per setting and their ratio; and, since on a
busy machine that ratio moves by more than the cost measured, the cost itself in CPU time, which
preemption by other processes does not inflate: the main thread's time inside step(), plus the time
the other threads of the process (Gloo's, which run the agreement's all-reduce) spent in excess of
the blocks without step(), per step, against the step time. `--interval` is PHALANX_STOP_INTERVAL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import phalanx
from phalanx.testing import run_ranks
from phalanx.tools.bench import run_block
from phalanx.tools.bench_models import MODELS, make_batches


def _rank(rank: int, names: list[str], blocks: int, steps: int, directory: str) -> dict:
    return {name: _measure(name, rank, blocks, steps, directory) for name in names}


def _measure(name: str, rank: int, blocks: int, steps: int, directory: str) -> dict:
    bench_model = MODELS[name]
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(bench_model.build())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))
    checkpointer = phalanx.Checkpointer(os.path.join(directory, name))
    inside: list[float] = []
    plain_step = optimizer.step

    def step_then_agree(*args, **kwargs):
        result = plain_step(*args, **kwargs)
        started = time.thread_time()
        checkpointer.step({})  # nothing is due and nobody asks to stop: the agreement alone
        inside.append(time.thread_time() - started)
        return result

    times = {"on": [], "off": []}
    others = {"on": [], "off": []}  # CPU seconds per step of the threads other than this one
    for block in range(2 * blocks):
        setting = ("on", "off")[block % 2]
        optimizer.step = step_then_agree if setting == "on" else plain_step
        process, thread = time.process_time(), time.thread_time()
        times[setting] += run_block(model, optimizer, bench_model, batches, 2, steps, torch.device("cpu"))
        others[setting].append(((time.process_time() - process) - (time.thread_time() - thread)) / (steps + 2))
    optimizer.step = plain_step
    return {**{s: statistics.median(v) for s, v in times.items()},
            "inside_us": 1e6 * statistics.mean(inside),
            "others_us": 1e6 * (statistics.mean(others["on"]) - statistics.mean(others["off"])),
            "every": checkpointer._agreement.every}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["deep", "wide"])
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--interval", type=float, default=None, help="PHALANX_STOP_INTERVAL (default: 0.5 s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        env = {"PHALANX_RUN_DIR": directory, "PHALANX_STALL_WATCHER": "launcher"}  # as under `phalanx run`
        if args.interval is not None:
            env["PHALANX_STOP_INTERVAL"] = str(args.interval)
        results = run_ranks(_rank, 2, (args.models, args.blocks, args.steps, directory), timeout=3600, env=env)[0]
    for name, r in results.items():
        cost = max(0.0, r["inside_us"]) + max(0.0, r["others_us"])
        print(f"{name:<6} step() on {r['on']:8.2f} ms   off {r['off']:8.2f} ms   on/off {r['on'] / r['off']:.4f};   "
              f"CPU per step: in step() {r['inside_us']:5.1f} us + other threads {r['others_us']:+6.1f} us = "
              f"{100 * cost / (1000 * r['off']):.3f} % of a step; an agreement every {r['every']} step(s)")


if __name__ == "__main__":
    main()
