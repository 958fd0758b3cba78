"""Quick step-time comparison of phalanx DDP and torch DDP on 2 Gloo CPU ranks (1 thread each).

    PYTHONPATH=. python benchmarks/exchange/ddp_quick_compare.py [wide|deep ...] [--blocks N] [--steps N]

Interleaves blocks of steps (torch, phalanx, compute-only; phalanx/tools/bench_compare.py) so machine noise
hits all alike and prints median step times and ratios. `phalanx bench` is the full benchmark; this is a dev tool.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import phalanx
from phalanx.testing import run_ranks
from phalanx.tools.bench_compare import add_json_flag, interleave, paired_ratio, write_figures


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "wide":
        layers = []
        for _ in range(8):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)
    if name == "deep":
        layers = []
        for _ in range(60):
            layers += [torch.nn.Linear(128, 128), torch.nn.LayerNorm(128), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers)
    raise ValueError(name)


def worker(rank: int, name: str, blocks: int, steps: int, kwargs: dict) -> dict:
    width = 1024 if name == "wide" else 128
    x = torch.randn(64, width)
    models = {
        "torch": torch.nn.parallel.DistributedDataParallel(build(name), **kwargs),
        "phalanx": phalanx.DistributedDataParallel(build(name), **kwargs),
        "compute": build(name),
    }
    optims = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(k):
        optims[k].zero_grad()
        models[k](x).square().mean().backward()
        optims[k].step()

    for k in models:  # warm-up (and bucket rebuild)
        for _ in range(3):
            step(k)

    def block(k):  # (wall, CPU) seconds per step; CPU: all this process's threads, robust to a busy machine
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step(k)
        return (time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps

    blocks = interleave(list(models), blocks, block)
    times = {k: [wall for wall, _ in v] for k, v in blocks.items()}
    medians = {k: statistics.median(v) for k, v in times.items()}
    # Per-round ratios: a block of torch and the neighbouring block of phalanx share the machine's mood.
    medians["ratio"] = paired_ratio(times["phalanx"], times["torch"])
    medians.update({f"cpu_{k}": statistics.median(cpu for _, cpu in v) for k, v in blocks.items()})
    return medians


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["wide", "deep"])
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--as-view", action="store_true")
    add_json_flag(parser)
    args = parser.parse_args()
    figures = {}
    kwargs = {"gradient_as_bucket_view": True} if args.as_view else {}
    for name in args.models:
        results = run_ranks(worker, 2, (name, args.blocks, args.steps, kwargs), timeout=900)
        med = {k: max(r[k] for r in results) for k in results[0]}
        print(f"{name:5s} torch {med['torch'] * 1e3:7.2f} ms  phalanx {med['phalanx'] * 1e3:7.2f} ms  "
              f"compute {med['compute'] * 1e3:7.2f} ms  phalanx/torch {med['phalanx'] / med['torch']:.3f} "
              f"(median of per-block ratios {med['ratio']:.3f})  "
              f"phalanx/compute {med['phalanx'] / med['compute']:.3f}", flush=True)
        print(f"      cpu/step: torch {med['cpu_torch'] * 1e3:7.2f} ms  phalanx {med['cpu_phalanx'] * 1e3:7.2f} ms  "
              f"compute {med['cpu_compute'] * 1e3:7.2f} ms  phalanx/torch {med['cpu_phalanx'] / med['cpu_torch']:.3f}",
              flush=True)
        figures.update({f"{name} phalanx/torch": round(med["phalanx"] / med["torch"], 3),
                        f"{name} phalanx/compute": round(med["phalanx"] / med["compute"], 3)})
    write_figures(args.json_path, figures)


if __name__ == "__main__":
    main()
