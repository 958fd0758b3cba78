"""What the record of collectives (phalanx/diagnose/) costs a training step: an A/B in one launch.

    PYTHONPATH=. python benchmarks/diagnostics/record_overhead.py [deep wide ...] [--blocks N] [--steps N]

Two Gloo CPU ranks (1 thread each) train phalanx DDP; blocks of steps interleave recording on
and recording off (the ring detached for the block), so the machine's drift hits both alike. Prints
the median step time of the slowest rank per setting and their ratio.
"""

from __future__ import annotations

import argparse

import torch

import phalanx
from phalanx.diagnose import recorder
from phalanx.testing import run_ranks
from phalanx.tools.bench_block import run_block
from phalanx.tools.bench_compare import add_json_flag, interleave, median_of_steps, write_figures
from phalanx.tools.bench_models import MODELS, make_batches


def _rank(rank: int, names: list[str], blocks: int, steps: int) -> dict:
    assert recorder.active(), "the record is off (PHALANX_RECORD=0?): nothing to compare"
    results = {}
    for name in names:
        bench_model = MODELS[name]
        torch.manual_seed(0)
        model = phalanx.DistributedDataParallel(bench_model.build())
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))
        ring = recorder._ring

        def block(setting, model=model, optimizer=optimizer, bench_model=bench_model, batches=batches, ring=ring):
            recorder._ring = ring if setting == "on" else None
            return run_block(model, optimizer, bench_model, batches, 2, steps, torch.device("cpu"))

        times = interleave(["on", "off"], blocks, block)
        recorder._ring = ring
        results[name] = {setting: median_of_steps(values) for setting, values in times.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["deep", "wide"])
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting (default 10)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per block (default 15)")
    add_json_flag(parser)
    args = parser.parse_args()
    results = run_ranks(_rank, 2, (args.models, args.blocks, args.steps), timeout=3600)[0]
    for name, medians in results.items():
        print(f"{name:<6} recording on {medians['on']:8.2f} ms   off {medians['off']:8.2f} ms   "
              f"on/off {medians['on'] / medians['off']:.4f}")
    write_figures(args.json_path, {f"{name} on/off": round(m["on"] / m["off"], 4) for name, m in results.items()},
                  medians_ms=results)


if __name__ == "__main__":
    main()
