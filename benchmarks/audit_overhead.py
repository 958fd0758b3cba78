"""What the replica audit and the non-finite gradient check cost a training step: an A/B in one launch.

    PYTHONPATH=. python benchmarks/audit_overhead.py [deep wide gpt ...] [--blocks N] [--steps N] [--audits N]
                                                     [--transport shm|gloo]

Two Gloo CPU ranks (1 thread each) train phalanx DDP on a bench model (phalanx bench's step: SGD, lr 1e-3).
The non-finite check: blocks of steps alternate between the check on and off in the same model (the order
swapping each round), so the machine's drift hits both alike; it prints the median step time of the slowest
rank per setting and their ratio, and, since on a shared machine that ratio moves by more than the cost, the
cost in CPU time, which preemption by other processes does not inflate: the main thread's time in the check's
calls per step (a sum per bucket, the flags' all-reduce launched and its verdict read; the larger rank's),
plus Gloo's threads' time for one all-reduce of two numbers (measured apart). The audit: `--audits` audits run
back to back, their wall time each (the slowest rank), with an AdamW's state in them (two tensors per
parameter, so three times the parameters' bytes); its cost per step is that over DEFAULT_EVERY, over the step
time with the check off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import phalanx
from phalanx.engine.replicas.audit import DEFAULT_EVERY
from phalanx.testing import run_ranks
from phalanx.tools.bench import run_block
from phalanx.tools.bench_models import MODELS, make_batches


def _rank(rank: int, names: list[str], blocks: int, steps: int, audits: int) -> dict:
    return {name: _measure(name, rank, blocks, steps, audits) for name in names}


def _timed(obj, name: str, spent: list) -> None:
    """Add the main thread's CPU time in obj.name(...) to spent[0]."""
    plain = getattr(obj, name)

    def timed(*args, **kwargs):
        started = time.thread_time()
        try:
            return plain(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - started
    setattr(obj, name, timed)


def _measure(name: str, rank: int, blocks: int, steps: int, audits: int) -> dict:
    bench_model = MODELS[name]
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(bench_model.build(), audit_every=0)  # audits: timed apart below
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))
    check = model._audit.check
    spent = [0.0]
    for method in ("local", "exchange", "before_step"):
        _timed(check, method, spent)
    times, counted = {"on": [], "off": []}, 0
    for block in range(2 * blocks):
        setting = ("on", "off")[(block + block // 2) % 2]  # on off off on on off ...: neither always first
        model._reducer.set_check(check if setting == "on" else None)
        before = spent[0]
        times[setting] += run_block(model, optimizer, bench_model, batches, 2, steps, torch.device("cpu"))
        if setting == "on":
            counted += steps + 2
        else:
            assert spent[0] == before
    model._reducer.set_check(check)
    check_us = 1e6 * spent[0] / counted
    # The audit, with an AdamW's state besides the parameters.
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step = batches[0]
    adamw.zero_grad()
    bench_model.loss(model(train_step[0]), train_step[1]).backward()
    adamw.step()  # the audit now knows it (its post-hook) and its state exists
    model._audit.run("warm-up")
    walls = []
    for _ in range(audits):
        dist.barrier()
        started = time.perf_counter()
        model._audit.run("bench")
        walls.append(time.perf_counter() - started)
    return {**{s: statistics.median(v) for s, v in times.items()}, "check_us": check_us,
            "audit_ms": 1e3 * statistics.median(walls), **_one_all_reduce()}


def _one_all_reduce(count: int = 300) -> dict:
    """CPU time of Gloo's threads for one all-reduce of two int64 (the check's, once per step)."""
    flags = torch.zeros(2, dtype=torch.int64)
    dist.barrier()
    process, thread = time.process_time(), time.thread_time()
    for _ in range(count):
        time.sleep(0.001)
        dist.all_reduce(flags, async_op=True).wait()
    main = (time.thread_time() - thread) / count
    return {"all_reduce_gloo_us": 1e6 * ((time.process_time() - process) / count - main)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["deep", "wide", "gpt"])
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--audits", type=int, default=10, help="audits timed back to back (default 10)")
    parser.add_argument("--transport", choices=("shm", "gloo"), default="shm",
                        help="the gradient exchange: shared memory (the default on one host) or Gloo")
    args = parser.parse_args()
    env = {"PHALANX_SHM": "0"} if args.transport == "gloo" else {}
    per_rank = run_ranks(_rank, 2, (args.models, args.blocks, args.steps, args.audits), timeout=3600, env=env)
    for name in args.models:
        r0, r1 = per_rank[0][name], per_rank[1][name]
        step_ms = max(r0["off"], r1["off"])
        check = max(r0["check_us"], r1["check_us"]) + r0["all_reduce_gloo_us"]
        audit = max(r0["audit_ms"], r1["audit_ms"])
        print(f"{name:<5} {args.transport:<4} check on {r0['on']:8.2f} ms  off {r0['off']:8.2f} ms  on/off "
              f"{r0['on'] / r0['off']:.4f};  check CPU per step {check:7.1f} us = {100 * check / (1e3 * step_ms):.3f} %"
              f" of a step;  one audit {audit:7.2f} ms, every {DEFAULT_EVERY} steps = "
              f"{100 * audit / DEFAULT_EVERY / step_ms:.3f} % of a step")


if __name__ == "__main__":
    main()
