"""What live recovery costs a healthy training step: the per-step commit and the watched waits, an A/B.

    PYTHONPATH=. python benchmarks/live_recovery/live_recovery_overhead.py [deep wide gpt ...] [--blocks N] [--steps N]
        [--transport shm|gloo] [--shard gradients|optimizer] [--ranks N] [--per-host L]

Two CPU ranks (`--ranks`; 1 thread each) train phalanx DDP on `phalanx bench`'s models, over the shared-memory exchange
or Gloo's (`--transport`). With `--per-host L`, hosts of L ranks are emulated (tests/helpers/emulated_hosts.py): the
commit's ranks agree per host and one per host goes to the store (world/generations/host_board.py); `--per-host 1` is
a commit per rank. The commit's store operations per rank and step are counted (a follower's 2 reads that map its
host's board, once per generation, left out). Blocks of steps interleave live recovery on (PHALANX_MIN_WORLD_SIZE=1:
every wait on a collective watches for a step given up, and each step commits after its exchange where a global-batch
step does: not over shared memory, whose exchange ends alike on every rank; a host's ranks agree in shared memory, a
leader per host goes to the store when the generation spans hosts) and off, so the
machine's drift hits both alike. Prints the median step time of the slowest rank per setting and their ratio;
and, since on a shared machine that ratio moves by more than the cost measured, the commit's own cost: its
wall time per step on the main thread (store round trips, which a busy machine stretches too) and its CPU time,
against the step time. Those include the wait for the other rank to finish its exchange, which a step pays
without the commit too (at its next collective); so also the commit's own delay to the step, on its critical
path: per step, from the moment the last rank enters the commit to the moment the last one leaves it (both
ranks read the same monotonic clock).

With `--shard`, the model is sharded (AdamW; two ShardedOptimizers over the same model, one made with live recovery
on, whose steps also snapshot this rank's chunk, refresh its copy on the other rank and commit a second time:
sharding/shard_copies/); the copies' own time (the snapshot and the refresh) is printed besides, with the
memory they hold.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import phalanx
from phalanx.testing import run_ranks
from phalanx.tools.bench_block import run_block
from phalanx.tools.bench_compare import add_json_flag, interleave, median_of_steps, write_figures
from phalanx.tools.bench_models import MODELS, make_batches
from phalanx.world import generation
from phalanx.world import group as world
from tests.helpers.emulated_hosts import emulate_host


def _rank(rank: int, names: list[str], blocks: int, steps: int, shard: str, per_host: int) -> dict:
    emulate_host(rank, per_host)  # before this rank says who it is
    return {name: _measure(name, rank, blocks, steps, shard) for name in names}


class _CountingStore:
    """The store, its operations counted (the commit's only: it is handed in around the commit)."""

    def __init__(self, store):
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops += 1
            return method(*args, **kwargs)
        return counted


def _timed(record: list, method):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - started)
    return timed


def _measure(name: str, rank: int, blocks: int, steps: int, shard: str) -> dict:
    bench_model = MODELS[name]
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(bench_model.build(), shard=shard)
    copies_wall: list[float] = []
    copies_bytes = 0
    if shard == "none":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        live_optimizer = optimizer
    else:
        os.environ[generation.MIN_WORLD_ENV] = "1"
        live_optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        os.environ.pop(generation.MIN_WORLD_ENV, None)
        optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        copies = live_optimizer._copies
        copies.before_step = _timed(copies_wall, copies.before_step)  # the snapshot
        copies._start_refresh = _timed(copies_wall, copies._start_refresh)  # packing, the transfers started
        copies._finish_refresh = _timed(copies_wall, copies._finish_refresh)  # their end, after the all-gather's
    batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))
    generation.announce()
    generation.current().watch(world.store()).board()  # a follower maps its host's board: once per generation
    generation.say_mode(True, "a benchmark's loop")  # as a global-batch loader says it: the copies are made
    wall: list[float] = []
    cpu: list[float] = []
    spans: list[tuple[float, float]] = []  # each commit's entry and exit, on the machine's monotonic clock
    live_step = live_optimizer.step
    store = world.store
    counting = _CountingStore(store())

    def commit_then_step(*args, **kwargs):
        started, started_cpu = time.monotonic(), time.thread_time()
        world.store = lambda: counting
        try:
            if not model._steps_settle_alike() and not generation.commit_step():  # as a global-batch step does
                raise RuntimeError("a healthy step did not commit")
        finally:
            world.store = store
        spans.append((started, time.monotonic()))
        wall.append(spans[-1][1] - started)
        cpu.append(time.thread_time() - started_cpu)
        return live_step(*args, **kwargs)

    def block(setting):
        if setting == "on":
            os.environ[generation.MIN_WORLD_ENV] = "1"
            live_optimizer.step = commit_then_step
            return run_block(model, live_optimizer, bench_model, batches, 2, steps, torch.device("cpu"))
        os.environ.pop(generation.MIN_WORLD_ENV, None)
        return run_block(model, optimizer, bench_model, batches, 2, steps, torch.device("cpu"))

    times = interleave(["on", "off"], blocks, block)
    os.environ.pop(generation.MIN_WORLD_ENV, None)
    live_optimizer.step = live_step
    if shard != "none":
        held = [t for packed in live_optimizer._copies.copies.values() for t in packed.tensors()]
        copies_bytes = sum(t.numel() * t.element_size() for t in held)
    return {**{s: median_of_steps(v) for s, v in times.items()}, "commit_ms": 1e3 * statistics.median(wall),
            "commit_cpu_ms": 1e3 * statistics.median(cpu), "spans": spans, "store_ops": counting.ops / len(wall),
            "copies_ms": 1e3 * sum(copies_wall) / len(wall) if copies_wall else 0.0,  # per step, on average
            "copies_mb": copies_bytes / 1e6,
            "model_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["deep", "wide", "gpt"])
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--transport", choices=("shm", "gloo"), default="shm",
                        help="the exchange: shared memory (phalanx's default on one host: its steps end alike on "
                             "every rank, no commit) or Gloo's all-reduce (PHALANX_SHM=0: a commit per step)")
    parser.add_argument("--shard", choices=("none", "optimizer", "gradients"), default="none",
                        help="shard the model (AdamW): the shard copies' cost besides the commits")
    parser.add_argument("--ranks", type=int, default=2, help="ranks on this machine (default 2)")
    parser.add_argument("--per-host", type=int, default=0,
                        help="emulated ranks per host for the commit (default: all on one host)")
    add_json_flag(parser)
    args = parser.parse_args()
    figures = {}
    env = {"PHALANX_SHM": "1" if args.transport == "shm" else "0"}
    per_host = args.per_host or args.ranks
    ranks = run_ranks(_rank, args.ranks, (args.models, args.blocks, args.steps, args.shard, per_host), timeout=3600,
                      env=env)
    results = ranks[0]
    for name, r in results.items():
        steps = zip(*(rank[name]["spans"] for rank in ranks))  # the same commits, in order, on every rank
        delay = statistics.median(max(end for _, end in step) - max(start for start, _ in step) for step in steps)
        print(f"{name:<6} {args.transport:<4} step: on {r['on']:8.2f} ms   off {r['off']:8.2f} ms   "
              f"on/off {r['on'] / r['off']:.4f};   commit per step: {r['commit_ms']:.3f} ms wall "
              f"({100 * r['commit_ms'] / r['off']:.2f} % of a step), {r['commit_cpu_ms']:.3f} ms CPU "
              f"({100 * r['commit_cpu_ms'] / r['off']:.2f} %); its delay to the step: {1e3 * delay:.3f} ms "
              f"({100e3 * delay / r['off']:.2f} %); the store: "
              f"{statistics.mean(rank[name]['store_ops'] for rank in ranks):.2f} ops per rank and step "
              f"({args.ranks // per_host} host(s) of {per_host})")
        figures.update({f"{name} on/off": round(r["on"] / r["off"], 3),
                        f"{name} commit % of a step": round(100 * r["commit_ms"] / r["off"], 2),
                        f"{name} delay % of a step": round(100e3 * delay / r["off"], 2),
                        f"{name} store ops / rank / step": round(
                            statistics.mean(rank[name]["store_ops"] for rank in ranks), 2)})
        if args.shard != "none":
            print(f"{'':<6} shard={args.shard}: copies {r['copies_ms']:.3f} ms per step "
                  f"({100 * r['copies_ms'] / r['off']:.2f} % of a step), holding {r['copies_mb']:.1f} MB per rank "
                  f"(the model: {r['model_mb']:.1f} MB)")
            figures[f"{name} copies % of a step"] = round(100 * r["copies_ms"] / r["off"], 1)
    write_figures(args.json_path, figures)


if __name__ == "__main__":
    main()
