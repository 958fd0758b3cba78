"""Each choice of the shared-memory exchange, measured against its alternative in one launch.

    PYTHONPATH=. python benchmarks/exchange/exchange_choices.py CHOICE [--models wide,deep] [--blocks N] [--steps N]

Two ranks (1 thread each) train phalanx DDP over shared memory; blocks of steps rotate between the
choice's settings and compute-only (the same model without DDP), so the machine's drift hits every
setting alike. Prints, per model, the median step time of the slowest rank per setting and its
ratio to compute-only. The choices (what docs/benchmarks.md reports, "Choices of the exchange"):

- stream: results written with streaming stores ("on"), or through the cache ("off"), whatever
  the bucket's size (phalanx streams buckets of STREAM_MIN_BYTES and more).

Each setting trains a model of its own, built with the setting in force (some are read then).
The ranks run with glibc's malloc keeping freed memory (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_):
otherwise whether a step's gradients land in fresh pages (thousands of page faults, several ms)
depends on what ran before, and that noise is larger than the differences measured here.
"""

from __future__ import annotations

import argparse

import torch

import phalanx
from phalanx.shm import reduce
from phalanx.testing import run_ranks
from phalanx.tools.bench_block import run_block
from phalanx.tools.bench_compare import add_json_flag, interleave, median_of_steps, write_figures
from phalanx.tools.bench_models import MODELS, make_batches

NEVER = 1 << 62
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


# choice -> (module, constant, {setting: value})
CHOICES = {
    "stream": (reduce, "STREAM_MIN_BYTES", {"on": 0, "off": NEVER}),
}


def _rank(rank: int, choice: str, names: list[str], blocks: int, steps: int) -> dict:
    module, constant, values = CHOICES[choice]
    default = getattr(module, constant)

    def setting(value):
        return lambda: setattr(module, constant, value)

    results = {}
    for name in names:
        bench_model = MODELS[name]
        torch.manual_seed(0)
        plain = bench_model.build()
        variants = {"compute": (plain, torch.optim.SGD(plain.parameters(), lr=1e-3), setting(default))}
        for label, value in values.items():
            setting(value)()
            torch.manual_seed(0)
            model = phalanx.DistributedDataParallel(bench_model.build())
            variants[label] = (model, torch.optim.SGD(model.parameters(), lr=1e-3), setting(value))
        batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))

        def block(variant, variants=variants, bench_model=bench_model, batches=batches):
            trained, opt, apply = variants[variant]
            apply()
            return run_block(trained, opt, bench_model, batches, 2, steps, torch.device("cpu"))

        times = interleave(list(variants), blocks, block)
        setattr(module, constant, default)
        results[name] = {variant: median_of_steps(values) for variant, values in times.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("choice", choices=sorted(CHOICES))
    parser.add_argument("--models", default="wide,deep", help="comma-separated (default wide,deep)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per setting (default 8)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per block (default 15)")
    add_json_flag(parser)
    args = parser.parse_args()
    names = [name for name in args.models.split(",") if name]
    results = run_ranks(_rank, 2, (args.choice, names, args.blocks, args.steps), timeout=3600, env=STEADY_MALLOC)[0]
    for name, medians in results.items():
        compute = medians["compute"]
        shown = "   ".join(f"{args.choice}={setting} {ms:7.2f} ms ({ms / compute:.3f})"
                           for setting, ms in medians.items() if setting != "compute")
        print(f"{name:<6} compute-only {compute:7.2f} ms   {shown}")
    write_figures(args.json_path, {f"{name} {args.choice}={setting}/compute": round(ms / medians["compute"], 3)
                                   for name, medians in results.items() for setting, ms in medians.items()
                                   if setting != "compute"}, medians_ms=results)


if __name__ == "__main__":
    main()
