"""The workers' C allocator, glibc's malloc against tcmalloc (phalanx/launch/allocator.py): step times.

    PYTHONPATH=. python benchmarks/allocator_ab.py [--models wide,gpt,mlp50] [--rounds 2] [--steps 10]

An allocator is chosen when a process starts, so the two cannot share a launch: launches alternate
(system, tcmalloc, system, tcmalloc, ...), each training every shard level of `phalanx bench
--memory`'s step times in interleaved blocks. Per launch the levels are timed as ratios to phalanx
"none"; across launches the allocator's effect is the median of tcmalloc / system per level, so
drift between launches hits both settings alike. `mlp50` is bench --memory's 50M-parameter MLP.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from phalanx.launch.spawn import spawn
from phalanx.tools import bench_memory
from phalanx.tools.bench_models import MODELS, BenchModel, _classification_loss, _regression_batch

MODELS.setdefault("mlp50", BenchModel("mlp50", "12 x Linear(2048, 2048): bench --memory's MLP", 16,
                                      lambda: bench_memory.mlp(2048), _regression_batch(2048, 2048),
                                      _classification_loss))


def _launch(allocator: str, names: list[str], steps: int, blocks: int) -> dict:
    env = {**bench_memory._env(), "PHALANX_ALLOCATOR": allocator}
    return spawn(_timed, 2, args=(names, steps, blocks), env=env, timeout=3600)[0]


def _timed(rank: int, names: list[str], steps: int, blocks: int) -> dict:
    MODELS.setdefault("mlp50", BenchModel("mlp50", "", 16, lambda: bench_memory.mlp(2048),
                                          _regression_batch(2048, 2048), _classification_loss))
    torch.set_num_threads(1)
    return bench_memory._time_rank(rank, names, steps, blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="wide,gpt,mlp50")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    runs: dict[str, list] = {"system": [], "tcmalloc": []}
    for round_ in range(args.rounds):
        for allocator in ("system", "tcmalloc"):
            print(f"round {round_ + 1}/{args.rounds}: {allocator}", flush=True)
            runs[allocator].append(_launch(allocator, names, args.steps, args.blocks))
    for name in names:
        print(f"\n{name}: median step ms (slowest rank), system / tcmalloc, and tcmalloc / system per round")
        for variant in runs["system"][0][name]:
            system = [run[name][variant] for run in runs["system"]]
            tcmalloc = [run[name][variant] for run in runs["tcmalloc"]]
            ratios = [t / s for s, t in zip(system, tcmalloc)]
            print(f"  {variant:<20} {statistics.median(system):8.1f} {statistics.median(tcmalloc):8.1f}   "
                  f"{' '.join(f'{r:.3f}' for r in ratios)}   median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
