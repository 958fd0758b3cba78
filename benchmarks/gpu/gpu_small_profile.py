"""Where a host-bound GPU step goes: GPT-2 small at 1 x 256 tokens (gpu_bench's small batch), plain, torch
DDP and phalanx DDP, world size 1.

    python benchmarks/gpu/gpu_small_profile.py [--rounds 20 --steps 20] [--out DIR]

Prints, per variant: the launching thread's CPU time per step and the wall time per step (interleaved
blocks, the order rotating), the CUDA runtime calls and kernels of one step (torch.profiler), and the
Python functions phalanx's step spends its host time in (cProfile).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb
import torch

import phalanx
from phalanx.tools.bench_compare import add_json_flag, interleave, write_figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default="plain,torch,phalanx,phalanx-view")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-results/gpu"))
    add_json_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("PHALANX_BACKEND", "gloo")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    phalanx.init()
    device = torch.device("cpu") if args.smoke else phalanx.device()
    sizes = gb.SMOKE_SIZES if args.smoke else gb.GPU_SIZES
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def build(name):
        if name == "phalanx-view":
            module = gb.gpt2(sizes, device)
            model = phalanx.DistributedDataParallel(module, device_ids=[device.index] if cuda else None,
                                                    gradient_as_bucket_view=True)
            return model, gb.adamw(model.parameters(), device)
        return gb.build_variant(name, sizes, device)

    names = [n.strip() for n in args.variants.split(",")]
    built = {name: build(name) for name in names}
    batch = gb.batch_of(sizes, sizes.small_batch, sizes.small_seq, device)
    for model, optimizer in built.values():
        for _ in range(5):
            gb.train_step(model, optimizer, batch, device)
    sync()

    per = {name: {"thread_cpu_ms": [], "process_cpu_ms": [], "wall_ms": []} for name in names}

    def block(name):
        model, optimizer = built[name]
        gb.train_step(model, optimizer, batch, device)
        sync()
        t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            gb.train_step(model, optimizer, batch, device)
        t1, p1 = time.thread_time(), time.process_time()
        sync()
        w1 = time.perf_counter()
        per[name]["thread_cpu_ms"].append((t1 - t0) / args.steps * 1e3)
        per[name]["process_cpu_ms"].append((p1 - p0) / args.steps * 1e3)
        per[name]["wall_ms"].append((w1 - w0) / args.steps * 1e3)

    interleave(names, args.rounds, block)
    summary = {}
    for name, series in per.items():
        summary[name] = {key: {"median": round(statistics.median(v), 3), "min": round(min(v), 3)}
                         for key, v in series.items()}
        print(name, json.dumps(summary[name]), flush=True)

    profiles = {}
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for name in names:
        model, optimizer = built[name]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                gb.train_step(model, optimizer, batch, device)
            sync()
        counts = collections.Counter()
        gpu_us = 0.0
        for event in prof.events():
            if event.name.startswith("cuda") or event.name.startswith("cu"):
                counts[event.name] += 1
            if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
                counts["<gpu kernels>"] += 1
                gpu_us += event.device_time_total if hasattr(event, "device_time_total") else 0
        profiles[name] = {k: round(v / 3, 1) for k, v in counts.most_common(14)}
        profiles[name]["<gpu busy ms/step>"] = round(gpu_us / 3 / 1e3, 3)
        print(name, "per step:", json.dumps(profiles[name]), flush=True)
        if name in ("torch", "phalanx"):
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)

    model, optimizer = built["phalanx"]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        gb.train_step(model, optimizer, batch, device)
    sync()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
    print(stream.getvalue()[:6000], flush=True)
    # Which of those are the engine's own: on a machine where torch's calls fill the top 30, its
    # hooks and bucket bookkeeping still show here.
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(r"[/\\]phalanx[/\\]", 15)
    print("phalanx's own functions, by their own time:", flush=True)
    print(stream.getvalue().split("\n\n", 2)[-1][:4000], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "small_profile.json").write_text(json.dumps({"env": gb.environment(device), "args": vars(args),
                                                         "summary": summary, "per": per,
                                                         "profiles": profiles}, indent=1))
    write_figures(args.json_path, {f"{name} {key} ms": summary[name][key]["median"] for name in summary
                                   for key in ("process_cpu_ms", "wall_ms")}, summary=summary)
    phalanx.shutdown()


if __name__ == "__main__":
    main()
