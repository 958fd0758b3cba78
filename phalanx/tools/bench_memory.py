"""`phalanx bench --memory`: what sharding saves, and what it costs, measured three ways.

1. Model-state bytes per rank, counted exactly: every distinct byte of parameters, gradients,
   optimizer state and exchange buffers (bucket storage, staging, owned chunks), with views of the
   same memory counted once; AdamW in fp32, after a few steps, at each world size, in each shard
   mode, on an MLP of 50M parameters (buckets of 25 MB: the staging is small beside the model).
2. Peak RSS per rank (the process's high-water mark, so each variant runs in fresh processes) on the
   same model: phalanx in each mode beside torch DDP, torch DDP with ZeroRedundancyOptimizer and
   torch FSDP2 (`fully_shard(reshard_after_forward=False)`).
3. Step time, AdamW, in interleaved blocks in one launch: phalanx "none", "optimizer" and
   "gradients" and torch DDP + ZeroRedundancyOptimizer, as ratios to phalanx "none".
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..allocator import worker_preload
from ..engine.ddp import DistributedDataParallel
from ..errors import BenchConfigError, PhalanxError, explain
from ..launch.spawn import spawn
from .bench_block import run_block
from .bench_compare import interleave, median_of_steps
from .bench_models import MODELS, make_batches

MODES = ("none", "optimizer", "gradients", "parameters")
LEAN = "none+view"  # unsharded with gradient_as_bucket_view: the buckets are the gradients (16 bytes/param)
META = "phalanx-parameters+meta"  # shard="parameters" on a model built on the meta device: never whole on a rank
RSS_VARIANTS = ("torch-ddp", "torch-zero", "torch-fsdp2") + tuple(f"phalanx-{mode}" for mode in MODES) + (META,)
TIME_VARIANTS = tuple(f"phalanx-{mode}" for mode in MODES) + ("torch-zero",)
LEARNING_RATE = 1e-4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx bench --memory", description="Model-state bytes per rank in "
                                     "each shard mode, peak RSS beside torch DDP / ZeRO / FSDP2, and step times.")
    parser.add_argument("--memory", action="store_true", help="(selects this benchmark)")
    parser.add_argument("--worlds", default="2,4", help="world sizes for the byte count (default 2,4)")
    parser.add_argument("--width", type=int, default=2048, help="width of the MLP counted and measured: "
                        "12 x Linear(w, w), 50.4M parameters at 2048 (default)")
    parser.add_argument("--rss-worlds", default="2,4", help="world sizes for the peak RSS (default 2,4)")
    parser.add_argument("--rss-variants", default=",".join(RSS_VARIANTS), help="variants for the peak RSS (default "
                        "all: " + ", ".join(RSS_VARIANTS) + "); torch-ddp and phalanx-none are the ratios' bases")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket size of phalanx DDP in the byte "
                        "count and peak RSS (default 25, as torch's)")
    parser.add_argument("--time-models", default="wide,gpt", help="models for the step times (default wide,gpt)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block (default 10)")
    parser.add_argument("--blocks", type=int, default=3, help="interleaved blocks per variant (default 3)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: count,rss,time")
    parser.add_argument("--out", default="bench-results/memory.json", help="JSON results file")
    return parser


# -- 1. model-state bytes ---------------------------------------------------------------------------

def _distinct_bytes(tensors) -> int:
    """Bytes of memory the tensors cover, each byte once (views and shared storage are not counted twice)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    total, end = 0, 0
    for start, stop in spans:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # Imported here: at the module's top it put DTensor (and sympy, ~40 MB) in every RSS rank, torch DDP's too,
    # where only the FSDP2 variants import it themselves.
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def model_state_bytes(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> dict:
    """Parameters, gradients, optimizer state and exchange buffers of this rank, in bytes. At the FSDP2
    level ("parameters") the exchange column is the largest block FSDP2 all-gathers whole at a time."""
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    state = [_local(v) for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    unsharded = 0
    if model._reducer is None:  # FSDP2: no buckets; a block's whole parameters exist while it runs
        buffers = []
        units = list(model.blocks) + [model.module]
        in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
        sizes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in model.blocks]
        sizes.append(sum(p.numel() * p.element_size() for p in model.module.parameters() if id(p) not in in_blocks))
        unsharded = max(sizes) if units else 0
    else:
        exchange = model._reducer.exchange
        grads += [piece.tensor.grad for shard in getattr(exchange, "shards", []) for piece in shard.pieces
                  if piece.tensor.grad is not None]
        buffers = [b.storage for b in model._reducer.buckets if b.storage is not None] + exchange.buffers()
    parts = {"parameters": params, "gradients": grads, "optimizer": state, "exchange": buffers}
    counted = {name: _distinct_bytes(tensors) for name, tensors in parts.items()}
    counted["exchange"] += unsharded
    counted["total"] = _distinct_bytes([t for tensors in parts.values() for t in tensors]) + unsharded
    return counted


def _count_rank(rank: int, width: int, bucket_cap_mb: float) -> dict:
    counts = {}
    for mode in (LEAN,) + MODES:
        torch.manual_seed(0)
        model = DistributedDataParallel(mlp(width), shard=mode if mode != LEAN else "none",
                                        gradient_as_bucket_view=mode == LEAN, bucket_cap_mb=bucket_cap_mb)
        optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
        _train(model, optimizer, width, rank)
        counts[mode] = model_state_bytes(model, optimizer)  # after a step: what a rank holds between steps
        del model, optimizer
    return counts


# -- 2. peak RSS ----------------------------------------------------------------------------------

def mlp(width: int) -> nn.Module:
    return nn.Sequential(*[layer for _ in range(12) for layer in (nn.Linear(width, width), nn.ReLU())])


def _train(model, optimizer, width: int, rank: int, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        inputs = torch.randn(16, width, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        model(inputs).pow(2).mean().backward()
        optimizer.step()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _rss_rank(rank: int, variant: str, width: int, bucket_cap_mb: float) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    baseline = _peak_rss_mb()  # torch imported, the group up: what every variant starts from
    torch.manual_seed(0)
    if variant == META:
        with torch.device("meta"):
            module = mlp(width)
        variant = "phalanx-parameters"
    else:
        module = mlp(width)
    if variant == "torch-ddp":
        model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    elif variant == "torch-zero":
        model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE)
    elif variant == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        model = fully_shard(module, mesh=mesh, reshard_after_forward=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    else:
        model = DistributedDataParallel(module, shard=variant.split("-", 1)[1], bucket_cap_mb=bucket_cap_mb)
        optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    _train(model, optimizer, width, rank)
    return {"peak_mb": _peak_rss_mb(), "baseline_mb": baseline}


# -- 3. step time -----------------------------------------------------------------------------------

def _build_timed(variant: str, bench_model):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    module = bench_model.build()
    if variant == "torch-zero":
        model = nn.parallel.DistributedDataParallel(module)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE)
    model = DistributedDataParallel(module, shard=variant.split("-", 1)[1])
    return model, model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))


def _time_rank(rank: int, names: list[str], steps: int, blocks: int) -> dict:
    results = {}
    for name in names:
        bench_model = MODELS[name]
        batches = make_batches(bench_model, 4, 0, rank, torch.device("cpu"))
        built = {variant: _build_timed(variant, bench_model) for variant in TIME_VARIANTS}

        def block(variant, built=built, bench_model=bench_model, batches=batches):
            return run_block(*built[variant], bench_model, batches, 2, steps, torch.device("cpu"))

        times = interleave(TIME_VARIANTS, blocks, block)
        # each entry is already the slowest rank's time for that step: a synchronous step is that slow
        results[name] = {variant: median_of_steps(values) for variant, values in times.items()}
        del built
    return results


# -- running and reporting --------------------------------------------------------------------------

def _env() -> dict:
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PHALANX_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": ""}


def _say(text: str) -> None:
    print(f"[bench --memory] {text}", flush=True)


def run(args) -> dict:
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    results: dict = {"params": 12 * (args.width * args.width + args.width)}
    if "count" not in skip:
        results["count"] = {}
        for world_size in [int(w) for w in args.worlds.split(",")]:
            _say(f"counting model-state bytes on {world_size} ranks, modes {', '.join(MODES)}")
            # Bytes are counted, not measured: ranks forked from a server that imported torch once do (peak RSS,
            # below, needs fresh processes).
            per_rank = spawn(_count_rank, world_size, args=(args.width, args.bucket_cap_mb), env=_env(), timeout=1800,
                             start_method="forkserver")
            results["count"][world_size] = per_rank
    if "rss" not in skip:
        results["rss"] = {}
        params = results["params"]
        for world_size in [int(w) for w in args.rss_worlds.split(",")]:
            results["rss"][world_size] = {}
            for variant in args.rss_variants:
                _say(f"peak RSS of {variant} on {world_size} ranks ({params / 1e6:.1f}M parameters, AdamW), in fresh "
                     "processes")
                results["rss"][world_size][variant] = spawn(_rss_rank, world_size,
                                                            args=(variant, args.width, args.bucket_cap_mb),
                                                            env=_env(), timeout=1800)
    if "time" not in skip:
        names = [n.strip() for n in args.time_models.split(",") if n.strip()]
        _say(f"step times of {', '.join(names)} on 2 ranks x 1 thread, AdamW, {args.blocks} interleaved blocks "
             f"x {args.steps} steps")
        results["time"] = spawn(_time_rank, 2, args=(names, args.steps, args.blocks), env=_env(), timeout=3600,
                                start_method="forkserver")[0]
    return results


def format_report(results: dict) -> str:
    lines = []
    for world_size, per_rank in results.get("count", {}).items():
        lines.append(f"\nmodel-state bytes per rank, {world_size} ranks, {results['params'] / 1e6:.1f}M parameters, "
                     "AdamW fp32 (MB, the largest rank; ratio to shard='none')")
        lines.append(f"{'mode':<10} {'params':>8} {'grads':>8} {'optim':>8} {'exchange':>9} {'total':>8} {'ratio':>6} "
                     f"{'to ' + LEAN:>13}")
        worst = {mode: max(rank[mode]["total"] for rank in per_rank) for mode in per_rank[0]}
        for mode in per_rank[0]:
            rank = max(per_rank, key=lambda r: r[mode]["total"])[mode]
            lines.append(f"{mode:<10} {rank['parameters'] / 1e6:8.2f} {rank['gradients'] / 1e6:8.2f} "
                         f"{rank['optimizer'] / 1e6:8.2f} {rank['exchange'] / 1e6:9.2f} {rank['total'] / 1e6:8.2f} "
                         f"{worst[mode] / worst['none']:6.3f} {worst[mode] / worst[LEAN]:13.3f}")
    for world_size, variants in results.get("rss", {}).items():
        preload = worker_preload()
        allocator = Path(preload.split()[0]).name if preload else "the system's malloc"
        lines.append(f"\npeak RSS per rank, {world_size} ranks, {results['params'] / 1e6:.1f}M parameters, AdamW (MB; "
                     f"the largest rank; above: minus the RSS after start-up; allocator: {allocator})")
        peaks = {variant: max(r["peak_mb"] for r in per_rank) for variant, per_rank in variants.items()}
        for variant, per_rank in variants.items():
            above = max(r["peak_mb"] - r["baseline_mb"] for r in per_rank)
            ratios = "".join(f"   / {base} {peaks[variant] / peaks[base]:6.3f}"
                             for base in ("torch-ddp", "phalanx-none") if base in peaks)
            lines.append(f"{variant:<24} peak {peaks[variant]:8.1f}   above start-up {above:8.1f}{ratios}")
    for name, medians in results.get("time", {}).items():
        base = medians["phalanx-none"]
        lines.append(f"\nstep time, {name}, 2 ranks (median of the slowest rank; ratio to phalanx none)")
        for variant, value in medians.items():
            lines.append(f"{variant:<18} {value:8.2f} ms   {value / base:6.3f}")
    return "\n".join(lines)


def headline(results: dict) -> dict:
    """The figures a reader compares first: each shard level's model-state bytes and peak RSS against "none",
    at the smallest world measured, and each level's step time against "none"."""
    figures = {}
    for world_size, per_rank in sorted(results.get("count", {}).items())[:1]:
        worst = {mode: max(rank[mode]["total"] for rank in per_rank) for mode in per_rank[0]}
        figures.update({f"bytes {mode}/none @{world_size}": round(worst[mode] / worst["none"], 3)
                        for mode in MODES[1:] if mode in worst})
    for world_size, variants in sorted(results.get("rss", {}).items())[:1]:
        peaks = {variant: max(r["peak_mb"] for r in per_rank) for variant, per_rank in variants.items()}
        if "phalanx-none" in peaks:
            figures.update({f"RSS {variant.removeprefix('phalanx-')}/none @{world_size}":
                            round(peak / peaks["phalanx-none"], 3) for variant, peak in peaks.items()
                            if variant.startswith("phalanx-") and variant != "phalanx-none"})
    for name, medians in results.get("time", {}).items():
        base = medians["phalanx-none"]
        figures.update({f"{name} step {variant.removeprefix('phalanx-')}/none": round(value / base, 3)
                        for variant, value in medians.items() if variant != "phalanx-none"})
    return figures


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.rss_variants = [v.strip() for v in args.rss_variants.split(",") if v.strip()]
        unknown = [v for v in args.rss_variants if v not in RSS_VARIANTS]
        if unknown:
            raise BenchConfigError(explain("--rss-variants names a variant bench --memory does not know",
                                           seen=unknown, expected=" | ".join(RSS_VARIANTS)))
        if args.steps < 1 or args.blocks < 1:
            raise BenchConfigError(explain("--steps and --blocks must be positive",
                                           seen=(args.steps, args.blocks), expected=">= 1"))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    except BenchConfigError as exc:
        print(f"phalanx bench: {exc}", flush=True)
        return 2
    try:
        results = run(args)
    except PhalanxError as exc:
        print(f"phalanx bench --memory: {exc}", flush=True)
        return 1
    print(format_report(results), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**results, "figures": headline(results)}, indent=1, default=str))
    print(f"\nresults: {out}", flush=True)
    return 0
