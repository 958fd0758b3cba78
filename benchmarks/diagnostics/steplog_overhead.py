"""What `log.step(...)` of a StepLog with every=1 costs a training step: an A/B in one launch.

    PYTHONPATH=. python benchmarks/diagnostics/steplog_overhead.py [deep wide gpt ...] [--blocks N] [--steps N]
        [--print]

Two Gloo CPU ranks (1 thread each) train phalanx DDP on a bench model as `phalanx run` would start them
(progress record on); blocks of steps alternate between calling `log.step(loss=..., samples=...)` after
each optimizer step (every=1: a record per step, written to steps.jsonl and TensorBoard by rank 0) and
not calling it, so the machine's drift hits both alike. Prints the median step time of the slowest rank
per setting and their ratio; and, since on a busy machine that ratio moves by more than the cost, the
cost in CPU time, which preemption by other processes does not inflate: the main thread's time inside
log.step() per step on rank 0 (which also writes the records) and rank 1, plus the CPU time of Gloo's
threads per gather (measured apart) divided by the steps between two gathers. `--print`: rank 0 prints
its line per record too (to this terminal; off by default).
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
from phalanx.tools.bench_block import run_block
from phalanx.tools.bench_compare import add_json_flag, interleave, median_of_steps, write_figures
from phalanx.tools.bench_models import MODELS, make_batches


def _rank(rank: int, names: list[str], blocks: int, steps: int, directory: str, show: bool) -> dict:
    return {name: _measure(name, rank, blocks, steps, directory, show) for name in names}


def _measure(name: str, rank: int, blocks: int, steps: int, directory: str, show: bool) -> dict:
    bench_model = MODELS[name]
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(bench_model.build())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))
    log = phalanx.StepLog(os.path.join(directory, name), every=1, optimizer=optimizer, print_every=1 if show else 0)
    loss = torch.tensor(1.25)  # a CPU loss tensor, as a training loop passes it
    inside: list[float] = []
    plain_step = optimizer.step

    def step_then_log(*args, **kwargs):
        result = plain_step(*args, **kwargs)
        started = time.thread_time()
        log.step(loss=loss, samples=4)
        inside.append(time.thread_time() - started)
        return result

    def block(setting):
        optimizer.step = step_then_log if setting == "on" else plain_step
        return run_block(model, optimizer, bench_model, batches, 2, steps, torch.device("cpu"))

    times = interleave(["on", "off"], blocks, block)
    optimizer.step = plain_step
    gathers = max(1, log._gather.count)
    log.close()
    return {**{s: median_of_steps(v) for s, v in times.items()}, "inside_us": 1e6 * statistics.mean(inside),
            "steps_per_gather": len(inside) / gathers, **_one_gather()}


def _one_gather(count: int = 200) -> dict:
    """CPU time of one gather of 40 windows, all threads: the main thread's (launch, read) and Gloo's."""
    from phalanx.observe.gather import RowGather

    gather = RowGather(11, 60.0)
    rows = torch.zeros(40, 11, dtype=torch.float64)
    phalanx.barrier()
    process, thread = time.process_time(), time.thread_time()
    for _ in range(count):
        time.sleep(0.002)  # idle ranks: nothing else of this process runs
        gather.launch(rows)
        gather.result("rows")
    main = (time.thread_time() - thread) / count
    every_thread = (time.process_time() - process) / count
    return {"gather_main_us": 1e6 * main, "gather_gloo_us": 1e6 * (every_thread - main)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["deep", "wide", "gpt"])
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--print", action="store_true", help="rank 0 prints a line per record")
    add_json_flag(parser)
    args = parser.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as directory:
        env = {"PHALANX_RUN_DIR": directory, "PHALANX_STALL_WATCHER": "launcher"}  # as under `phalanx run`
        per_rank = run_ranks(_rank, 2, (args.models, args.blocks, args.steps, directory, args.print), timeout=3600,
                             env=env)
    for name in args.models:
        r0, r1 = per_rank[0][name], per_rank[1][name]
        gloo = r0["gather_gloo_us"] / r0["steps_per_gather"]
        cost = max(r0["inside_us"], r1["inside_us"]) + gloo
        print(f"{name:<6} log.step() on {r0['on']:8.2f} ms   off {r0['off']:8.2f} ms   "
              f"on/off {r0['on'] / r0['off']:.4f};"
              f"   CPU per step in log.step(): rank 0 {r0['inside_us']:5.1f} us, rank 1 {r1['inside_us']:5.1f} us;"
              f" Gloo {r0['gather_gloo_us']:5.1f} us per gather / {r0['steps_per_gather']:.0f} steps;"
              f" = {100 * cost / (1000 * r0['off']):.3f} % of a step")
        figures.update({f"{name} on/off": round(r0["on"] / r0["off"], 4),
                        f"{name} CPU % of a step": round(100 * cost / (1000 * r0["off"]), 3)})
    write_figures(args.json_path, figures)


if __name__ == "__main__":
    main()
