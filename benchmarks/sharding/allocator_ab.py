"""The workers' C allocator, glibc's malloc against tcmalloc and mimalloc (phalanx/allocator/): step times.

    PYTHONPATH=. python benchmarks/sharding/allocator_ab.py [--models wide,gpt,mlp50] [--rounds 2] [--steps 10]
        [--allocators system,tcmalloc,mimalloc]

An allocator is chosen when a process starts, so they cannot share a launch: each round launches every
allocator once (the order rotating from round to round: phalanx/tools/bench_compare.py), each launch
training every shard level of `phalanx bench --memory`'s step times in interleaved blocks. The allocator's
effect is each one's step over glibc's ("system") in the same round, per level, so drift between rounds hits
every setting alike.
`mlp50` is bench --memory's 50M-parameter MLP.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from phalanx.launch.spawn import spawn
from phalanx.tools import bench_memory
from phalanx.tools.bench_compare import add_json_flag, interleave, write_figures
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
    parser.add_argument("--allocators", default="system,tcmalloc,mimalloc", help="PHALANX_ALLOCATOR values; "
                        "the first is the baseline")
    add_json_flag(parser)
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    allocators = [a for a in args.allocators.split(",") if a]

    def launch(allocator: str) -> dict:
        print(f"launching {allocator}", flush=True)
        return _launch(allocator, names, args.steps, args.blocks)

    runs = interleave(allocators, args.rounds, launch)  # a launch per allocator and round, the order rotating
    base, others = allocators[0], allocators[1:]
    figures = {}
    for name in names:
        print(f"\n{name}: median step ms (slowest rank) per allocator, and each / {base} per round")
        for variant in runs[base][0][name]:
            steps = {a: [run[name][variant] for run in runs[a]] for a in allocators}
            medians = " ".join(f"{a} {statistics.median(steps[a]):8.1f}" for a in allocators)
            ratios = "   ".join(f"{a}/{base} " + " ".join(f"{o / b:.3f}" for b, o in zip(steps[base], steps[a]))
                               for a in others)
            print(f"  {variant:<20} {medians}   {ratios}")
            figures.update({f"{name} {variant.removeprefix('phalanx-')} {a}/{base}":
                            round(statistics.median(steps[a]) / statistics.median(steps[base]), 3) for a in others})
    write_figures(args.json_path, figures, runs=runs)


if __name__ == "__main__":
    main()
