"""What the replica audit and the non-finite gradient check cost a training step: an A/B in one launch.

    PYTHONPATH=. python benchmarks/diagnostics/audit_overhead.py [deep wide gpt ...] [--blocks N] [--steps N]
        [--audits N] [--transport shm|gloo] [--device cuda]

Two Gloo CPU ranks (1 thread each) train phalanx DDP on a bench model (phalanx bench's step: SGD, lr 1e-3).
The non-finite check: blocks of steps alternate between the check on and off in the same model (the order
swapping each round), so the machine's drift hits both alike; it prints the median step time of the slowest
rank per setting and their ratio, and, since on a shared machine that ratio moves by more than the cost, the
cost in CPU time, which preemption by other processes does not inflate: the main thread's time in the check's
calls per step (each bucket's verdict handed over or a sum where the copy cannot check, the flags' all-reduce
launched where one is needed, the verdict read; the larger rank's), plus, where the check needs that
all-reduce (not where the verdict rides with the exchange: in the buckets' tags, in the shared-memory stamps),
Gloo's threads' time for one all-reduce of two numbers (measured apart). Not in it: the copy kernel's finite
test on the way, and a stamp's store and loads. The audit: `--audits` audits run
back to back, their wall time each (the slowest rank), with an AdamW's state in them (two tensors per
parameter, so three times the parameters' bytes); its cost per step is that over DEFAULT_EVERY, over the step
time with the check off.

With `--device cuda`: one rank on the GPU (NCCL), default model gpt-large; a block's steps are queued and the
GPU synchronized once at its end, so the check's wait for the backward (its verdict is read before the
optimizer steps) shows; the audit's fingerprints of the parameters and AdamW's state are timed (a world of
one gathers nothing).
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
from phalanx.tools.bench_block import run_block, train_step
from phalanx.tools.bench_compare import add_json_flag, interleave, median_of_steps, write_figures
from phalanx.tools.bench_models import MODELS, make_batches


def _rank(rank: int, names: list[str], blocks: int, steps: int, audits: int, device: str = "cpu") -> dict:
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return {name: _measure(name, rank, blocks, steps, audits, torch.device(device, rank) if device == "cuda"
                           else torch.device("cpu")) for name in names}


def _queued_block(model, optimizer, bench_model, batches, steps: int, device) -> list[float]:
    """On a GPU: `steps` steps queued, one synchronization at the end; ms per step, as a one-element list."""
    for i in range(2):
        train_step(model, optimizer, batches[i % len(batches)], bench_model.loss)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for i in range(steps):
        train_step(model, optimizer, batches[i % len(batches)], bench_model.loss)
    torch.cuda.synchronize(device)
    return [(time.perf_counter() - started) * 1e3 / steps]


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


def _measure(name: str, rank: int, blocks: int, steps: int, audits: int, device: torch.device) -> dict:
    bench_model = MODELS[name]
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(bench_model.build().to(device), audit_every=0)  # audits: apart below
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = make_batches(bench_model, 4, 0, rank, device)
    check = model._audit.check
    spent = [0.0]
    for method in ("local", "seen", "folds", "finite_here", "folded", "exchange", "before_step"):  # every call into it
        _timed(check, method, spent)
    counted = 0

    def block(setting):  # on off, off on, ...: neither always first
        nonlocal counted
        model._reducer.set_check(check if setting == "on" else None)
        before = spent[0]
        if device.type == "cuda":
            times = _queued_block(model, optimizer, bench_model, batches, steps, device)
        else:
            times = run_block(model, optimizer, bench_model, batches, 2, steps, device)
        if setting == "on":
            counted += steps + 2
        else:  # a late verdict of the block before may be read in this one's first step
            spent[0] = before
        return times

    times = interleave(["on", "off"], blocks, block)
    model._reducer.set_check(check)
    check_us = 1e6 * spent[0] / counted
    # Whether the verdict takes an all-reduce of its own (the split shared-memory exchange), or rides in the
    # buckets' summed tags (Gloo's all-reduce): one backward, its verdict looked at, no step.
    optimizer.zero_grad()
    bench_model.loss(model(batches[0][0]), batches[0][1]).backward()
    flags_all_reduce = check._verdicts[-1].work is not None
    optimizer.zero_grad()
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
        if device.type == "cuda":  # a world of one gathers nothing: its fingerprints, read back
            model._audit._row(model).tolist()
        else:
            model._audit.run("bench")
        walls.append(time.perf_counter() - started)
    return {**{s: median_of_steps(v) for s, v in times.items()}, "check_us": check_us,
            "audit_ms": 1e3 * statistics.median(walls),
            **(_one_all_reduce() if device.type == "cpu" and flags_all_reduce else {"all_reduce_gloo_us": 0.0})}


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
    parser.add_argument("models", nargs="*", help="bench models (default deep wide gpt; gpt-large with --device cuda)")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--audits", type=int, default=10, help="audits timed back to back (default 10)")
    parser.add_argument("--transport", choices=("shm", "gloo"), default="shm",
                        help="the gradient exchange: shared memory (the default on one host) or Gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (2 Gloo ranks) or cuda (1 rank)")
    add_json_flag(parser)
    args = parser.parse_args()
    figures = {}
    args.models = args.models or (["gpt-large"] if args.device == "cuda" else ["deep", "wide", "gpt"])
    if args.device == "cuda":
        per_rank = phalanx.spawn(_rank, 1, (args.models, args.blocks, args.steps, args.audits, "cuda"), timeout=3600,
                                 env={"PHALANX_BACKEND": "nccl"})
        per_rank = per_rank * 2  # the one rank stands for both columns below
    else:
        env = {"PHALANX_SHM": "0"} if args.transport == "gloo" else {}
        per_rank = run_ranks(_rank, 2, (args.models, args.blocks, args.steps, args.audits), timeout=3600, env=env)
    for name in args.models:
        r0, r1 = per_rank[0][name], per_rank[1][name]
        step_ms = max(r0["off"], r1["off"])
        check = max(r0["check_us"], r1["check_us"]) + r0["all_reduce_gloo_us"]
        audit = max(r0["audit_ms"], r1["audit_ms"])
        where = args.device if args.device == "cuda" else args.transport
        print(f"{name:<5} {where:<4} check on {r0['on']:8.2f} ms  off {r0['off']:8.2f} ms  on/off "
              f"{r0['on'] / r0['off']:.4f};  check CPU per step {check:7.1f} us = {100 * check / (1e3 * step_ms):.3f} %"
              f" of a step;  one audit {audit:7.2f} ms, every {DEFAULT_EVERY} steps = "
              f"{100 * audit / DEFAULT_EVERY / step_ms:.3f} % of a step")
        figures.update({f"{name} check % of a step": round(100 * check / (1e3 * step_ms), 3),
                        f"{name} audit ms": round(audit, 2)})
    write_figures(args.json_path, figures)


if __name__ == "__main__":
    main()
