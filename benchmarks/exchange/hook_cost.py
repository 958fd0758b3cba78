"""What a Python post-accumulate-grad hook per parameter costs a step, without any DDP.

    PYTHONPATH=. python benchmarks/exchange/hook_cost.py [deep|wide|gpt]

One process, one thread: the bench model trains with SGD, in alternating blocks without hooks and
with one no-op hook per parameter (what phalanx's reducer registers); prints the medians.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from phalanx.tools.bench_models import MODELS, make_batches


def main(name: str = "deep", rounds: int = 6, steps: int = 30) -> None:
    torch.set_num_threads(1)
    model = MODELS[name]
    torch.manual_seed(0)
    net = model.build()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    batches = make_batches(model, 4, 0, 0, torch.device("cpu"))

    def block(count: int) -> float:
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

    results: dict[str, list[float]] = {"without hooks": [], "with hooks": []}
    for _ in range(rounds):
        for setting in results:
            handles = [p.register_post_accumulate_grad_hook(marker(i)) for i, p in enumerate(net.parameters())] \
                if setting == "with hooks" else []
            block(5)
            results[setting].append(block(steps))
            for handle in handles:
                handle.remove()
    for setting, values in results.items():
        print(f"{name}: {setting:<14} {statistics.median(values):8.3f} ms per step")


if __name__ == "__main__":
    main(*sys.argv[1:2])
