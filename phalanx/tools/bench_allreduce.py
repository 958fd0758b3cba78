"""All-reduce bandwidth: shared memory vs the process group (Gloo), measured in one run.

Each repeat times every variant back to back, so a noisy neighbour slows them alike and the
ratios stay meaningful; each all-reduce gets a freshly written tensor, as DDP's buckets are. The
time of one all-reduce is the slowest rank's (a MAX over ranks).

    python -m phalanx.tools.bench_allreduce --nproc 2          # spawns the ranks itself
    phalanx run --nproc-per-node 2 -m phalanx.tools.bench_allreduce
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..shm.communicator import ShmCommunicator

VARIANTS = ("gloo", "shm", "shm_alloc")


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def allreduce_bandwidth(sizes_mb=(1, 4, 25, 34), repeats: int = 20, warmup: int = 3, process_group=None,
                        comm: ShmCommunicator | None = None) -> list[dict]:
    """Collective: median time and bandwidth of averaging fp32 tensors of `sizes_mb` MB, per variant.

    Variants: `gloo` (process group all_reduce, then divide, as torch DDP does), `shm` (shared
    memory, the tensor copied in and out), `shm_alloc` (shared memory, the tensor from `alloc()`).
    Bandwidth is size / time (what nccl-tests calls algbw); `speedup*` = Gloo time / shm time.

    >>> phalanx.init(); rows = allreduce_bandwidth((25,), repeats=10)   # doctest: +SKIP
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    own_comm = comm is None
    comm = comm or ShmCommunicator(group, threaded=False)
    rows = []
    for size_mb in sizes_mb:
        numel = int(size_mb * 2**20) // 4
        gradients = torch.randn(numel)
        private = torch.empty(numel)
        shared = comm.alloc(numel)
        tensors = {"gloo": private, "shm": private, "shm_alloc": shared}
        runs = {
            "gloo": lambda private=private: (dist.all_reduce(private, group=group), private.div_(world)),
            "shm": lambda private=private: comm.allreduce_(private, async_op=False),
            "shm_alloc": lambda shared=shared: comm.allreduce_(shared, async_op=False),
        }
        times = torch.zeros(len(VARIANTS), repeats)
        for step in range(warmup + repeats):
            for index, name in enumerate(VARIANTS):
                tensors[name].copy_(gradients)  # as DDP fills a bucket right before it is all-reduced
                dist.barrier(group=group)
                elapsed = _timed(runs[name])
                if step >= warmup:
                    times[index, step - warmup] = elapsed
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        row = {"size_mb": size_mb, "ranks": world}
        for index, name in enumerate(VARIANTS):
            median = statistics.median(times[index].tolist())
            row[f"{name}_ms"] = median * 1e3
            row[f"{name}_best_ms"] = min(times[index].tolist()) * 1e3  # what a quiet moment allows
            row[f"{name}_gbps"] = numel * 4 / median / 1e9
        row["speedup"] = row["gloo_ms"] / row["shm_ms"]
        row["speedup_alloc"] = row["gloo_ms"] / row["shm_alloc_ms"]
        rows.append(row)
        del shared
    if own_comm:
        comm.close()
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain-text table of `allreduce_bandwidth` rows."""
    lines = [f"all-reduce (average) of fp32, {rows[0]['ranks']} ranks on one host; median of the slowest rank "
             f"(best in parentheses)",
             f"{'MB':>6} {'gloo ms':>15} {'shm ms':>15} {'alloc ms':>15} {'gloo GB/s':>10} {'shm GB/s':>9} "
             f"{'alloc GB/s':>11} {'shm/gloo':>9} {'alloc/gloo':>11}"]
    for row in rows:
        times = " ".join(f"{row[f'{name}_ms']:>7.2f} ({row[f'{name}_best_ms']:>5.2f})" for name in VARIANTS)
        lines.append(f"{row['size_mb']:>6g} {times} {row['gloo_gbps']:>10.2f} {row['shm_gbps']:>9.2f} "
                     f"{row['shm_alloc_gbps']:>11.2f} {row['speedup']:>8.1f}x {row['speedup_alloc']:>10.1f}x")
    return "\n".join(lines)


def _run_in_world(rank: int, sizes_mb, repeats: int):
    rows = allreduce_bandwidth(sizes_mb, repeats=repeats)
    return rows if rank == 0 else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m phalanx.tools.bench_allreduce",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by a launcher")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 25, 34], help="tensor sizes in MB")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats per size and variant")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # started by phalanx run / torchrun / srun: we are one rank of the world
        from ..world import group as world

        world.init()
        rows = _run_in_world(world.rank(), args.sizes, args.repeats)
        if rows:
            print(format_rows(rows), flush=True)
        world.shutdown()
        return
    from ..launch.spawn import spawn

    rows = spawn(_run_in_world, args.nproc, (args.sizes, args.repeats),
                 env={"OMP_NUM_THREADS": "1", "PHALANX_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": ""})[0]
    print(format_rows(rows), flush=True)


if __name__ == "__main__":
    main()
