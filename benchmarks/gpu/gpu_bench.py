"""Every GPU figure of issue 36 in one run (under 8 minutes on an H100): phalanx DDP against torch DDP.

    python benchmarks/gpu/gpu_bench.py                       # on a GPU machine: world size 1, NCCL
    python benchmarks/gpu/gpu_bench.py --smoke               # on the CPU, tiny sizes: checks the logic only
    python benchmarks/gpu/gpu_bench.py --sections steps      # one part: steps, overlap, shard

GPT-2 small (124M parameters, 148 tensors: the head tied to the token embedding), bf16 autocast, fused
AdamW, world size 1. Every comparison is timed in interleaved blocks with CUDA events, in this process:
- steps: the plain model, torch DDP and phalanx DDP at 16 x 1024 tokens and at 1 x 256 (where host work
  dominates); peak memory of each, built alone;
- overlap: each bucket's collective delayed by a modelled time (torch.cuda._sleep on a communication
  stream, in a comm hook both engines run): the communication left exposed, against the same hook with
  no delay; it predicts how much of a multi-GPU exchange each engine hides under backward;
- shard: phalanx's shard levels, torch DDP and torch's fully_shard (FSDP2): step time and peak memory.
Writes a JSON and a markdown table (date, device, torch, CUDA, NCCL versions), goals marked; runs on
torch 2.11 and 2.13.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's phalanx, installed or not (a GPU machine's own torch)

import phalanx  # noqa: E402
from phalanx.tools.bench_compare import (  # noqa: E402
    add_json_flag,
    block_medians,
    interleave,
    median_of_steps,
    write_figures,
)
from phalanx.tools.bench_compare import paired_ratio as paired  # noqa: E402


def _example_gpt():
    """examples/gpt/model.py, under a name of its own (a plain `import model` could find another model.py)."""
    spec = importlib.util.spec_from_file_location("phalanx_example_gpt_model", ROOT / "examples" / "gpt" / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_gpt = _example_gpt()
GPT, GPTConfig = _gpt.GPT, _gpt.GPTConfig

GOALS = {"phalanx/torch large": 1.005, "phalanx/torch small": 1.03, "phalanx/plain large": 1.015,
         "peak memory phalanx/torch": 1.01, "exposed ms phalanx - torch": 0.5}
SHARD_LEVELS = ("none", "optimizer", "gradients", "parameters")


@dataclass
class Sizes:
    """What one run measures: GPT-2 small on a GPU, a toy with the same structure for --smoke."""

    vocab: int
    seq: int
    layers: int
    heads: int
    dim: int
    large_batch: int
    large_seq: int
    small_batch: int
    small_seq: int
    blocks: int
    steps: int
    warmup: int
    shard_batch: int
    small_blocks: int  # the small batch is host-bound: the VM host's jitter needs more rounds to average out
    small_steps: int


GPU_SIZES = Sizes(vocab=50257, seq=1024, layers=12, heads=12, dim=768, large_batch=16, large_seq=1024,
                  small_batch=1, small_seq=256, blocks=6, steps=10, warmup=2, shard_batch=8,
                  small_blocks=24, small_steps=20)
SMOKE_SIZES = Sizes(vocab=64, seq=16, layers=2, heads=2, dim=16, large_batch=2, large_seq=16, small_batch=1,
                    small_seq=8, blocks=2, steps=1, warmup=0, shard_batch=2, small_blocks=3,
                    small_steps=2)


# -- the model and one step -------------------------------------------------------------------------

def gpt2(sizes: Sizes, device: torch.device) -> torch.nn.Module:
    """GPT-2 small's shape on examples/gpt's model, the head tied to the token embedding (148 tensors)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=sizes.vocab, block_size=sizes.seq, n_layer=sizes.layers, n_head=sizes.heads,
                          d_model=sizes.dim))
    model.head.weight = model.token_embedding.weight
    return model.to(device)


def adamw(params, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")


def batch_of(sizes: Sizes, batch: int, seq: int, device: torch.device, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, sizes.vocab, (batch, seq + 1), generator=generator)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def train_step(model, optimizer, batch, device: torch.device) -> None:
    optimizer.zero_grad(set_to_none=True)
    # bf16 on the GPU; the CPU (--smoke) would run it through slow reference kernels
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        _, loss = model(*batch)
    loss.backward()
    optimizer.step()


class Timer:
    """Step times: CUDA events on a GPU (read after the block), the host clock on the CPU (--smoke)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def block(self, step, count: int) -> list[float]:
        if not self.cuda:
            times = []
            for _ in range(count):
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) * 1e3)
            return times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) for start, end in events]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def interleaved(built: dict, batch, sizes: Sizes, timer: Timer, device: torch.device, blocks: int | None = None,
                steps: int | None = None) -> dict:
    """Blocks of every variant in `built` ({name: (model, optimizer)}), the order rotating each round:
    per variant the median step time (ms) over all blocks and the per-block medians."""
    steps = steps or sizes.steps

    def block(name):
        model, optimizer = built[name]
        for _ in range(sizes.warmup):
            train_step(model, optimizer, batch, device)
        timer.sync()
        return timer.block(lambda: train_step(model, optimizer, batch, device), steps)

    times = interleave(list(built), blocks or sizes.blocks, block)
    return {name: {"median_ms": median_of_steps(blocks), "block_medians_ms": block_medians(blocks)}
            for name, blocks in times.items()}


def paired_ratio(result: dict, a: str, b: str) -> float:
    """Median over rounds of a's block median / b's of the same round."""
    return paired(result[a]["block_medians_ms"], result[b]["block_medians_ms"])


def ratio_spread(result: dict, a: str, b: str) -> dict:
    """How far the per-round ratios scatter (quartiles), and the ratio of the two variants' fastest blocks:
    a busy host only ever adds time, so the fastest block is the closest reading of a step's own cost."""
    ratios = sorted(x / y for x, y in zip(result[a]["block_medians_ms"], result[b]["block_medians_ms"]))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"q1": quartiles[0], "q3": quartiles[2],
            "fastest_blocks": min(result[a]["block_medians_ms"]) / min(result[b]["block_medians_ms"])}


def peak_memory(build, batch, device: torch.device, steps: int = 3) -> float | None:
    """Peak bytes allocated (MiB) while `build()` (alone on the device) trains a few steps; None on the CPU."""
    if device.type != "cuda":  # --smoke: the build and one step
        model, optimizer = build()
        train_step(model, optimizer, batch, device)
        return None
    _release()
    torch.cuda.reset_peak_memory_stats(device)
    model, optimizer = build()
    for _ in range(steps):
        train_step(model, optimizer, batch, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    del model, optimizer
    _release()
    return peak


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- variants ---------------------------------------------------------------------------------------

def build_variant(name: str, sizes: Sizes, device: torch.device):
    """(model, optimizer) for "plain", "torch", "phalanx", "phalanx-<level>" or "torch-fsdp2"."""
    module = gpt2(sizes, device)
    device_ids = [device.index] if device.type == "cuda" else None
    if name == "plain":
        return module, adamw(module.parameters(), device)
    if name == "torch":
        model = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
        return model, adamw(model.parameters(), device)
    if name == "torch-fsdp2":
        return fsdp2(module, device)
    level = name.split("-", 1)[1] if "-" in name else "none"
    model = phalanx.DistributedDataParallel(module, device_ids=device_ids, shard=level)
    return model, model.shard_optimizer(adamw(model.parameters(), device))


def fsdp2(module: torch.nn.Module, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # older torch
        from torch.distributed._composable.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    model = fully_shard(module, mesh=mesh)
    return model, adamw(model.parameters(), device)


# -- 1. step times and memory -----------------------------------------------------------------------

def section_steps(sizes: Sizes, device: torch.device, timer: Timer) -> dict:
    variants = ("plain", "torch", "phalanx")
    built = {name: build_variant(name, sizes, device) for name in variants}
    out = {}
    for label, batch, seq, blocks, steps in (
            ("large", sizes.large_batch, sizes.large_seq, sizes.blocks, sizes.steps),
            ("small", sizes.small_batch, sizes.small_seq, sizes.small_blocks, sizes.small_steps)):
        batch_ = batch_of(sizes, batch, seq, device)
        result = interleaved(built, batch_, sizes, timer, device, blocks, steps)
        out[label] = {"batch": batch, "seq": seq, "blocks": blocks, "steps": steps, "variants": result,
                      "phalanx/torch": paired_ratio(result, "phalanx", "torch"),
                      "phalanx/torch spread": ratio_spread(result, "phalanx", "torch"),
                      "phalanx/plain": paired_ratio(result, "phalanx", "plain"),
                      "torch/plain": paired_ratio(result, "torch", "plain")}
    del built
    _release()
    large = batch_of(sizes, sizes.large_batch, sizes.large_seq, device)
    out["peak_mib"] = {name: peak_memory(lambda name=name: build_variant(name, sizes, device), large, device)
                       for name in variants}
    return out


# -- 2. overlap: the collectives delayed by a modelled time -----------------------------------------

class DelayState:
    """What the delaying comm hook needs: the stream it delays, and the modelled time of a bucket."""

    def __init__(self, device: torch.device, alpha_ms: float, gb_per_s: float, ranks: int, cycles_per_ms: float):
        self.device = device
        self.alpha_ms, self.gb_per_s, self.ranks = alpha_ms, gb_per_s, ranks
        self.cycles_per_ms = cycles_per_ms
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.delay = True
        self.modelled_ms: list[float] = []

    def model_ms(self, nbytes: int) -> float:
        """A ring all-reduce of `nbytes` over `ranks` GPUs: alpha + 2 (n-1)/n bytes / bandwidth."""
        return self.alpha_ms + 2 * (self.ranks - 1) / self.ranks * nbytes / (self.gb_per_s * 1e9) * 1e3


def delayed_allreduce_hook(state: DelayState, bucket):
    """torch's contract (a GradBucket in, a future of the averaged buffer out), for both engines: the
    bucket's all-reduce runs on `state.stream` after a sleep of its modelled time."""
    tensor = bucket.buffer()
    group_size = dist.get_world_size()
    if state.stream is None:  # --smoke on the CPU: no stream to delay, the same hook otherwise
        tensor.div_(group_size)
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])
    state.stream.wait_stream(torch.cuda.current_stream(state.device))
    with torch.cuda.stream(state.stream):
        if state.delay:
            ms = state.model_ms(tensor.numel() * tensor.element_size())
            state.modelled_ms.append(ms)
            torch.cuda._sleep(int(ms * state.cycles_per_ms))
        tensor.div_(group_size)
        future = dist.all_reduce(tensor, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


def sleep_cycles_per_ms(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / start.elapsed_time(end)


def section_overlap(sizes: Sizes, device: torch.device, timer: Timer, args) -> dict:
    cycles = sleep_cycles_per_ms(device)
    states, built = {}, {}
    for name in ("torch", "phalanx"):
        model, optimizer = build_variant(name, sizes, device)
        states[name] = DelayState(device, args.alpha_ms, args.link_gb_per_s, args.model_ranks, cycles)
        model.register_comm_hook(states[name], delayed_allreduce_hook)
        built[name] = (model, optimizer)
    batch = batch_of(sizes, sizes.large_batch, sizes.large_seq, device)
    out = {"model": f"ring all-reduce over {args.model_ranks} GPUs: {args.alpha_ms} ms + 2(n-1)/n bytes / "
                    f"{args.link_gb_per_s} GB/s per bucket", "sleep_cycles_per_ms": cycles}
    for delay in (False, True):
        for state in states.values():
            state.delay = delay
            state.modelled_ms = []
        result = interleaved(built, batch, sizes, timer, device)
        out["delayed" if delay else "undelayed"] = result
    per_step = len(states["phalanx"].modelled_ms) / max(1, sizes.blocks * (sizes.steps + sizes.warmup))
    out["modelled_comm_ms_per_step"] = {name: sum(state.modelled_ms) / max(1, sizes.blocks * (sizes.steps
                                        + sizes.warmup)) for name, state in states.items()}
    out["buckets_per_step_phalanx"] = per_step
    out["exposed_ms"] = {name: out["delayed"][name]["median_ms"] - out["undelayed"][name]["median_ms"]
                         for name in built}
    out["exposed ms phalanx - torch"] = out["exposed_ms"]["phalanx"] - out["exposed_ms"]["torch"]
    del built
    _release()
    return out


# -- 3. the shard levels ----------------------------------------------------------------------------

def section_shard(sizes: Sizes, device: torch.device, timer: Timer) -> dict:
    names = ["torch", "torch-fsdp2"] + [f"phalanx-{level}" for level in SHARD_LEVELS]
    batch = batch_of(sizes, sizes.shard_batch, sizes.large_seq, device)
    out = {"batch": sizes.shard_batch, "seq": sizes.large_seq, "peak_mib": {}, "errors": {}}
    for name in names:
        try:
            out["peak_mib"][name] = peak_memory(lambda name=name: build_variant(name, sizes, device), batch, device)
        except Exception as exc:  # one variant failing must not cost the others' figures
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
    built = {}
    for name in names:
        if name not in out["errors"]:
            built[name] = build_variant(name, sizes, device)
    result = interleaved(built, batch, sizes, timer, device)
    out["variants"] = result
    out["ratio_to_torch"] = {name: paired_ratio(result, name, "torch") for name in result}
    del built
    _release()
    return out


# -- the report -------------------------------------------------------------------------------------

def environment(device: torch.device) -> dict:
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "platform": " ".join(os.uname()[::2]),
            "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None)
    return info


def goals(results: dict) -> list[tuple[str, float | None, float, bool | None]]:
    """(goal, measured, bound, met) for each goal of the issue that this run measured."""
    rows = []
    steps = results.get("steps")
    if steps and "large" in steps:
        rows.append(("phalanx/torch large", steps["large"]["phalanx/torch"], GOALS["phalanx/torch large"]))
        rows.append(("phalanx/torch small", steps["small"]["phalanx/torch"], GOALS["phalanx/torch small"]))
        rows.append(("phalanx/plain large", steps["large"]["phalanx/plain"], GOALS["phalanx/plain large"]))
        peaks = steps.get("peak_mib", {})
        if peaks.get("torch"):
            rows.append(("peak memory phalanx/torch", peaks["phalanx"] / peaks["torch"],
                         GOALS["peak memory phalanx/torch"]))
    overlap = results.get("overlap")
    if overlap and "exposed ms phalanx - torch" in overlap:
        rows.append(("exposed ms phalanx - torch", overlap["exposed ms phalanx - torch"],
                     GOALS["exposed ms phalanx - torch"]))
    return [(name, value, bound, value <= bound) for name, value, bound in rows]


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"GPU benchmark, {env['date']}: {env.get('gpu', env['device'])}, torch {env['torch']}, CUDA "
             f"{env['cuda']}, NCCL {env.get('nccl')}; world size 1, GPT-2 small shape "
             f"({results['tensors']} tensors, {results['params'] / 1e6:.1f}M parameters), bf16 autocast, "
             f"{'fused ' if env['device'].startswith('cuda') else ''}AdamW"
             f"{' (SMOKE: CPU, toy sizes, figures meaningless)' if results['smoke'] else ''}",
             "", "| goal | measured | bound | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {value:.4f} | {bound} | {'yes' if met else '**no**'} |"
              for name, value, bound, met in goals(results)]
    steps = results.get("steps")
    if steps:
        lines += ["", "| batch | plain ms | torch DDP ms | phalanx DDP ms | phalanx/torch | phalanx/plain "
                      "| torch/plain |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for label in ("large", "small"):
            s = steps[label]
            v = s["variants"]
            lines.append(f"| {s['batch']} x {s['seq']} | {v['plain']['median_ms']:.2f} | {v['torch']['median_ms']:.2f} "
                         f"| {v['phalanx']['median_ms']:.2f} | {s['phalanx/torch']:.4f} | {s['phalanx/plain']:.4f} "
                         f"| {s['torch/plain']:.4f} |")
        per_round = []
        for label in ("large", "small"):
            s, spread = steps[label], steps[label]["phalanx/torch spread"]
            per_round.append(f"{s['batch']} x {s['seq']}, {s['blocks']} rounds: {s['phalanx/torch']:.4f}, "
                             f"[{spread['q1']:.4f}, {spread['q3']:.4f}], {spread['fastest_blocks']:.4f}")
        lines.append("\nphalanx/torch per round (median of per-round ratios of block medians; quartiles; ratio "
                     "of the fastest blocks): " + "; ".join(per_round))
        peaks = steps["peak_mib"]
        if peaks.get("torch"):
            lines.append("\npeak memory (MiB, each built alone, large batch): "
                         + ", ".join(f"{name} {mib:.0f}" for name, mib in peaks.items()))
    overlap = results.get("overlap")
    if overlap and "exposed_ms" in overlap:
        lines += ["", f"overlap ({overlap['model']}; {overlap['modelled_comm_ms_per_step']['phalanx']:.1f} ms "
                      "modelled per step):", "| engine | undelayed ms | delayed ms | exposed ms |",
                  "| --- | --- | --- | --- |"]
        for name in ("torch", "phalanx"):
            lines.append(f"| {name} | {overlap['undelayed'][name]['median_ms']:.2f} | "
                         f"{overlap['delayed'][name]['median_ms']:.2f} | {overlap['exposed_ms'][name]:.2f} |")
    shard = results.get("shard")
    if shard and "variants" in shard:
        lines += ["", f"shard levels ({shard['batch']} x {shard['seq']}):", "| variant | step ms | /torch DDP | "
                  "peak MiB |", "| --- | --- | --- | --- |"]
        for name, v in shard["variants"].items():
            peak = shard["peak_mib"].get(name)
            lines.append(f"| {name} | {v['median_ms']:.2f} | {shard['ratio_to_torch'][name]:.4f} | "
                         f"{'' if peak is None else f'{peak:.0f}'} |")
        for name, error in shard["errors"].items():
            lines.append(f"\n{name} failed: {error}")
    for name, error in results.get("errors", {}).items():
        lines.append(f"\nsection {name} failed: {error}")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: the logic, not the figures")
    parser.add_argument("--sections", default="steps,overlap,shard", help="which parts (default all three)")
    parser.add_argument("--out", default="bench-results/gpu", help="directory for gpu_bench.json and gpu_bench.md")
    parser.add_argument("--model-ranks", type=int, default=8, help="GPUs the overlap section models (default 8)")
    parser.add_argument("--link-gb-per-s", type=float, default=25.0,
                        help="bandwidth per link in the modelled ring, GB/s (default 25: 200 Gb/s InfiniBand)")
    parser.add_argument("--alpha-ms", type=float, default=0.02, help="latency per modelled collective (0.02 ms)")
    add_json_flag(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    owns_world = not dist.is_initialized()
    if args.smoke:
        os.environ.setdefault("PHALANX_BACKEND", "gloo")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    if owns_world:
        phalanx.init()
    device = torch.device("cpu") if args.smoke or not torch.cuda.is_available() else phalanx.device()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    timer = Timer(device)
    probe = gpt2(sizes, device)
    results = {"environment": environment(device), "smoke": args.smoke, "sizes": sizes.__dict__,
               "tensors": len(list(probe.parameters())), "params": sum(p.numel() for p in probe.parameters()),
               "argv": list(argv if argv is not None else sys.argv[1:]), "errors": {}, "section_seconds": {}}
    del probe
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = {"steps": lambda: section_steps(sizes, device, timer),
                "overlap": lambda: section_overlap(sizes, device, timer, args),
                "shard": lambda: section_shard(sizes, device, timer)}
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        begun = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception as exc:  # record it and go on: the other sections' figures still count
            results["errors"][name] = f"{type(exc).__name__}: {exc}"
            if args.smoke:
                raise
        results["section_seconds"][name] = round(time.perf_counter() - begun, 1)
        print(f"[gpu_bench] {name}: {results['section_seconds'][name]} s", flush=True)
        # each section's figures on disk at once: a run cut short by a time limit keeps what it measured
        (out / "gpu_bench.partial.json").write_text(json.dumps(results, indent=2) + "\n")
    results["goals"] = [{"goal": n, "measured": v, "bound": b, "met": m} for n, v, b, m in goals(results)]
    results["seconds"] = round(time.perf_counter() - started, 1)
    (out / "gpu_bench.partial.json").unlink(missing_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (out / "gpu_bench.md").write_text(table)
    write_figures(args.json_path, {goal["goal"]: round(goal["measured"], 4) for goal in results["goals"]},
                  errors=results["errors"])
    print(table, flush=True)
    if owns_world:
        with contextlib.suppress(Exception):
            phalanx.shutdown()
    return results


if __name__ == "__main__":
    main()
