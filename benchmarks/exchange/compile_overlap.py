"""Overlap and step time of phalanx DDP under torch.compile, on 2 Gloo CPU ranks (1 thread each).

    PYTHONPATH=. python benchmarks/exchange/compile_overlap.py [deep gpt wide] [--blocks N] [--steps N]
        [--backend inductor] [--bucket-cap-mb MB] [--variants eager ddp(compile) ...]

Variants (each trains its own copy of the model, on the same 4 batches cycled):
  eager          phalanx.DDP(net)
  ddp(compile)   phalanx.DDP(torch.compile(net))
  compile(ddp)   torch.compile(phalanx.DDP(net))
  per-block      each block (GPT) or layer (MLPs) compiled on its own, then phalanx.DDP(net)
  torch          torch.compile(torch.nn.parallel.DistributedDataParallel(net)) (Dynamo's DDPOptimizer)

Overlap, for the phalanx variants, from wrapping `model._reducer.exchange.launch` and
`model._reducer._finalize` here (the library has no timing of its own). Per step, the backward's
compute lasts from the call of `loss.backward()` to the start of `_finalize` (the autograd callback
that ends backward, where the exchange delivers); a bucket launched at time t has the fraction
(finalize - t) / (finalize - start) of it still ahead, to hide its exchange behind (0 if launched
by `_finalize` itself). Reported, as medians over the timed steps:
  overlapped     share of the buckets (and of the gradient bytes) launched with >= 10 % of the
                 backward remaining (the burst at the end of a compiled backward launches everything
                 "before the end", within the last few per cent: that is no overlap);
  ahead          bytes-weighted mean of the remaining fraction at launch (no threshold);
  tail ms        time from the start of `_finalize` to its end: the exchange left exposed.
Step times are interleaved in blocks (the order rotating; phalanx/tools/bench_compare.py) and reported as medians of
the per-block mean step time of the slowest rank, with the median and range of per-block ratios
against `torch`, and the CPU time per step (both ranks' mean; robust to a busy machine). "compile s"
is the warm-up: 4 steps, compilation included (inductor's on-disk cache shortens reruns). A dev tool,
not the benchmark (`phalanx bench`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import phalanx
from phalanx.testing import run_ranks
from phalanx.tools.bench_compare import add_json_flag, interleave, write_figures
from phalanx.tools.bench_models import MODELS, make_batches

VARIANTS = ("eager", "ddp(compile)", "compile(ddp)", "per-block", "torch")
OVERLAP_THRESHOLD = 0.10  # a bucket launched with less of the backward ahead of it counts as not overlapped


def compile_per_block(net: torch.nn.Module, backend: str) -> None:
    """Compile each block on its own: the GPT's transformer blocks in place (`block.compile()`, keys
    unchanged); the flat MLPs have no block class, so each layer that holds parameters, replaced by
    `torch.compile(layer)` (`layer.compile()` would compile nothing: Dynamo skips torch.nn's own frames)."""
    if hasattr(net, "blocks"):
        for block in net.blocks:
            block.compile(backend=backend)
        return
    for index, layer in enumerate(net):
        if any(True for _ in layer.parameters()):
            net[index] = torch.compile(layer, backend=backend)


def build(variant: str, name: str, backend: str, cap) -> tuple[torch.nn.Module, object]:
    """(the model to call, the phalanx DDP inside it or None)."""
    torch.manual_seed(0)
    net = MODELS[name].build()
    if variant == "torch":
        return torch.compile(torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap), backend=backend), None
    if variant == "ddp(compile)":
        net = torch.compile(net, backend=backend)
    elif variant == "per-block":
        compile_per_block(net, backend)
    ddp = phalanx.DistributedDataParallel(net, bucket_cap_mb=cap)
    if variant == "compile(ddp)":
        return torch.compile(ddp, backend=backend), ddp
    return ddp, ddp


class LaunchClock:
    """Times each bucket launch and the end of backward of one phalanx DDP (wraps, in this process only)."""

    def __init__(self, ddp):
        self.reducer = reducer = ddp._reducer
        self.launches: list[tuple[float, int]] = []
        self.finalize = self.finalize_end = 0.0
        launch, finalize = reducer.exchange.launch, reducer._finalize

        def timed_launch(bucket):
            self.launches.append((time.perf_counter(), bucket.numel * bucket.storage.element_size()
                                  if bucket.storage is not None else 0))
            return launch(bucket)

        def timed_finalize():
            self.finalize = time.perf_counter()
            try:
                return finalize()
            finally:
                self.finalize_end = time.perf_counter()

        reducer.exchange.launch = timed_launch
        reducer._finalize = timed_finalize  # looked up when the first hook of a backward queues it

    def step(self, start: float) -> tuple[float, float, float, float]:
        """(overlapped bucket share, overlapped byte share, bytes-weighted fraction ahead, tail seconds) of the
        backward begun at `start`."""
        duration = self.finalize - start
        ahead = [(max(0.0, (self.finalize - t) / duration), nbytes) for t, nbytes in self.launches]
        total = sum(nbytes for _, nbytes in ahead) or 1
        self.launches.clear()
        return (sum(r >= OVERLAP_THRESHOLD for r, _ in ahead) / len(ahead),
                sum(n for r, n in ahead if r >= OVERLAP_THRESHOLD) / total, sum(r * n for r, n in ahead) / total,
                self.finalize_end - self.finalize)


def worker(rank: int, name: str, variants: list[str], blocks: int, steps: int, backend: str, cap) -> dict:
    spec = MODELS[name]
    batches = make_batches(spec, 4, seed=0, rank=rank, device=torch.device("cpu"))
    models, clocks, optims, compile_s = {}, {}, {}, {}
    for variant in variants:
        models[variant], ddp = build(variant, name, backend, cap)
        optims[variant] = torch.optim.SGD(models[variant].parameters(), lr=1e-3)
        if ddp is not None:  # before the first forward: compile(ddp) guards on what the forward reads
            clocks[variant] = LaunchClock(ddp)
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}  # CPU seconds of this process's threads: robust to a busy machine
    overlap = {v: [] for v in variants}
    counter = [0]

    def step(v, record):
        x, y = batches[counter[0] % len(batches)]
        counter[0] += 1
        optims[v].zero_grad()
        loss = spec.loss(models[v](x), y)
        start = time.perf_counter()
        loss.backward()
        if v in clocks:
            measured = clocks[v].step(start)
            if record:
                overlap[v].append(measured)
        optims[v].step()

    for v in variants:  # warm-up: compilation, the bucket rebuild, recompiles after it
        dist.barrier()
        start = time.perf_counter()
        for _ in range(4):
            step(v, False)
        compile_s[v] = time.perf_counter() - start

    def block(v):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step(v, True)
        times[v].append((time.perf_counter() - start) / steps)
        cpu[v].append((time.process_time() - start_cpu) / steps)

    interleave(variants, blocks, block)
    buckets = {v: len(clocks[v].reducer.buckets) for v in clocks}
    return {"times": times, "cpu": cpu, "overlap": overlap, "compile_s": compile_s, "buckets": buckets}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["deep", "gpt"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="default: torch's (25, first 1 MiB)")
    add_json_flag(parser)
    args = parser.parse_args()
    figures = {}
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no compile worker pool on a 2-core machine
    for name in args.models:
        results = run_ranks(worker, 2, (name, args.variants, args.blocks, args.steps, args.backend,
                                        args.bucket_cap_mb), timeout=3000, env=env)
        # The slowest rank's block time: a step ends for everyone when the last rank is done.
        times = {v: [max(r["times"][v][b] for r in results) for b in range(args.blocks)] for v in args.variants}
        cpu = {v: [sum(r["cpu"][v][b] for r in results) / 2 for b in range(args.blocks)] for v in args.variants}
        print(f"{name} ({MODELS[name].description}), {args.blocks} blocks x {args.steps} steps, backend "
              f"{args.backend}, bucket_cap_mb {args.bucket_cap_mb}", flush=True)
        print(f"  {'variant':13s} {'step ms':>8s} {'/torch':>6s} {'per block [range]':>19s} {'cpu ms':>7s} "
              f"{'/torch':>6s} {'compile s':>9s} {'buckets':>7s} {'overlapped':>10s} {'(bytes)':>7s} {'ahead':>5s} "
              f"{'tail ms':>7s}")
        for v in args.variants:
            row = f"  {v:13s} {statistics.median(times[v]) * 1e3:8.2f} {_ratio(times, v, statistics.median)}"
            per_block = [a / b for a, b in zip(times[v], times["torch"])] if "torch" in times else [1.0]
            row += f" {statistics.median(per_block):6.3f} [{min(per_block):.2f}, {max(per_block):.2f}]"
            row += f" {statistics.median(cpu[v]) * 1e3:7.2f} {_ratio(cpu, v, statistics.median)}"
            row += f" {max(r['compile_s'][v] for r in results):9.1f}"
            if v in results[0]["buckets"]:
                counted, shares, ahead, tails = zip(*[s for r in results for s in r["overlap"][v]])  # both ranks
                row += (f" {results[0]['buckets'][v]:7d} {statistics.median(counted) * 100:9.0f}% "
                        f"{statistics.median(shares) * 100:6.0f}% {statistics.median(ahead):5.2f} "
                        f"{statistics.median(tails) * 1e3:7.2f}")
            print(row, flush=True)
            if "torch" in times and v != "torch":
                figures[f"{name} {v}/torch"] = round(statistics.median(per_block), 3)
    write_figures(args.json_path, figures)


def _ratio(values: dict, variant: str, summary) -> str:
    return f"{summary(values[variant]) / summary(values['torch']):6.3f}" if "torch" in values else " " * 6

if __name__ == "__main__":
    main()
