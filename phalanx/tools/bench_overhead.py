"""`phalanx bench --overhead`: the host work DDP adds to a step, phalanx's engine against torch's reducer.

A model of a few hundred tiny tensors at world size 1, where a step is almost all framework work. The
plain model, torch DDP and phalanx DDP train in interleaved blocks, the order rotating each round. Each
step is timed in the process's CPU time, not wall time: a busy machine takes the CPU away from the
benchmark (wall time then counts the others' work), CPU time only slows down. What a DDP adds is its
block's mean less the plain model's of the same round; the figures are medians over many rounds
(docs/benchmarks.md: why this estimator, measured on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BenchConfigError, PhalanxError, explain
from ..launch.spawn import spawn
from .bench_compare import interleave
from .bench_report import environment, write_json

VARIANTS = ("plain", "torch", "phalanx")
SCHEMA = "phalanx-bench-overhead/1"


@dataclass
class OverheadConfig:
    layers: int = 100
    width: int = 8
    batch: int = 4
    rounds: int = 600
    steps: int = 4
    warmup: int = 1
    device: str = "cpu"
    profile_steps: int = 0
    cpu: int | None = None  # the one CPU the benchmark runs on; None: wherever the scheduler puts it
    out: str = "bench-results/overhead.json"
    timeout: float = 3600.0
    argv: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx bench --overhead", description="The host time per step that "
                                     "phalanx DDP and torch DDP add to the plain model, at world size 1, on a "
                                     "model of many tiny tensors; interleaved blocks in one launch.")
    parser.add_argument("--overhead", action="store_true", help="(selects this benchmark)")
    parser.add_argument("--layers", type=int, default=100, help="Linear(width, width) layers: 2 tensors each "
                        "(default 100: 200 tensors)")
    parser.add_argument("--width", type=int, default=8, help="width of each layer (default 8)")
    parser.add_argument("--batch", type=int, default=4, help="samples per step (default 4)")
    parser.add_argument("--rounds", type=int, help="rounds of one block per variant (default 600; 3 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per block (default 4; 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each block (default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (Gloo) or cuda (NCCL; host "
                        "time still: each block is synchronized after its last step, outside the timing)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS", help="then profile this many phalanx "
                        "and plain steps with cProfile: where phalanx's added host time goes (default 0: off)")
    parser.add_argument("--cpu", default="first", help="the one CPU the benchmark's threads run on: a number, "
                        "'first' (default: the lowest this process may use) or 'any' (the scheduler's choice). "
                        "Two vCPUs of one VM can differ by a third in speed: unpinned, a launch measures "
                        "whichever it landed on")
    parser.add_argument("--quick", action="store_true", help="tiny counts, for smoke tests (figures meaningless)")
    parser.add_argument("--out", default="bench-results/overhead.json", help="JSON results file "
                        "(default bench-results/overhead.json)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is stopped "
                        "(default 3600)")
    return parser


def parse_config(argv: list[str]) -> OverheadConfig:
    args = build_parser().parse_args(argv)
    config = OverheadConfig(layers=args.layers, width=args.width, batch=args.batch,
                            rounds=args.rounds if args.rounds is not None else (3 if args.quick else 600),
                            steps=args.steps if args.steps is not None else (2 if args.quick else 4),
                            warmup=args.warmup, device=args.device, profile_steps=args.profile,
                            cpu=_cpu_choice(args.cpu), out=args.out, timeout=args.timeout, argv=list(argv))
    for name in ("layers", "width", "batch", "rounds", "steps"):
        if getattr(config, name) < 1:
            raise BenchConfigError(explain(f"--{name} must be positive", seen=getattr(config, name), expected=">= 1"))
    if config.warmup < 0 or config.profile_steps < 0:
        raise BenchConfigError(explain("--warmup and --profile must not be negative",
                                       seen=f"{config.warmup}, {config.profile_steps}", expected=">= 0"))
    if config.device == "cuda" and not torch.cuda.is_available():
        raise BenchConfigError(explain(
            "--device cuda needs a CUDA GPU", seen=f"torch {torch.__version__} reports none",
            expected="a visible CUDA device", fix="Drop --device cuda to measure the host work on the CPU."))
    return config


def _cpu_choice(text: str) -> int | None:
    if text == "any":
        return None
    # Pinning is Linux's (sched_setaffinity); elsewhere 'first' leaves the benchmark unpinned, as 'any' does.
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if text == "first":
        return allowed[0] if allowed else None
    if not text.isdigit() or int(text) not in allowed:
        raise BenchConfigError(explain("--cpu names a CPU this process may not run on", seen=text,
                                       expected=f"one of {allowed}, 'first' or 'any'"))
    return int(text)


def _pin(cpu: int) -> None:
    """Every thread of this process (the process group's too) onto `cpu`; threads made later inherit it."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), {cpu})
        except OSError:  # a thread that ended meanwhile
            pass


# -- the estimator (pure) ---------------------------------------------------------------------------

def added_host_time(blocks: dict[str, list[list[float]]]) -> dict:
    """From per-round blocks of step times (ms) of "plain", "torch" and "phalanx": what each DDP adds.

    Per round, each block gives its mean step time, and each DDP's mean less the plain model's of the
    same round is what it added then (the three blocks of a round ran within a few hundred ms of each
    other, on the same state of the machine). The figures are the medians over rounds; the ratio is
    phalanx's median over torch's.

    >>> added_host_time({"plain": [[5, 5], [6, 6]], "torch": [[7, 7], [8, 8]], "phalanx": [[6, 6], [7, 7]]})["ratio"]
    0.5
    """
    rounds = len(blocks["plain"])
    mean = {v: [statistics.fmean(block) for block in blocks[v]] for v in VARIANTS}
    added = {v: statistics.median(mean[v][r] - mean["plain"][r] for r in range(rounds)) for v in ("torch", "phalanx")}
    return {"plain_ms": statistics.median(mean["plain"]), "torch_added_ms": added["torch"],
            "phalanx_added_ms": added["phalanx"],
            "ratio": added["phalanx"] / added["torch"] if added["torch"] > 0 else float("nan"), "rounds": rounds}


# -- what runs in the benchmark's process -----------------------------------------------------------

def tiny_tensors_model(layers: int, width: int) -> nn.Module:
    """`layers` x Linear(width, width): 2 x layers tiny tensors, a step of almost nothing but framework work."""
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _build(variant: str, config: OverheadConfig, device: torch.device):
    torch.manual_seed(0)
    module = tiny_tensors_model(config.layers, config.width).to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    if variant == "torch":
        module = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
    elif variant == "phalanx":
        import phalanx

        module = phalanx.DistributedDataParallel(module, device_ids=device_ids)
    return module, torch.optim.SGD(module.parameters(), lr=1e-3)


def _step(module, optimizer, batch) -> None:
    optimizer.zero_grad(set_to_none=True)
    inputs, target = batch
    F.mse_loss(module(inputs), target).backward()
    optimizer.step()


def _block(module, optimizer, batch, warmup: int, steps: int, sync) -> list[float]:
    for _ in range(warmup):
        _step(module, optimizer, batch)
    sync()
    clock = time.process_time
    times = []
    for _ in range(steps):
        start = clock()
        _step(module, optimizer, batch)
        times.append((clock() - start) * 1e3)
    sync()
    return times


def run(rank: int, config: OverheadConfig) -> dict:
    """The whole benchmark in this process (a world of one)."""
    from ..world import group as world

    device = world.device()
    torch.set_num_threads(1)
    if config.cpu is not None:
        _pin(config.cpu)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    batch = tuple(torch.randn(config.batch, config.width, generator=generator).to(device) for _ in range(2))
    built = {variant: _build(variant, config, device) for variant in VARIANTS}
    blocks = interleave(VARIANTS, config.rounds,
                        lambda variant: _block(*built[variant], batch, config.warmup, config.steps, sync))
    summary = added_host_time(blocks)
    figures = {"phalanx/torch added": round(summary["ratio"], 3), "torch adds ms": round(summary["torch_added_ms"], 3),
               "phalanx adds ms": round(summary["phalanx_added_ms"], 3)}
    results = {"schema": SCHEMA, "environment": environment(device), "config": asdict(config),
               "tensors": 2 * config.layers, "summary": summary, "figures": figures, "blocks_ms": blocks}
    if config.profile_steps:
        results["profile"] = profile_added(built, batch, config.profile_steps, sync)
    return results


# -- where phalanx's added time goes ----------------------------------------------------------------

PROFILE_PARTS = (  # (label, file fragment, function): cumulative times, per step
    ("DDP forward, less the module's forward", "engine/ddp.py", "forward"),
    ("gradient hooks (the launches included)", "engine/reducer.py", "on_grad_accumulated"),
    ("  launch: copy in, tag, start the all-reduce", "engine/reducer.py", "_launch"),
    ("end of backward: wait, copy out, used map", "engine/reducer.py", "_finalize"),
)
PROFILE_AREAS = (  # (label, file fragment): own times of every function in these files, per step
    ("reducer (engine/reducer.py)", "engine/reducer.py"),
    ("DDP front (engine/ddp.py)", "engine/ddp.py"),
    ("buckets (bucket/buckets.py)", "bucket/buckets.py"),
    ("step guard (bucket/step_guard.py)", "bucket/step_guard.py"),
    ("exchange (exchange/)", "exchange/"),
    ("record of collectives (diagnose/)", "diagnose/"),
)


def profile_added(built: dict, batch, steps: int, sync) -> dict:
    """cProfile over `steps` phalanx steps: the time of phalanx's parts per step (cProfile slows Python
    calls, so these are shares of a profiled step, not clean times), and the plain step under the same
    profiler for scale."""
    per_step = {}
    stats_of = {}
    for variant in ("plain", "phalanx"):
        module, optimizer = built[variant]
        _step(module, optimizer, batch)
        sync()
        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
        for _ in range(steps):
            _step(module, optimizer, batch)
        sync()
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats_of[variant] = stats.stats
        per_step[variant] = stats.total_tt / steps * 1e3
    stats = stats_of["phalanx"]
    parts = {}
    for label, fragment, name in PROFILE_PARTS:
        found = [(key, value) for key, value in stats.items() if fragment in key[0] and key[2] == name]
        cumulative = sum(value[3] for _, value in found)
        if name == "forward":  # less the wrapped module's own forward (called from _run_module)
            cumulative -= sum(caller_value[3] for key, value in stats.items() if key[2] == "_wrapped_call_impl"
                              for caller, caller_value in value[4].items()
                              if fragment in caller[0] and caller[2] == "_run_module")
        parts[label] = cumulative / steps * 1e3
    areas = {label: sum(value[2] for key, value in stats.items() if fragment in key[0].replace("\\", "/")) / steps
             * 1e3 for label, fragment in PROFILE_AREAS}
    top = sorted(((value[2], key) for key, value in stats.items()
                  if "phalanx" in key[0] and "tools" not in key[0]), reverse=True)[:12]  # the engine, not this harness
    return {"steps": steps, "step_ms": per_step, "parts_ms": parts, "own_time_by_area_ms": areas,
            "top_own_time_ms": [{"function": f"{_short(key[0])}:{key[1]}({key[2]})", "ms_per_step": tt / steps * 1e3}
                                for tt, key in top]}


def _short(path: str) -> str:
    path = path.replace("\\", "/")
    return path[path.rindex("phalanx/"):] if "phalanx/" in path else path


# -- the report -------------------------------------------------------------------------------------

def format_report(results: dict) -> str:
    s, env, config = results["summary"], results["environment"], results["config"]
    lines = [f"phalanx bench --overhead: {results['tensors']} tensors (Linear({config['width']}, {config['width']}) "
             f"x {config['layers']}), batch {config['batch']}, world size 1, {config['device']}; "
             f"{s['rounds']} rounds x {config['steps']} steps, host CPU time per step",
             f"torch {env['torch']}, {env.get('gpu') or env['cpu']}, "
             f"{'on CPU ' + str(config['cpu']) if config.get('cpu') is not None else 'on any CPU'}, "
             f"load average {env['load_average_1min_at_end']}",
             f"plain step          {s['plain_ms']:8.3f} ms",
             f"torch DDP adds      {s['torch_added_ms']:8.3f} ms",
             f"phalanx DDP adds    {s['phalanx_added_ms']:8.3f} ms",
             f"phalanx/torch added {s['ratio']:8.3f}   (<= 1: phalanx adds no more than torch)"]
    profile = results.get("profile")
    if profile:
        lines.append(f"\nprofile (cProfile, {profile['steps']} steps; profiled step: plain "
                     f"{profile['step_ms']['plain']:.3f} ms, phalanx {profile['step_ms']['phalanx']:.3f} ms)")
        lines += [f"  {label:<46} {ms:7.3f} ms" for label, ms in profile["parts_ms"].items()]
        lines.append("  own time by area:")
        lines += [f"    {label:<44} {ms:7.3f} ms" for label, ms in profile["own_time_by_area_ms"].items()]
        lines.append("  functions with the most own time:")
        lines += [f"    {row['function']:<70} {row['ms_per_step']:7.3f} ms" for row in profile["top_own_time_ms"]]
    return "\n".join(lines)


def _env(config: OverheadConfig) -> dict:
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if config.device == "cpu":
        env.update(PHALANX_BACKEND="gloo", CUDA_VISIBLE_DEVICES="")
    else:
        env.update(PHALANX_BACKEND="nccl")
    return env


def main(argv: list[str]) -> int:
    """`phalanx bench --overhead [...]`; returns the exit status."""
    try:
        config = parse_config(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    except BenchConfigError as exc:
        print(f"phalanx bench --overhead: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"[bench --overhead] {2 * config.layers} tensors, {config.rounds} rounds x {len(VARIANTS)} variants x "
          f"{config.steps} steps on {config.device}", flush=True)
    try:
        [results] = spawn(run, 1, args=(config,), timeout=config.timeout, env=_env(config))
    except PhalanxError as exc:
        print(f"phalanx bench --overhead: {exc}", file=sys.stderr, flush=True)
        return 1
    print(format_report(results), flush=True)
    print(f"\nresults: {write_json(results, Path(config.out))}", flush=True)
    return 0
