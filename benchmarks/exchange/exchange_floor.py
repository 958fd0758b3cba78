"""The floor of the shared-memory step, measured: compute-only plus the exchange's memory traffic alone.

    PYTHONPATH=. python benchmarks/exchange/exchange_floor.py [--models deep,wide] [--blocks N] [--steps N]

Two ranks (1 thread each) rotate blocks of steps between four ways of training the same model:
- compute-only: no DDP;
- floor posted, floor split: compute-only, then at the end of each backward the kernels of one of
  the exchange's two ways on all of the model's gradients as one bucket in shared memory (posted:
  the scaled copy of every gradient into this rank's slot, then the rank-order sum of both slots
  into the gradients; split: the copy of the half the peer sums, the own half summed into the
  gradients and the slot, the peer's half fetched). One kernel call per phase (its pieces listed
  afresh each step, as phalanx refreshes its addresses), no waits for the peer, no hooks (one, on
  one parameter, finds the end of backward): what moving these bytes costs, and no more. The
  peer's bytes are read while the peer may be rewriting them, so the sums are meaningless: only
  their cost counts;
- phalanx: phalanx DDP over shared memory.

Prints the median step of the slowest rank per way, and its ratio to compute-only: how far each
floor is above compute-only, and how close phalanx comes to the lower one (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
from itertools import accumulate

import torch

import phalanx
from phalanx.shm import ShmCommunicator
from phalanx.shm.reduce import (
    KERNEL_DTYPES,
    chunk_bounds,
    copy_pieces,
    kernel_serves,
    streams,
    sum_own_chunk,
    sum_pieces,
)
from phalanx.testing import run_ranks
from phalanx.tools.bench_block import run_block
from phalanx.tools.bench_compare import add_json_flag, interleave, median_of_steps, write_figures
from phalanx.tools.bench_models import MODELS, make_batches

STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
ORDER = ("compute", "floor posted", "floor split", "phalanx")
_engine = torch.autograd.Variable._execution_engine


class ExchangeTraffic:
    """The exchange's kernel calls on every gradient of `params` as one bucket in shared memory."""

    def __init__(self, params: list[torch.nn.Parameter], comm: ShmCommunicator, split: bool):
        self.params, self.rank, self.split = params, comm.rank, split
        self.dtype = params[0].dtype
        if not kernel_serves(self.dtype):
            raise SystemExit(f"the floor is measured for float32 and float64 models, not {self.dtype}")
        self.size = params[0].element_size()
        self.offsets = [0, *accumulate(p.numel() for p in params)]
        self.numel = self.offsets[-1]
        own = comm.alloc(self.numel, self.dtype)
        allocation, offset = comm._locate(own)  # every rank's slot (benchmark only: no public accessor)
        self.slots = [slot.data_ptr() for slot in comm._copies(allocation, offset, own)]
        self.stream = streams(own)
        self.bounds = chunk_bounds(self.numel, self.size, len(self.slots))
        params[0].register_post_accumulate_grad_hook(lambda _: _engine.queue_callback(self._exchange))

    def _pieces(self, lo: int, hi: int):
        """(gradient address, bucket offset in bytes, count) for the bucket's elements lo..hi."""
        for p, start in zip(self.params, self.offsets):
            a, b = max(lo, start), min(hi, start + p.numel())
            if b > a:
                yield p.grad.data_ptr() + (a - start) * self.size, a * self.size, b - a

    @torch.no_grad()
    def _exchange(self) -> None:
        own, peer = self.slots[self.rank], self.slots[1 - self.rank]
        if not self.split:  # posted: every gradient in, then both slots summed into every gradient
            pieces = list(self._pieces(0, self.numel))
            copy_pieces([v for g, at, n in pieces for v in (own + at, g, n)], self.dtype, 0.5, self.stream)
            sum_pieces(tuple(self.slots), [v for g, at, n in pieces for v in (g, at // self.size, n)], self.dtype,
                       self.stream)
            return
        others = list(self._pieces(self.bounds[1 - self.rank], self.bounds[2 - self.rank]))
        copy_pieces([v for g, at, n in others for v in (own + at, g, n)], self.dtype, 0.5, self.stream)
        for g, at, n in self._pieces(self.bounds[self.rank], self.bounds[self.rank + 1]):
            terms = tuple(slot + at for slot in self.slots)
            sum_own_chunk(g, terms[self.rank], g, terms, n, KERNEL_DTYPES[self.dtype], 0.5, self.rank, self.stream)
        copy_pieces([v for g, at, n in others for v in (g, peer + at, n)], self.dtype, None, self.stream)


def _rank(rank: int, names: list[str], blocks: int, steps: int) -> dict:
    comm = ShmCommunicator(timeout=600.0)
    results = {}
    for name in names:
        bench_model = MODELS[name]
        variants = {}
        for variant in ORDER:
            torch.manual_seed(0)
            model = bench_model.build()
            if variant.startswith("floor"):
                ExchangeTraffic([p for p in model.parameters() if p.requires_grad], comm, variant == "floor split")
            elif variant == "phalanx":
                model = phalanx.DistributedDataParallel(model)
            variants[variant] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
        batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))

        def block(variant, variants=variants, bench_model=bench_model, batches=batches):
            return run_block(*variants[variant], bench_model, batches, 2, steps, torch.device("cpu"))

        times = interleave(list(variants), blocks, block)
        results[name] = {variant: median_of_steps(values) for variant, values in times.items()}
    comm.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deep,wide", help="comma-separated (default deep,wide)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per way (default 8)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per block (default 15)")
    add_json_flag(parser)
    args = parser.parse_args()
    names = [name for name in args.models.split(",") if name]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}: choose from {sorted(MODELS)}")
    results = run_ranks(_rank, 2, (names, args.blocks, args.steps), timeout=3600, env=STEADY_MALLOC)[0]
    for name, ms in results.items():
        compute = ms["compute"]
        print(f"{name:<6} compute-only {compute:7.2f} ms   "
              + "   ".join(f"{way} {ms[way]:7.2f} ms ({ms[way] / compute:.3f})" for way in ms if way != "compute"))
    figures = {f"{name} {way}/compute": round(ms[way] / ms["compute"], 3)
               for name, ms in results.items() for way in ms if way != "compute"}
    write_figures(args.json_path, figures, medians_ms=results)


if __name__ == "__main__":
    main()
