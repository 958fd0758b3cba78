"""One rank of benchmarks/hosts/xhost_bench.py, started by `phalanx run` inside a host's network namespace.

Times torch DDP, phalanx flat (PHALANX_XHOST=flat), phalanx hierarchical (PHALANX_XHOST=hier) and, when
asked for, `auto` (unset: each bucket's path by its size) on the same models and batches, in interleaved
blocks, plus compute-only (no DDP); for flat and hier it records when each gradient is ready in backward
(the cost model's input). Local rank 0 of every host reads its interface's byte counters around each
block. Before the models, the cost model's microbenchmarks: the shared-memory all-reduce on this host's
ranks and the network all-reduce of every local index at once, at a few sizes. Rank 0 writes one JSON
file."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from phalanx.shm import ShmCommunicator
from phalanx.tools.bench_block import train_step
from phalanx.tools.bench_compare import interleave
from phalanx.tools.bench_models import MODELS, make_batches
from phalanx.world import group as world
from phalanx.world.topology import HostGroups, host_topology

VARIANTS = ("torch", "flat", "hier", "compute")
CALIBRATION_MB = (0.25, 1.0, 4.0, 16.0)


def counters(dev: str) -> dict:
    base = f"/sys/class/net/{dev}/statistics"
    return {name: int(open(f"{base}/{name}").read()) for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}


def timed(fn, repeats: int) -> float:
    """Fastest seconds of fn() over `repeats` (the machine is shared: noise only adds), every rank starting
    together; the slowest rank's."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    local = torch.tensor([min(times)], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.item()


def calibrate(groups: HostGroups) -> dict:
    """Microbenchmarks: seconds per all-reduce of S bytes (the whole bucket; each local rank's network
    all-reduce carries S/L of it, all local indices at once) on this host's shared memory and the network."""
    comm = ShmCommunicator(groups.host, host=groups.topology.key)
    local = groups.topology.local_size
    out = {"shm": [], "network": []}
    for mb in CALIBRATION_MB:
        numel = int(mb * 2**20) // 4
        shared = comm.alloc(numel)
        out["shm"].append((numel * 4, timed(lambda t=shared: comm.allreduce_(t, async_op=False), 9)))
        piece = torch.ones(numel // local)
        out["network"].append((numel * 4, timed(lambda t=piece: dist.all_reduce(t, group=groups.network), 3)))
        comm.release(shared)
    comm.close()
    return out


def build_variant(name: str, bench_model, bucket_cap_mb: float):
    torch.manual_seed(0)
    module = bench_model.build()
    if name == "torch":
        model = TorchDDP(module, bucket_cap_mb=bucket_cap_mb)
    elif name in ("flat", "hier", "auto"):
        if name != "auto":  # auto: unset, each bucket flat or in two levels by its size
            os.environ["PHALANX_XHOST"] = name  # read when the model picks its exchange, alike on every rank
        model = phalanx.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        os.environ.pop("PHALANX_XHOST", None)
        expected = "AllReduceExchange" if name == "flat" else "HierarchicalExchange"
        assert type(model._reducer.exchange).__name__ == expected, type(model._reducer.exchange)
    else:
        model = module
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


class Probe:
    """When each gradient of a model is ready in backward (post-accumulate hooks), and how long the forward,
    backward and optimizer step took, per timed step: what the cost model is fed."""

    def __init__(self, model):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ready = [0.0] * len(self.params)
        self.start = 0.0
        self.steps: list[dict] = []
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: self._mark(i))

    def _mark(self, i: int) -> None:
        self.ready[i] = time.perf_counter() - self.start

    def medians(self) -> dict:
        ready = [statistics.median(column) for column in zip(*(step["ready"] for step in self.steps))]
        return {"ready": ready, **{k: statistics.median(step[k] for step in self.steps) for k in ("fwd", "bwd", "opt")}}


def timed_step(model, optimizer, batch, loss_fn, probe: Probe | None) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    inputs, target = batch
    loss = loss_fn(model(inputs), target)
    backward = time.perf_counter()
    if probe is not None:
        probe.start = backward
    loss.backward()
    step = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    if probe is not None:
        probe.steps.append({"ready": list(probe.ready), "fwd": backward - start, "bwd": step - backward,
                            "opt": end - step})
    return end - start


def run_block(model, optimizer, bench_model, batches, warmup: int, steps: int, dev: str, reader: bool, probe=None):
    world.barrier(name="xhost-block")
    for i in range(warmup):
        train_step(model, optimizer, batches[i % len(batches)], bench_model.loss)
    world.barrier(name="xhost-timed")
    before = counters(dev) if reader else None
    times = [timed_step(model, optimizer, batches[(warmup + i) % len(batches)], bench_model.loss, probe)
             for i in range(steps)]
    local = torch.tensor(times, dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)  # after the timed steps: counted, but 8 bytes a step per rank
    after = counters(dev) if reader else None
    traffic = {k: after[k] - before[k] for k in after} if reader else None
    return torch.stack(gathered).max(dim=0).values.tolist(), traffic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="wide,gpt")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="default: each DDP's own")
    parser.add_argument("--dev", required=True, help="this host's interface (its byte counters)")
    parser.add_argument("--out", required=True, help="rank 0 writes the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    phalanx.init()
    rank = dist.get_rank()
    topology = host_topology()
    groups = HostGroups(topology).build()
    reader = topology.local == 0
    result = {"hosts": len(topology.hosts), "local": topology.local_size, "world": dist.get_world_size(),
              "calibration": calibrate(groups), "models": {}}
    variants = args.variants.split(",")
    for name in args.models.split(","):
        bench_model = MODELS[name]
        batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))
        built = {variant: build_variant(variant, bench_model, args.bucket_cap_mb) for variant in variants}
        probes = {v: Probe(built[v][0]) for v in variants if v in ("flat", "hier")}
        record = {"times": {v: [] for v in variants}, "traffic": {v: [] for v in variants},
                  "grad_bytes": sum(p.numel() * p.element_size() for p in built[variants[0]][0].parameters())}

        def block(variant, built=built, bench_model=bench_model, batches=batches, probes=probes, record=record):
            model, optimizer = built[variant]
            times, traffic = run_block(model, optimizer, bench_model, batches, args.warmup, args.steps, args.dev,
                                       reader, probes.get(variant))
            record["times"][variant] += times
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, traffic)
            record["traffic"][variant].append([t for t in gathered if t is not None])

        interleave(variants, args.blocks, block)
        # The cost model's inputs, per phalanx variant, from this run (rank 0): its buckets, when each was
        # ready in backward, and the forward, backward compute and optimizer times around them.
        record["phases"] = {}
        for variant, probe in probes.items():
            model = built[variant][0]
            medians = probe.medians()
            position = {id(p): k for k, p in enumerate(probe.params)}
            buckets = [{"bytes": 4 * (b.numel + 1), "ready": max(medians["ready"][position[id(p)]] for p in b.params)}
                       for b in model._reducer.buckets]
            record["phases"][variant] = {"buckets": buckets, "backward": max(medians["ready"]),
                                         "fwd": medians["fwd"], "bwd": medians["bwd"], "opt": medians["opt"]}
        result["models"][name] = record
        del built
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    phalanx.shutdown()


if __name__ == "__main__":
    main()
