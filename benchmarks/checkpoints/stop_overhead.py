"""What `checkpointer.step(state)` costs a training step when no save is due: the stop agreement, an A/B.

    PYTHONPATH=. python benchmarks/checkpoints/stop_overhead.py [deep wide ...] [--blocks N] [--steps N] [--interval S]

Two Gloo CPU ranks (1 thread each) train phalanx DDP as `phalanx run` would start them (the progress
record on); blocks of steps interleave calling `checkpointer.step(state)` after each optimizer
step (no `every`: it only agrees on stops) and not calling it, so the machine's drift hits both
alike. Prints the median step time of the slowest rank per setting and their ratio; and, since on a
busy machine that ratio moves by more than the cost measured, the cost itself in CPU time, which
preemption by other processes does not inflate: the main thread's time inside step() per step (the
agreement group's creation, once per run, left out), plus the CPU time Gloo's threads spend on one
agreement (measured apart, 300 agreements between idle ranks) divided by the steps between two
agreements; against the step time. `--interval` is PHALANX_STOP_INTERVAL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import phalanx
from phalanx.checkpoint.agreement import StopAgreement
from phalanx.testing import run_ranks
from phalanx.tools.bench_block import run_block
from phalanx.tools.bench_compare import add_json_flag, interleave, median_of_steps, write_figures
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

    checkpointer.step({})  # the first call makes the agreement's Gloo group: once per run, not per step

    def block(setting):
        optimizer.step = step_then_agree if setting == "on" else plain_step
        return run_block(model, optimizer, bench_model, batches, 2, steps, torch.device("cpu"))

    times = interleave(["on", "off"], blocks, block)
    optimizer.step = plain_step
    return {**{s: median_of_steps(v) for s, v in times.items()}, "inside_us": 1e6 * statistics.mean(inside),
            "every": checkpointer._agreement.every, **_one_agreement()}


def _one_agreement(count: int = 300) -> dict:
    """CPU time of one agreement, all threads: the main thread's (launch, read) and Gloo's (the all-reduce)."""
    agreement = StopAgreement()
    agreement.target = 0.0  # an agreement at every call
    agreement.at_step()  # the group is made here, not measured
    phalanx.barrier()
    process, thread = time.process_time(), time.thread_time()
    for _ in range(count):
        time.sleep(0.002)  # idle ranks: nothing else of this process runs
        agreement.at_step()
    main = (time.thread_time() - thread) / count
    every_thread = (time.process_time() - process) / count
    return {"agreement_main_us": 1e6 * main, "agreement_gloo_us": 1e6 * (every_thread - main)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["deep", "wide"])
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--interval", type=float, default=None, help="PHALANX_STOP_INTERVAL (default: 0.5 s)")
    add_json_flag(parser)
    args = parser.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as directory:
        env = {"PHALANX_RUN_DIR": directory, "PHALANX_STALL_WATCHER": "launcher"}  # as under `phalanx run`
        if args.interval is not None:
            env["PHALANX_STOP_INTERVAL"] = str(args.interval)
        results = run_ranks(_rank, 2, (args.models, args.blocks, args.steps, directory), timeout=3600, env=env)[0]
    for name, r in results.items():
        cost = r["inside_us"] + r["agreement_gloo_us"] / r["every"]
        print(f"{name:<6} step() on {r['on']:8.2f} ms   off {r['off']:8.2f} ms   on/off {r['on'] / r['off']:.4f};   "
              f"CPU per step {r['inside_us']:5.1f} us in step() + {r['agreement_gloo_us']:5.1f} us of Gloo's per "
              f"agreement / {r['every']} steps = {100 * cost / (1000 * r['off']):.3f} % of a step "
              f"(an agreement: {r['agreement_main_us']:.0f} us on the main thread)")
        figures.update({f"{name} on/off": round(r["on"] / r["off"], 4),
                        f"{name} CPU % of a step": round(100 * cost / (1000 * r["off"]), 3)})
    write_figures(args.json_path, figures)


if __name__ == "__main__":
    main()
