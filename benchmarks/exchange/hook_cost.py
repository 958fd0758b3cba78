"""What a Python post-accumulate-grad hook per parameter costs a step, without any DDP.

    PYTHONPATH=. python benchmarks/exchange/hook_cost.py [deep|wide|gpt] [--rounds N] [--steps N]

One process, one thread: the bench model trains with SGD, in interleaved blocks (phalanx/tools/bench_compare.py)
without hooks and with one no-op hook per parameter (what phalanx's reducer registers); prints the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from phalanx.tools.bench_compare import add_json_flag, interleave, write_figures
from phalanx.tools.bench_models import MODELS, make_batches


def measure(name: str = "deep", rounds: int = 6, steps: int = 30) -> dict[str, float]:
    """Median ms per step without hooks and with one hook per parameter."""
    torch.set_num_threads(1)
    model = MODELS[name]
    torch.manual_seed(0)
    net = model.build()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    batches = make_batches(model, 4, 0, 0, torch.device("cpu"))

    def timed(count: int) -> float:
        times = []
        for i in range(count):
            inputs, target = batches[i % len(batches)]
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model.loss(net(inputs), target).backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    ready = bytearray(sum(1 for _ in net.parameters()))

    def marker(index: int):
        def hook(_param):
            ready[index] = 1
        return hook

    def block(setting: str) -> float:
        handles = [p.register_post_accumulate_grad_hook(marker(i)) for i, p in enumerate(net.parameters())] \
            if setting == "with hooks" else []
        timed(5)  # warm-up
        median = timed(steps)
        for handle in handles:
            handle.remove()
        return median

    results = interleave(["without hooks", "with hooks"], rounds, block)
    return {setting: statistics.median(values) for setting, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="deep", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=6, help="blocks per setting (default 6)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per block (default 30)")
    add_json_flag(parser)
    args = parser.parse_args()
    medians = measure(args.model, args.rounds, args.steps)
    for setting, ms in medians.items():
        print(f"{args.model}: {setting:<14} {ms:8.3f} ms per step")
    write_figures(args.json_path, {f"{args.model} with/without hooks":
                                   round(medians["with hooks"] / medians["without hooks"], 3)}, medians_ms=medians)


if __name__ == "__main__":
    main()
