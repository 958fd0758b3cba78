"""`phalanx bench`: torch DDP vs phalanx DDP vs compute-only, timed in one launch on the same data.

Variants run in interleaved blocks (A B C, B C A, ...), each a warm-up then timed steps, so slow
drift of a shared machine hits every variant alike; the headline is the median step time of the
slowest rank, and every comparison is a ratio measured in the same run (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import BenchConfigError, PhalanxError, explain
from ..launch.spawn import spawn
from ..log import print0
from ..world import group as world
from .bench_block import run_block, train_step
from .bench_compare import interleave, summarize
from .bench_models import MODELS, count_parameters, make_batches
from .bench_profile import format_profile, maybe_profile, write_profile_chart
from .bench_report import (
    SCHEMA,
    VARIANT_LABELS,
    environment,
    format_table,
    paired_ratios,
    ratios,
    write_chart,
    write_json,
)

# "phalanx" is phalanx DDP as a user gets it (shared memory between ranks on one host);
# "phalanx-gloo" is the same engine with the transport off, against torch's reducer on equal terms.
VARIANTS = ("torch", "phalanx", "phalanx-gloo", "compute")
ALLREDUCE_SIZES_MB = (1, 4, 25, 34)
BATCHES_PER_RANK = 4  # a few distinct batches, cycled: real data movement without a data loader
LEARNING_RATE = 1e-3


@dataclass
class BenchConfig:
    models: list[str]
    variants: list[str]
    steps: int
    blocks: int
    warmup: int
    nproc: int
    threads: int
    device: str
    bucket_cap_mb: float
    allreduce: bool
    allreduce_sizes_mb: list[float]
    seed: int
    out: str
    timeout: float
    profile: bool = False
    argv: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx bench", description="Time torch DDP, phalanx DDP and the model without DDP (compute-only) "
        "in interleaved blocks, in one launch, and report median step times and their ratios.")
    parser.add_argument("--models", help=f"comma-separated, from {','.join(MODELS)} "
                        "(default: wide,deep,gpt on cpu, gpt-large on cuda)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of torch,phalanx,compute (default: all)")
    parser.add_argument("--steps", type=int, help="timed steps per block (default 20; 3 with --quick)")
    parser.add_argument("--blocks", type=int, help="interleaved blocks per variant (default 5; 2 with --quick)")
    parser.add_argument("--warmup", type=int,
                        help="untimed steps at the start of each block (default 3; 1 with --quick)")
    parser.add_argument("--nproc", type=int, help="processes to launch (default 2 on cpu, 1 on cuda); "
                        "ignored when already inside a world, e.g. under `phalanx run`")
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads per process (default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu runs Gloo, cuda runs NCCL")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket size for both DDPs (default 25)")
    parser.add_argument("--allreduce", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure all-reduce bandwidth, shared memory vs Gloo (cpu only; default on)")
    parser.add_argument("--out", default="bench-results/bench.json", help="JSON results file; the chart goes "
                        "next to it as .png (default bench-results/bench.json)")
    parser.add_argument("--quick", action="store_true", help="tiny step counts, for smoke tests")
    parser.add_argument("--memory", action="store_true", help="instead: what sharding saves and costs (model-state "
                        "bytes, peak RSS beside torch DDP / ZeRO / FSDP2, step times); see --memory --help")
    parser.add_argument("--suite", choices=("cpu", "gpu", "all"), help="instead: run every benchmark scenario of "
                        "benchmarks/ at a size for this machine, into one summary; see --suite cpu --help")
    parser.add_argument("--overhead", action="store_true", help="instead: the host time per step phalanx DDP and "
                        "torch DDP add to a model of many tiny tensors, at world size 1; see --overhead --help")
    parser.add_argument("--profile", action="store_true", help="then one more phalanx block with its exchange "
                        "timed by phase: copy in, reduce, wait, copy out, rest (per rank and bucket)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before ranks still running are "
                        "stopped and named (default 3600)")
    return parser


def _names(raw: str, allowed, what: str) -> list[str]:
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise BenchConfigError(explain(f"unknown {what}", seen=", ".join(unknown) or "an empty list",
                                       expected=f"a comma-separated subset of {','.join(allowed)}"))
    return names


def parse_config(argv: list[str]) -> BenchConfig:
    """Parse and check the command line (raises BenchConfigError on a request this host cannot run)."""
    args = build_parser().parse_args(argv)
    cuda = args.device == "cuda"
    models = _names(args.models or ("gpt-large" if cuda else "wide,deep,gpt"), MODELS, "model")
    variants = _names(args.variants, VARIANTS, "variant")
    variants = [v for v in VARIANTS if v in variants]  # a fixed column order in every report
    quick = args.quick
    config = BenchConfig(
        models=models, variants=variants,
        steps=args.steps if args.steps is not None else (3 if quick else 20),
        blocks=args.blocks if args.blocks is not None else (2 if quick else 5),
        warmup=args.warmup if args.warmup is not None else (1 if quick else 3),
        nproc=args.nproc if args.nproc is not None else (1 if cuda else 2),
        threads=args.threads, device=args.device, bucket_cap_mb=args.bucket_cap_mb,
        allreduce=args.allreduce and not cuda, allreduce_sizes_mb=[1] if quick else list(ALLREDUCE_SIZES_MB),
        seed=args.seed, out=args.out, timeout=args.timeout, profile=args.profile, argv=list(argv))
    for name in ("steps", "blocks", "nproc", "threads"):
        if getattr(config, name) < 1:
            raise BenchConfigError(explain(f"--{name} must be positive", seen=getattr(config, name), expected=">= 1"))
    if config.warmup < 0:
        raise BenchConfigError(explain("--warmup must not be negative", seen=config.warmup, expected=">= 0"))
    _check_device(config)
    _check_phalanx_ddp(config)
    return config


def _check_device(config: BenchConfig) -> None:
    if config.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise BenchConfigError(explain(
            "--device cuda needs a CUDA GPU", seen=f"torch {torch.__version__} reports no usable GPU "
            f"(torch.cuda.is_available() is False; CUDA build: {torch.version.cuda or 'none'})",
            expected="a visible CUDA device and a CUDA build of torch",
            fix="Run on a GPU machine with a CUDA build of torch, or drop --device cuda for the CPU benchmark."))
    if config.nproc > torch.cuda.device_count():
        raise BenchConfigError(explain(
            "more processes than GPUs", seen=f"--nproc {config.nproc} with {torch.cuda.device_count()} GPU(s)",
            expected=f"--nproc <= {torch.cuda.device_count()}", fix="One process per GPU: lower --nproc."))


def _check_phalanx_ddp(config: BenchConfig) -> None:
    if {"phalanx", "phalanx-gloo"} & set(config.variants) and _phalanx_ddp() is None:
        raise BenchConfigError(explain(
            "phalanx.DistributedDataParallel is not available in this install",
            seen="no attribute DistributedDataParallel on the phalanx package", expected="the phalanx DDP engine",
            fix="Install a phalanx with the DDP engine, or time the others alone: --variants torch,compute."))


def _phalanx_ddp():
    import phalanx  # looked up at call time, so the engine in use is whatever the package exports

    return getattr(phalanx, "DistributedDataParallel", None)


def load_allreduce_bandwidth():
    """`bench_allreduce.allreduce_bandwidth`, or None when that module is missing (any other failure raises)."""
    try:
        module = importlib.import_module("phalanx.tools.bench_allreduce")
    except ModuleNotFoundError as exc:
        if exc.name == "phalanx.tools.bench_allreduce":
            return None
        raise
    return module.allreduce_bandwidth


# -- what runs on every rank ----------------------------------------------------------------------

def _build_variant(variant: str, bench_model, config: BenchConfig, device: torch.device):
    torch.manual_seed(config.seed)  # the same initial weights for every variant
    module = bench_model.build().to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    if variant == "torch":
        module = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids,
                                                          bucket_cap_mb=config.bucket_cap_mb)
    elif variant in ("phalanx", "phalanx-gloo"):
        saved = os.environ.get("PHALANX_SHM")
        if variant == "phalanx-gloo":
            os.environ["PHALANX_SHM"] = "0"  # read at construction, by every rank alike
        try:
            module = _phalanx_ddp()(module, device_ids=device_ids, bucket_cap_mb=config.bucket_cap_mb)
        finally:
            if saved is None:
                os.environ.pop("PHALANX_SHM", None)
            else:
                os.environ["PHALANX_SHM"] = saved
    return module, torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)


def _bench_model(name: str, config: BenchConfig, device: torch.device) -> dict:
    bench_model = MODELS[name]
    built = {variant: _build_variant(variant, bench_model, config, device) for variant in config.variants}
    raw = built[config.variants[0]][0]
    params, tensors = count_parameters(getattr(raw, "module", raw))
    print0(f"[bench] {name}: {bench_model.description}; {params / 1e6:.2f}M parameters in {tensors} "
                 f"tensors, batch {bench_model.batch} per rank")
    batches = make_batches(bench_model, BATCHES_PER_RANK, config.seed, dist.get_rank(), device)

    def block(variant: str) -> list[float]:
        module, optimizer = built[variant]
        return run_block(module, optimizer, bench_model, batches, config.warmup, config.steps, device)

    def said(round_: int, variant: str, times: list[float]) -> None:
        print0(f"[bench] {name} block {round_ + 1}/{config.blocks} {VARIANT_LABELS[variant]:<13} "
               f"median {statistics.median(times):8.2f} ms")

    blocks = interleave(config.variants, config.blocks, block, after=said)
    variants = {variant: summarize(blocks[variant]) for variant in config.variants}
    profile = maybe_profile(built, train_step, bench_model, batches, config.warmup, config.steps) \
        if config.profile else None
    built.clear()  # free this model's copies (and DDP buffers) before the next model
    return {"name": name, "description": bench_model.description, "params": params, "tensors": tensors,
            "batch_per_rank": bench_model.batch, "variants": variants, "ratios": ratios(variants),
            "paired_ratios": paired_ratios(variants), **({"profile": profile} if profile else {})}


def _allreduce_section(config: BenchConfig) -> dict:
    if not config.allreduce:
        reason = "cuda run" if config.device == "cuda" else "--no-allreduce"
        return {"status": "skipped", "reason": reason}
    bandwidth = load_allreduce_bandwidth()
    if bandwidth is None:
        print0("[bench] all-reduce bandwidth: the shared-memory transport is not installed "
                     "(no phalanx.tools.bench_allreduce)")
        return {"status": "not installed"}
    print0(f"[bench] all-reduce bandwidth at {config.allreduce_sizes_mb} MB")
    # Collective: every rank of the benchmark's world calls it; rank 0's rows are reported.
    rows = bandwidth(tuple(config.allreduce_sizes_mb))
    return {"status": "ok", "sizes_mb": list(config.allreduce_sizes_mb), "rows": rows}


def run_rank(rank: int, config: BenchConfig) -> dict | None:
    """The whole benchmark on one rank of an initialized world; rank 0 returns the results."""
    device = world.device()
    if device.type != config.device:
        raise BenchConfigError(explain(
            "the world's device is not the one asked for", rank=rank, seen=f"{device} (backend "
            f"{dist.get_backend()})", expected=config.device, fix=f"Run with --device {device.type}, or start the "
            "world on the other device."))
    if device.type == "cpu":
        torch.set_num_threads(config.threads)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True  # what GPU training runs with; compute stays the floor
        torch.backends.cudnn.allow_tf32 = True
    allreduce = _allreduce_section(config)
    models = [_bench_model(name, config, device) for name in config.models]
    if rank != 0:
        return None
    summary = {**asdict(config), "nproc": dist.get_world_size(), "backend": dist.get_backend()}
    return {"schema": SCHEMA, "environment": environment(device), "config": summary, "models": models,
            "allreduce": allreduce, "figures": headline(models, allreduce)}


def headline(models: list[dict], allreduce: dict) -> dict:
    """The figures a reader compares first: phalanx against torch DDP and compute-only, per model; the
    largest all-reduce's speed-up of shared memory over Gloo."""
    figures = {f"{model['name']} {name}": round(model["ratios"][name], 3) for model in models
               for name in ("phalanx/torch", "phalanx/compute") if name in model["ratios"]}
    rows = allreduce.get("rows") if allreduce.get("status") == "ok" else None
    if rows and isinstance(rows[-1], dict) and "speedup_alloc" in rows[-1]:
        figures[f"all-reduce {rows[-1]['size_mb']:g} MB gloo/shm"] = round(rows[-1]["speedup_alloc"], 1)
    return figures


def _run_in_world(config: BenchConfig) -> dict | None:
    joined_here = not world.is_initialized()
    world.init(device=config.device)
    try:
        return run_rank(world.rank(), config)
    finally:
        if joined_here:  # leave a world the caller made (e.g. a test harness) as it was
            world.shutdown()


def _rank_env(config: BenchConfig) -> dict:
    env = {"OMP_NUM_THREADS": str(config.threads), "MKL_NUM_THREADS": str(config.threads)}
    if config.device == "cpu":
        env.update(PHALANX_BACKEND="gloo", CUDA_VISIBLE_DEVICES="")
    else:
        env.update(PHALANX_BACKEND="nccl")
    return env


def _inside_world() -> bool:
    """True under `phalanx run`, torchrun or srun-with-env, or when the caller already made a group."""
    return world.is_initialized() or dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def report(results: dict, out: Path) -> None:
    """Print the table and write the JSON and (with matplotlib) the PNG chart."""
    print(format_table(results), flush=True)
    json_path = write_json(results, out)
    if any("profile" in model for model in results["models"]):
        print(format_profile(results["models"]), flush=True)
        write_profile_chart(results["models"], out.with_name(out.stem + "-profile.png"))
    chart = write_chart(results, out.with_suffix(".png"))
    print(f"\nresults: {json_path}" + (f"\nchart:   {chart}" if chart else "\nchart:   skipped (matplotlib "
                                                                       "is not installed)"), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `phalanx bench` and `python -m phalanx.tools.bench`; returns the exit status.

    >>> from phalanx.tools.bench import main                                   # doctest: +SKIP
    >>> main(["--quick", "--models", "deep", "--out", "/tmp/bench.json"])
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--suite" in argv:  # every benchmark scenario, one after the other, into one summary
        from .bench_suite import main as suite_main

        return suite_main(argv)
    if "--memory" in argv:  # what sharding saves and costs: a benchmark of its own, imported when asked for
        from .bench_memory import main as memory_main

        return memory_main(argv)
    if "--overhead" in argv:  # the host work each DDP adds, at world size 1: a benchmark of its own
        from .bench_overhead import main as overhead_main

        return overhead_main(argv)
    try:
        config = parse_config(argv)
    except SystemExit as exc:  # argparse: --help, or a malformed flag (its message is already printed)
        return exc.code if isinstance(exc.code, int) else 2
    except BenchConfigError as exc:
        print(f"phalanx bench: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        if _inside_world():
            results = _run_in_world(config)
        else:
            print(f"[bench] launching {config.nproc} process(es) x {config.threads} thread(s) on {config.device}: "
                  f"models {','.join(config.models)}, variants {','.join(config.variants)}, {config.blocks} blocks "
                  f"x {config.steps} steps", flush=True)
            # Forked from a server that imported torch once (or from this command, under a warm launcher):
            # every variant is timed in the same ranks, so how they started weighs on none of the ratios.
            results = spawn(run_rank, config.nproc, args=(config,), timeout=config.timeout,
                            env=_rank_env(config), start_method="forkserver")[0]
    except PhalanxError as exc:
        print(f"phalanx bench: {exc}", file=sys.stderr, flush=True)
        return 1
    if results is not None:
        report(results, Path(config.out))
    return 0


if __name__ == "__main__":
    # Through the package name, so the functions sent to the ranks pickle as phalanx.tools.bench.*.
    from phalanx.tools.bench import main as _main

    sys.exit(_main())
